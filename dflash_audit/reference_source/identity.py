"""What a resolved reference is: its identity, the lock, the cache and ``reference/`` locations,
the checks that a source tree holds the DFlash modules, and the errors of resolution."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dflash_audit

CACHE_ENV = "DFLASH_AUDIT_CACHE"
SOURCE_ENV = "DFLASH_AUDIT_REFERENCE_SOURCE"
PACKAGE = "speculators"

#: Files / folders (relative to the source root) without which the tree is not a DFlash reference.
REQUIRED_PATHS: tuple[str, ...] = (
    "src/speculators/models/dflash/core.py",
    "src/speculators/models/dflash/attention.py",
    "src/speculators/models/dflash/utils.py",
    "src/speculators/models/dflash/config.py",
    "src/speculators/losses",
)


# --- errors -----------------------------------------------------------------------------------


class ReferenceSourceError(ReferenceError):
    """Base of every error of this package (a subclass of the built-in ``ReferenceError``)."""


class ReferenceResolutionError(ReferenceSourceError):
    """The spec could not be turned into a verified source tree (bad spec, unreachable remote,
    unknown ref, no DFlash modules, failed download, sha256 mismatch, missing lock)."""


@dataclass
class ReferenceIdentity:
    """What was resolved; recorded in every report (``to_dict`` is JSON-able).

    kind: "git" | "sdist" | "path". ``source_dir`` is the tree that holds ``src/speculators``.
    ``short_id`` names report folders: commit[:12], sha256[:12] or a hash of path + mtime.
    """

    kind: str
    spec: str
    source_dir: Path
    short_id: str
    resolved_at: str
    url: str | None = None
    ref: str | None = None
    ref_kind: str | None = None  # branch | tag | commit (git)
    commit: str | None = None  # git, or the HEAD of a path that is a git checkout
    commit_date: str | None = None
    describe: str | None = None  # `git describe --tags --always`
    sdist_sha256: str | None = None
    sdist_filename: str | None = None
    version: str | None = None
    dirty: bool | None = None  # path: uncommitted changes in a git checkout
    mirror_fetched_at: str | None = None  # git: when the cached mirror last talked to the remote

    @property
    def src_dir(self) -> Path:
        """``<source_dir>/src``, the directory put on PYTHONPATH."""
        return Path(self.source_dir) / "src"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (paths as strings)."""
        d = dataclasses.asdict(self)
        d["source_dir"] = str(self.source_dir)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReferenceIdentity":
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["source_dir"] = Path(kw["source_dir"])
        return cls(**kw)


@dataclass
class ReferenceLock:
    """Contents of ``reference/speculators.lock``."""

    spec: str
    version: str | None = None
    sdist: str | None = None
    sdist_sha256: str | None = None
    git_url: str | None = None
    git_tag: str | None = None


def reference_dir() -> Path:
    """The repository's ``reference/`` folder (adapter + lock).

    Raises:
        ReferenceSourceError: it is absent, i.e. dflash-audit is not installed from its checkout.
    """
    path = Path(dflash_audit.__file__).resolve().parents[1] / "reference"
    if not path.is_dir():
        raise ReferenceSourceError(
            f"the reference/ folder (adapter and lock) was not found at {path}. dflash-audit must "
            "run from its repository checkout: clone it and `pip install -e .` there."
        )
    return path


def adapter_path() -> Path:
    """``reference/adapter.py``, the script that runs inside the reference's process.

    Raises:
        ReferenceSourceError: the reference folder or the adapter is absent.
    """
    path = reference_dir() / "adapter.py"
    if not path.is_file():
        raise ReferenceSourceError(
            f"the reference adapter {path} is missing; reinstall dflash-audit from its "
            "repository checkout (`pip install -e .`)."
        )
    return path


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """``<cache>/reference``: ``cache_dir``, else ``$DFLASH_AUDIT_CACHE``, else
    ``~/.cache/dflash-audit``."""
    base = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-audit"
    return Path(base).expanduser() / "reference"


