"""``path:DIR``: a local speculators checkout, used in place."""

from __future__ import annotations

import hashlib
from pathlib import Path

import git

from dflash_audit.reference_source.git_mirror import git_version
from dflash_audit.reference_source.identity import (
    PACKAGE,
    ReferenceIdentity,
    ReferenceResolutionError,
    _now,
    _require_dflash,
    missing_dflash_paths,
    read_version,
)


def _resolve_path(spec: str, directory: Path) -> ReferenceIdentity:
    directory = directory.expanduser().resolve()
    if not directory.is_dir():
        raise ReferenceResolutionError(
            f"--ref {spec}: {directory} is not a directory; point path: at the root of a "
            "speculators checkout, or audit against the pinned release: --ref speculators==0.9.0."
        )
    if not (directory / "src" / PACKAGE).is_dir():
        raise ReferenceResolutionError(
            f"--ref {spec}: {directory} has no src/{PACKAGE}; point path: at the root of a "
            "speculators checkout (the folder that holds src/ and pyproject.toml)."
        )
    _require_dflash(missing_dflash_paths(directory), str(directory))
    mtime = max(
        (p.stat().st_mtime_ns for p in (directory / "src" / PACKAGE).rglob("*.py")), default=0
    )
    short_id = hashlib.sha256(f"{directory}\0{mtime}".encode()).hexdigest()[:12]
    commit = dirty = None
    version = read_version(directory)
    try:
        repo = git.Repo(directory)
        commit, dirty = repo.head.commit.hexsha, repo.is_dirty()
        version = version or git_version(repo, commit, directory)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, ValueError):
        pass
    return ReferenceIdentity(
        kind="path",
        spec=spec,
        source_dir=directory,
        short_id=short_id,
        resolved_at=_now(),
        commit=commit,
        dirty=dirty,
        version=version,
    )
