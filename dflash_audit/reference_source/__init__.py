"""Resolve the reference (vllm-project/speculators) to a source tree, cache it, record its identity,
and start the reference process.

Spec forms accepted by :func:`resolve_reference` (the CLI's ``--ref``):

- ``speculators@<branch|tag|sha>``: git clone of the reference URL, then that ref. The URL is
  https://github.com/vllm-project/speculators unless overridden by the ``url`` argument (the CLI's
  ``--ref-url``) or ``$DFLASH_AUDIT_REF_URL``; local paths and ``file://`` URLs work.
- ``speculators==X.Y.Z``: that release's source distribution from the package index (pip), its
  sha256 checked against ``reference/speculators.lock`` when it is the locked version.
- ``path:DIR``: a local checkout (DIR holds ``src/speculators``), used in place.
- ``None``: the lock file's spec.

Cache layout under ``$DFLASH_AUDIT_CACHE`` (default ``~/.cache/dflash-audit``) ``/reference/``::

    git/mirrors/<name>-<hash of url>.git    bare mirror (branches + tags), fetched once, updated
                                            when a ref is not found locally or a branch is asked for
    git/checkouts/<commit sha>/             one detached checkout per resolved commit
    sdist/<sha256>/<file>.tar.gz + tree/    a downloaded release and its extracted tree
    sdist/index/<version>.json              which sha256 a version resolved to (offline reuse)

A second resolve of a tag, a commit sha or a release does not touch the network. A branch is
re-fetched (its head moves) unless ``offline=True``; if the remote is then unreachable the error
names the cached head commit instead of silently using it.

The reference runs in a subprocess (:func:`run_reference`) from its resolved source tree; its
errors come back through ``<workdir>/error.json`` and are raised as the exceptions below.
"""


from dflash_audit.reference_source.git_mirror import (
    DEFAULT_GIT_URL,
    REF_URL_ENV,
    git_version,
    known_refs,
)
from dflash_audit.reference_source.identity import (
    CACHE_ENV,
    PACKAGE,
    REQUIRED_PATHS,
    SOURCE_ENV,
    ReferenceIdentity,
    ReferenceLock,
    ReferenceResolutionError,
    ReferenceSourceError,
    adapter_path,
    cache_root,
    discard_damaged_tree,
    load_lock,
    missing_dflash_paths,
    read_version,
    reference_dir,
)
from dflash_audit.reference_source.import_probe import (
    REFERENCE_IMPORT_DEPS,
    check_reference_importable,
)
from dflash_audit.reference_source.runner import (
    PIP_NAMES,
    ReferenceApiMismatchError,
    ReferenceMissingDependencyError,
    ReferenceRun,
    ReferenceRunError,
    ReferenceTimeoutError,
    ReferenceWrongSourceError,
    install_command,
    reference_env,
    run_reference,
)
from dflash_audit.reference_source.spec import parse_spec, resolve_reference

__all__ = [
    "CACHE_ENV", "DEFAULT_GIT_URL", "PACKAGE", "PIP_NAMES", "REFERENCE_IMPORT_DEPS", "REF_URL_ENV",
    "REQUIRED_PATHS", "SOURCE_ENV", "ReferenceApiMismatchError", "ReferenceIdentity",
    "ReferenceLock", "ReferenceMissingDependencyError", "ReferenceResolutionError", "ReferenceRun",
    "ReferenceRunError", "ReferenceSourceError", "ReferenceTimeoutError",
    "ReferenceWrongSourceError", "adapter_path", "cache_root", "check_reference_importable",
    "discard_damaged_tree",
    "git_version", "install_command", "known_refs", "load_lock", "missing_dflash_paths",
    "parse_spec", "read_version", "reference_dir", "reference_env", "resolve_reference",
    "run_reference",
]
