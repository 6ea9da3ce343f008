"""The source tree of ``--candidate framework:speculators@REF|==X.Y.Z|:path:DIR``: resolved and
cached exactly as ``--ref`` resolves the reference (:mod:`dflash_audit.reference_source`), and
what the candidate process needs to import it (:mod:`.speculators_adapter`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError

#: Where :mod:`.speculators_adapter` (in the candidate process) finds the candidate's
#: speculators source (``<tree>/src``).
FRAMEWORK_SOURCE_ENV = "DFLASH_AUDIT_FRAMEWORK_SOURCE"
#: The tree's version as resolved here (release version, else ``git describe`` or commit),
#: for trees whose package carries none (a git checkout without a generated version.py).
FRAMEWORK_VERSION_ENV = "DFLASH_AUDIT_FRAMEWORK_VERSION"


def display_version(identity: Any) -> str:
    """The version a report names for a resolved speculators tree: ``REF@commit`` (and the
    tree's own version) for a git ref, the release version for a release, else the tree's
    version or short id."""
    if identity.kind == "git" and identity.commit:
        own = f" ({identity.version})" if identity.version else ""
        return f"{identity.ref or 'commit'}@{identity.commit[:7]}{own}"
    return str(identity.version or identity.short_id)


def resolve_speculators(ref: str | None, *, url: str | None = None, offline: bool = False
                        ) -> tuple[Any, list[str], dict[str, str]]:
    """Resolve ``ref`` (``speculators@REF``, ``speculators==X.Y.Z``, ``path:DIR``; None: the
    lock's spec) to a verified, cached source tree.

    Args:
        url: git URL for ``speculators@REF`` (else ``$DFLASH_AUDIT_REF_URL``, else GitHub);
            ignored for the other forms.

    Returns:
        ``(ReferenceIdentity, PYTHONPATH entries, environment variables)`` of the candidate
        process: its ``src/`` first on the path and :data:`FRAMEWORK_SOURCE_ENV` naming it.

    Raises:
        CompareSetupError: the ref cannot be resolved (unknown, unreachable, offline and not
            cached, no DFlash modules), with what to do.
    """
    from dflash_audit import reference_source as rs

    try:
        kind = rs.parse_spec(ref)[0] if ref else None
        identity = rs.resolve_reference(ref, url=url if kind == "git" else None,
                                        offline=offline)
    except rs.ReferenceSourceError as exc:
        raise CompareSetupError(f"--candidate framework:{ref or 'speculators'}: {exc}"
                                ) from None
    src = str(Path(identity.src_dir).resolve())
    return identity, [src], {FRAMEWORK_SOURCE_ENV: src,
                             FRAMEWORK_VERSION_ENV: display_version(identity)}