def load_lock(path: Path | str | None = None) -> ReferenceLock:
    """Read the lock (default ``reference/speculators.lock``).

    Raises:
        ReferenceResolutionError: the lock is absent or has no ``[reference] spec``.
    """
    try:
        path = Path(path) if path is not None else reference_dir() / "speculators.lock"
        data = tomllib.loads(path.read_text())
    except (OSError, ReferenceSourceError, tomllib.TOMLDecodeError) as exc:
        raise ReferenceResolutionError(
            f"cannot read the reference lock ({exc}). Pass the reference explicitly, e.g. "
            "--ref speculators==0.9.0 or --ref path:DIR."
        ) from exc
    section = data.get("reference", {})
    if "spec" not in section:
        raise ReferenceResolutionError(f"the lock {path} has no [reference] spec = ...")
    names = {f.name for f in dataclasses.fields(ReferenceLock)}
    return ReferenceLock(**{k: v for k, v in section.items() if k in names})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- source-tree checks -----------------------------------------------------------------------


def missing_dflash_paths(source_dir: Path) -> list[str]:
    """The entries of :data:`REQUIRED_PATHS` absent under ``source_dir``."""
    return [p for p in REQUIRED_PATHS if not (Path(source_dir) / p).exists()]


def _require_dflash(missing: list[str], what: str, is_speculators: bool = True) -> None:
    """Refuse a source without the DFlash modules: a repository or folder that is not
    speculators at all (no ``src/speculators/``) is named as such, not sent to another ref.

    Raises:
        ReferenceResolutionError: ``missing`` is not empty.
    """
    if missing and not is_speculators:
        raise ReferenceResolutionError(
            f"{what} is not speculators: it has no src/speculators/ package. Point --ref-url "
            "(or path:DIR) at a clone of https://github.com/vllm-project/speculators, or use "
            "--ref speculators==0.9.0 (the release from the package index)."
        )
    if missing:
        raise ReferenceResolutionError(
            f"{what} has no DFlash reference modules: missing {', '.join(missing)}. DFlash "
            "landed in speculators 0.9.0; use a ref at or after it (e.g. --ref "
            "speculators@v0.9.0 or --ref speculators==0.9.0)."
        )


def read_version(source_dir: Path) -> str | None:
    """The package version from ``src/speculators/version.py``, ``PKG-INFO`` or a static
    ``pyproject.toml`` version; None when none says."""
    source_dir = Path(source_dir)
    candidates = [
        (source_dir / "src/speculators/version.py", r"^version\s*=\s*[\"']([^\"']+)[\"']"),
        (source_dir / "PKG-INFO", r"^Version:\s*(\S+)"),
    ]
    for path, pattern in candidates:
        if path.is_file():
            m = re.search(pattern, path.read_text(errors="replace"), re.MULTILINE)
            if m:
                return m.group(1)
    pyproject = source_dir / "pyproject.toml"
    if pyproject.is_file():
        try:
            version = tomllib.loads(pyproject.read_text()).get("project", {}).get("version")
        except tomllib.TOMLDecodeError:
            version = None
        if isinstance(version, str):
            return version
    return None


def discard_damaged_tree(identity: ReferenceIdentity) -> None:
    """Make the next resolve rebuild a cached reference tree found changed during a run,
    never reuse it: a release's manifest is removed (the tree is extracted again from its
    verified archive), a git checkout is removed (checked out again from the mirror). A
    ``path:`` tree is the user's own and is left alone (the error names it)."""
    import shutil

    source = Path(identity.source_dir)
    if identity.kind == "sdist" and source.name == "tree":
        entry = source.parent
        entry.with_name(entry.name + ".manifest.json").unlink(missing_ok=True)
    elif identity.kind == "git" and source.parent.name == "checkouts":
        shutil.rmtree(source, ignore_errors=True)
