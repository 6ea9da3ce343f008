"""Spec parsing and dispatch: ``--ref`` -> (kind, value) -> the git, sdist or path resolver."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_audit.reference_source.git_mirror import _git_url, _resolve_git
from dflash_audit.reference_source.identity import (
    PACKAGE,
    ReferenceIdentity,
    ReferenceLock,
    ReferenceResolutionError,
    cache_root,
    load_lock,
)
from dflash_audit.reference_source.local_path import _resolve_path
from dflash_audit.reference_source.sdist import _resolve_sdist

_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]*$")


# --- resolve ----------------------------------------------------------------------------------


def resolve_reference(
    spec: str | None = None,
    *,
    url: str | None = None,
    cache_dir: Path | str | None = None,
    lock: ReferenceLock | None = None,
    offline: bool = False,
    git_timeout_s: float = 600.0,
) -> ReferenceIdentity:
    """Resolve ``spec`` to a verified, cached source tree and return its identity.

    Args:
        spec: ``speculators@REF`` | ``speculators==X.Y.Z`` | ``path:DIR`` | None (the lock's spec).
        url: git URL for ``speculators@REF`` (else ``$DFLASH_AUDIT_REF_URL``, else GitHub).
        cache_dir: cache base (else ``$DFLASH_AUDIT_CACHE``, else ``~/.cache/dflash-audit``).
        lock: the lock to verify sdists against (default: ``reference/speculators.lock``).
        offline: never contact the remote; a branch resolves to its cached head.
        git_timeout_s: limit for one clone/fetch.

    Raises:
        ReferenceResolutionError: bad spec; unreachable remote; unknown ref; a source without
            the DFlash modules; failed pip download; sha256 mismatch; missing lock.
    """
    if spec is None:
        lock = lock or load_lock()
        if url is not None:
            raise ReferenceResolutionError(
                f"--ref-url applies to --ref speculators@<ref>, but no --ref was given and the "
                f"default reference is {lock.spec} (from the lock). Pass e.g. --ref "
                f"speculators@{lock.git_tag or 'v' + str(lock.version)} to clone it from {url}."
            )
        spec = lock.spec
    spec = spec.strip()
    kind, value = parse_spec(spec)
    if kind != "git" and url is not None:
        raise ReferenceResolutionError(
            f"--ref-url ({url}) only applies to --ref speculators@<ref>, not to {spec!r}."
        )
    root = cache_root(cache_dir)
    if kind == "git":
        return _resolve_git(spec, value, _git_url(url), root, offline, git_timeout_s)
    if kind == "sdist":
        return _resolve_sdist(spec, value, root, lock, offline)
    return _resolve_path(spec, Path(value))


def parse_spec(spec: str) -> tuple[str, str]:
    """Split a spec into (kind, value): ("git", ref) | ("sdist", version) | ("path", dir).

    Raises:
        ReferenceResolutionError: the spec has none of the three forms.
    """
    if spec.startswith(f"{PACKAGE}@"):
        ref = spec[len(PACKAGE) + 1 :]
        if not ref or ref.startswith("-") or any(c.isspace() or ord(c) < 32 for c in ref):
            raise ReferenceResolutionError(f"invalid git ref {ref!r} in --ref {spec!r}.")
        return "git", ref
    if spec.startswith(f"{PACKAGE}=="):
        version = spec[len(PACKAGE) + 2 :]
        if not _VERSION_RE.match(version):
            raise ReferenceResolutionError(f"invalid version {version!r} in --ref {spec!r}.")
        return "sdist", version
    if spec.startswith("path:") and len(spec) > 5:
        return "path", spec[5:]
    raise ReferenceResolutionError(
        f"unrecognised reference spec {spec!r}. Use one of: speculators@<branch|tag|sha> "
        "(git clone), speculators==X.Y.Z (release from the package index), path:DIR (a local "
        "checkout)."
    )
