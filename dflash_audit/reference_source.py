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

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import git

import dflash_audit

DEFAULT_GIT_URL = "https://github.com/vllm-project/speculators"
REF_URL_ENV = "DFLASH_AUDIT_REF_URL"
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

#: Import name -> pip requirement, for modules the reference imports at import time.
PIP_NAMES: dict[str, str] = {
    "hs_connectors": "hs-connectors",
    "pydantic_settings": "pydantic-settings",
    "pydantic": "pydantic",
    "loguru": "loguru",
    "openai": "openai",
    "datasets": "datasets<=5.1",
    "transformers": "transformers",
    "torch": "torch",
    "safetensors": "safetensors",
    "huggingface_hub": "huggingface-hub",
    "yaml": "pyyaml",
    "google": "protobuf",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "aiohttp": "aiohttp",
    "httpx": "httpx",
    "psutil": "psutil",
    "tqdm": "tqdm",
    "click": "click",
    "numpy": "numpy",
    "typer": "typer",
    "rich": "rich",
}

#: Modules speculators 0.9.0 imports at import time (beyond the standard library); when one
#: import fails, all of these that are absent are reported together.
REFERENCE_IMPORT_DEPS: tuple[str, ...] = (
    "torch", "transformers", "safetensors", "pydantic", "pydantic_settings", "loguru",
    "openai", "datasets", "hs_connectors", "huggingface_hub",
)

_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GCM_INTERACTIVE": "never", "GIT_ASKPASS": "true"}
_HEX_RE = re.compile(r"^[0-9a-fA-F]{4,40}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]*$")


# --- errors -----------------------------------------------------------------------------------


class ReferenceSourceError(ReferenceError):
    """Base of every error of this module (a subclass of the built-in ``ReferenceError``)."""


class ReferenceResolutionError(ReferenceSourceError):
    """The spec could not be turned into a verified source tree (bad spec, unreachable remote,
    unknown ref, no DFlash modules, failed download, sha256 mismatch, missing lock)."""


class ReferenceRunError(ReferenceSourceError):
    """The reference process failed. ``returncode``/``stderr_tail`` carry what it said."""

    def __init__(self, message: str, *, returncode: int | None = None, stderr_tail: str = ""):
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class ReferenceMissingDependencyError(ReferenceRunError):
    """The reference cannot be imported: modules are missing. ``missing`` lists them and
    ``install_command`` is the command that installs them."""

    def __init__(self, message: str, *, missing: list[str], install_command: str, **kw: Any):
        super().__init__(message, **kw)
        self.missing = missing
        self.install_command = install_command


class ReferenceApiMismatchError(ReferenceRunError):
    """The reference at this ref lacks a function/attribute/module the adapter needs."""


class ReferenceWrongSourceError(ReferenceRunError):
    """``speculators`` was imported from somewhere other than the resolved source tree."""


class ReferenceTimeoutError(ReferenceRunError):
    """The reference process ran past its time limit and was killed."""


# --- identity ---------------------------------------------------------------------------------


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


@dataclass
class ReferenceRun:
    """A finished (successful) reference process."""

    command: list[str]
    workdir: Path
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


# --- locations --------------------------------------------------------------------------------


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


def _git_url(url: str | None) -> str:
    url = url or os.environ.get(REF_URL_ENV) or DEFAULT_GIT_URL
    if "://" not in url and not re.match(r"^[\w.-]+@[\w.-]+:", url):  # a local path
        url = os.path.abspath(os.path.expanduser(url))
    return url


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- source-tree checks -----------------------------------------------------------------------


def missing_dflash_paths(source_dir: Path) -> list[str]:
    """The entries of :data:`REQUIRED_PATHS` absent under ``source_dir``."""
    return [p for p in REQUIRED_PATHS if not (Path(source_dir) / p).exists()]


def _require_dflash(missing: list[str], what: str) -> None:
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


# --- git --------------------------------------------------------------------------------------


def _alternatives(url: str) -> str:
    return (
        "Alternatives: --ref speculators==0.9.0 (the release from the package index), "
        "--ref path:DIR (a local checkout), or a reachable mirror via --ref-url file:///PATH "
        f"(or ${REF_URL_ENV}). URL tried: {url}"
    )


def _git_stderr(exc: git.GitCommandError) -> str:
    text = (exc.stderr or "").strip() or str(exc)
    text = text.removeprefix("stderr:").strip().strip("'").strip()
    return "\n".join(text.splitlines()[-6:])


def _unreachable(url: str, exc: git.GitCommandError, extra: str = "") -> ReferenceResolutionError:
    return ReferenceResolutionError(
        f"the reference remote {url} is unreachable (network down or no such repository): "
        f"{_git_stderr(exc)}\n{extra}{_alternatives(url)}"
    )


def _mirror_path(root: Path, url: str) -> Path:
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").rsplit("/", 1)[-1])[:40] or "repo"
    tail = tail.removesuffix(".git")
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return root / "git" / "mirrors" / f"{tail}-{digest}.git"


def _fetch(mirror: git.Repo, url: str, timeout_s: float, *refspecs: str) -> None:
    """Fetch branches and tags (or ``refspecs``) from ``url`` into the mirror."""
    args = ["--prune", "--no-auto-gc", url] if not refspecs else [url, *refspecs]
    if not refspecs:
        args += ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]
    mirror.git.fetch(*args, env=_GIT_ENV, kill_after_timeout=timeout_s)
    (Path(mirror.git_dir) / "dflash-audit-fetched-at").write_text(_now())


def _fetched_at(mirror: git.Repo) -> str | None:
    path = Path(mirror.git_dir) / "dflash-audit-fetched-at"
    return path.read_text().strip() if path.is_file() else None


def _open_or_create_mirror(path: Path, url: str, timeout_s: float) -> tuple[git.Repo, bool]:
    """Open the cached bare mirror of ``url`` or create it (one fetch). Returns (repo, fetched)."""
    if (path / "HEAD").is_file():
        return git.Repo(path), False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        repo = git.Repo.init(tmp, bare=True)
        with repo.config_writer() as cfg:  # give up on a stalled transfer instead of hanging
            cfg.set_value("http", "lowSpeedLimit", "1000")
            cfg.set_value("http", "lowSpeedTime", "60")
        try:
            _fetch(repo, url, timeout_s)
        except git.GitCommandError as exc:
            raise _unreachable(url, exc) from exc
        if not repo.refs:
            raise ReferenceResolutionError(
                f"the reference remote {url} has no branches or tags. {_alternatives(url)}"
            )
        _set_mirror_head(repo)
        repo.close()
        try:
            tmp.rename(path)
        except OSError:  # another process created it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return git.Repo(path), True


def _set_mirror_head(repo: git.Repo) -> None:
    names = [h.name for h in repo.heads]
    if names and "main" not in names and "master" not in names:
        repo.git.symbolic_ref("HEAD", f"refs/heads/{names[0]}")
    elif "master" in names and "main" not in names:
        repo.git.symbolic_ref("HEAD", "refs/heads/master")


def _classify(mirror: git.Repo, ref: str) -> str | None:
    """"branch" | "tag" | "commit" for a ref that exists in the mirror, else None."""
    for kind, prefix in (("branch", "refs/heads/"), ("tag", "refs/tags/")):
        try:
            mirror.git.show_ref("--verify", "--quiet", prefix + ref)
            return kind
        except git.GitCommandError:
            pass
    return "commit" if _rev_parse(mirror, ref) else None


def _rev_parse(mirror: git.Repo, ref: str) -> str | None:
    """The full commit sha that ``ref`` names in the mirror, or None."""
    try:
        return mirror.git.rev_parse("--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
    except git.GitCommandError:
        return None


def known_refs(mirror: git.Repo, limit: int = 8) -> list[str]:
    """A few branch and tag names of the mirror: main/master first, then newest tags."""
    branches = sorted((h.name for h in mirror.heads), key=lambda n: n not in ("main", "master"))
    tags = sorted(mirror.tags, key=lambda t: t.commit.committed_date, reverse=True)
    return branches[: limit // 2] + [t.name for t in tags][: limit - min(len(branches), limit // 2)]


def _resolve_git(
    spec: str, ref: str, url: str, root: Path, offline: bool, timeout_s: float
) -> ReferenceIdentity:
    mpath = _mirror_path(root, url)
    if offline and not (mpath / "HEAD").is_file():
        raise ReferenceResolutionError(
            f"offline, and {url} has not been cloned into the cache ({mpath}) yet. "
            + _alternatives(url)
        )
    mirror, fetched = _open_or_create_mirror(mpath, url, timeout_s)
    ref_kind = _classify(mirror, ref)
    if ref_kind == "branch" and not fetched and not offline:
        try:
            _fetch(mirror, url, timeout_s)
        except git.GitCommandError as exc:
            cached = _rev_parse(mirror, ref)
            raise _unreachable(
                url, exc,
                f"The cache has branch {ref} at {cached} (fetched {_fetched_at(mirror)}); to use "
                f"that commit offline pass --ref speculators@{cached}.\n",
            ) from exc
        fetched = True
    if ref_kind is None and not fetched and not offline:
        try:
            _fetch(mirror, url, timeout_s)
        except git.GitCommandError as exc:
            raise _unreachable(url, exc, f"({ref!r} is not in the cached mirror.)\n") from exc
        ref_kind = _classify(mirror, ref)
    if ref_kind is None and not offline and re.fullmatch(r"[0-9a-fA-F]{40}", ref):
        try:  # a commit no branch/tag reaches (e.g. a pull request's head)
            _fetch(mirror, url, timeout_s, ref)
            ref_kind = _classify(mirror, ref)
        except git.GitCommandError:
            pass
    if ref_kind is None:
        raise ReferenceResolutionError(
            f"unknown ref {ref!r} in {url}: no branch, tag or commit of that name"
            f"{' in the cache (offline)' if offline else ''}. Known refs include: "
            f"{', '.join(known_refs(mirror)) or '(none)'}. Use --ref speculators@<one of these>, "
            "a full commit sha, or " + _alternatives(url)
        )
    sha = _rev_parse(mirror, ref)
    assert sha is not None
    commit = mirror.commit(sha)
    _require_dflash(_missing_in_tree(commit), f"{url} at {ref} ({sha[:12]})")
    checkout = _ensure_checkout(root, mirror, sha)
    return ReferenceIdentity(
        kind="git",
        spec=spec,
        source_dir=checkout,
        short_id=sha[:12],
        resolved_at=_now(),
        url=url,
        ref=ref,
        ref_kind=ref_kind,
        commit=sha,
        commit_date=commit.committed_datetime.astimezone(timezone.utc).isoformat(),
        describe=_describe(mirror, sha),
        version=read_version(checkout) or _version_from_tag(mirror, sha),
        mirror_fetched_at=_fetched_at(mirror),
    )


def _missing_in_tree(commit: git.Commit) -> list[str]:
    missing = []
    for path in REQUIRED_PATHS:
        try:
            commit.tree / path
        except KeyError:
            missing.append(path)
    return missing


def _describe(mirror: git.Repo, sha: str) -> str | None:
    try:
        return mirror.git.describe("--tags", "--always", sha)
    except git.GitCommandError:
        return None


def _version_from_tag(mirror: git.Repo, sha: str) -> str | None:
    """``X.Y.Z`` when a tag ``vX.Y.Z`` / ``X.Y.Z`` points at ``sha`` (git checkouts carry no
    version.py: speculators generates it at build time)."""
    try:
        tag = mirror.git.describe("--tags", "--exact-match", sha)
    except git.GitCommandError:
        return None
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*\S*)", tag)
    return m.group(1) if m else None


def _ensure_checkout(root: Path, mirror: git.Repo, sha: str) -> Path:
    """A clean detached checkout of ``sha`` at ``<root>/git/checkouts/<sha>`` (made once)."""
    path = root / "git" / "checkouts" / sha
    if (path / ".git").exists():
        try:
            repo = git.Repo(path)
            if repo.head.commit.hexsha == sha and not repo.is_dirty():
                return path
        except (git.GitError, ValueError):
            pass
        shutil.rmtree(path)  # damaged or edited: rebuild
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=sha[:12] + ".tmp-", dir=path.parent))
    try:
        repo = git.Repo.clone_from(mirror.git_dir, tmp, no_checkout=True, env=_GIT_ENV)
        repo.git.checkout("--detach", sha)
        repo.close()
        try:
            tmp.rename(path)
        except OSError:  # made by another process meanwhile
            pass
    except git.GitCommandError as exc:
        raise ReferenceResolutionError(
            f"could not check out {sha} from the cached mirror {mirror.git_dir}: "
            f"{_git_stderr(exc)}. Delete that folder to rebuild the cache."
        ) from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# --- sdist ------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cached_sdist(root: Path, sha256: str) -> Path | None:
    """The extracted tree of a cached sdist whose tarball still has ``sha256``, else None."""
    entry = root / "sdist" / sha256
    tree = entry / "tree"
    archives = [p for p in entry.glob("*") if p.is_file() and p.name != "meta.json"]
    if tree.is_dir() and len(archives) == 1 and _sha256(archives[0]) == sha256:
        return tree
    return None


def _pip_download(version: str, dest: Path) -> Path:
    """Download ``speculators==version``'s sdist into ``dest`` with pip; returns the file.

    Raises:
        ReferenceResolutionError: pip failed or produced no single archive.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--no-input", "--disable-pip-version-check", f"{PACKAGE}=={version}", "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise ReferenceResolutionError(
            f"`{shlex.join(cmd)}` did not finish in 900 s (package index unreachable?). "
            "Use --ref path:DIR or --ref speculators@<ref> instead."
        ) from exc
    archives = [p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".zip"))]
    if proc.returncode != 0 or len(archives) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise ReferenceResolutionError(
            f"downloading the {PACKAGE} {version} source distribution failed "
            f"(`{shlex.join(cmd)}` exit {proc.returncode}):\n{tail}\nCheck that version "
            f"{version} exists on the package index and that the index is reachable, or use "
            "--ref speculators@<tag> (git) or --ref path:DIR."
        )
    return archives[0]


def _extract(archive: Path, dest: Path) -> Path:
    """Extract an sdist into ``dest``; returns its single top-level folder."""
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise ReferenceResolutionError(
            f"the sdist {archive.name} does not unpack into one folder (found {len(tops)})."
        )
    return tops[0]


def _resolve_sdist(
    spec: str, version: str, root: Path, lock: ReferenceLock | None, offline: bool
) -> ReferenceIdentity:
    if lock is None:
        try:
            lock = load_lock()
        except ReferenceResolutionError:
            lock = None
    expected = lock.sdist_sha256 if lock and lock.version == version else None
    index = root / "sdist" / "index" / f"{version}.json"
    known = json.loads(index.read_text())["sha256"] if index.is_file() else None
    sha = expected or known
    # a cached entry counts only if it agrees with the lock; otherwise download and compare
    trusted = expected is None or known in (None, expected)
    tree = _cached_sdist(root, sha) if sha and trusted else None
    if tree is None:
        if offline:
            raise ReferenceResolutionError(
                f"offline, and {spec} is not in the cache ({root / 'sdist'})."
            )
        tree, sha = _download_sdist(version, root, expected)
        index.parent.mkdir(parents=True, exist_ok=True)
        index.write_text(json.dumps({"sha256": sha, "resolved_at": _now()}))
    _require_dflash(missing_dflash_paths(tree), f"the {spec} source distribution")
    archive = next(p for p in tree.parent.glob("*") if p.is_file() and p.name != "meta.json")
    return ReferenceIdentity(
        kind="sdist",
        spec=spec,
        source_dir=tree,
        short_id=sha[:12],
        resolved_at=_now(),
        ref=version,
        sdist_sha256=sha,
        sdist_filename=archive.name,
        version=read_version(tree) or version,
    )


def _download_sdist(version: str, root: Path, expected: str | None) -> tuple[Path, str]:
    """Download, verify and extract; returns (tree, sha256).

    Raises:
        ReferenceResolutionError: download failed or the sha256 differs from ``expected``.
    """
    tmp_base = root / "tmp"
    tmp_base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sdist-", dir=tmp_base))
    try:
        archive = _pip_download(version, tmp / "download")
        sha = _sha256(archive)
        if expected is not None and sha != expected:
            raise ReferenceResolutionError(
                f"sha256 mismatch for {archive.name}: the lock says {expected}, the package "
                f"index served {sha}. Refusing to use it. If the release was re-published on "
                "purpose, update reference/speculators.lock; otherwise check the index you use."
            )
        entry = root / "sdist" / sha
        if _cached_sdist(root, sha) is None:
            shutil.rmtree(entry, ignore_errors=True)
            staging = tmp / "entry"
            staging.mkdir()
            shutil.move(str(archive), staging / archive.name)
            _extract(staging / archive.name, tmp / "x").rename(staging / "tree")
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                staging.rename(entry)
            except OSError:  # made by another process meanwhile
                pass
        return entry / "tree", sha
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- path -------------------------------------------------------------------------------------


def _resolve_path(spec: str, directory: Path) -> ReferenceIdentity:
    directory = directory.expanduser().resolve()
    if not directory.is_dir():
        raise ReferenceResolutionError(f"--ref {spec}: {directory} is not a directory.")
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
    try:
        repo = git.Repo(directory)
        commit, dirty = repo.head.commit.hexsha, repo.is_dirty()
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
        version=read_version(directory),
    )


# --- running the reference --------------------------------------------------------------------


def reference_env(
    identity: ReferenceIdentity, base: dict[str, str] | None = None
) -> dict[str, str]:
    """Environment for a reference subprocess: ``<source>/src`` prepended to PYTHONPATH and
    ``$DFLASH_AUDIT_REFERENCE_SOURCE`` set to it."""
    env = dict(os.environ if base is None else base)
    src = str(identity.src_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env[SOURCE_ENV] = src
    return env


def install_command(modules: Iterable[str]) -> str:
    """The command that installs the pip packages providing ``modules`` (import names)."""
    pkgs = []
    for mod in modules:
        top = mod.split(".")[0]
        pkg = PIP_NAMES.get(top, top.replace("_", "-"))
        if pkg not in pkgs:
            pkgs.append(pkg)
    return f"{shlex.quote(sys.executable)} -m pip install " + " ".join(map(shlex.quote, pkgs))


_MISSING_RE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def _missing_modules(stderr: str) -> list[str]:
    return list(dict.fromkeys(_MISSING_RE.findall(stderr)))


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _missing_dependency_error(
    identity: ReferenceIdentity, missing: list[str], returncode: int | None, stderr: str
) -> ReferenceRunError:
    """Missing modules -> ReferenceMissingDependencyError, or ReferenceApiMismatchError when the
    missing module is part of speculators itself (this ref's layout is not supported)."""
    own = [m for m in missing if m == PACKAGE or m.startswith(PACKAGE + ".")]
    if own:
        return ReferenceApiMismatchError(
            f"the reference at {identity.spec} has no module {own[0]}; this ref's API is not "
            "supported by the adapter. Use a ref the adapter knows (e.g. speculators==0.9.0).",
            returncode=returncode, stderr_tail=_tail(stderr),
        )
    cmd = install_command(missing)
    return ReferenceMissingDependencyError(
        f"the reference ({identity.spec}) cannot be imported: missing module(s) "
        f"{', '.join(missing)}. Install them into the interpreter that runs it:\n  {cmd}",
        missing=missing, install_command=cmd, returncode=returncode, stderr_tail=_tail(stderr),
    )


def _error_from_json(
    identity: ReferenceIdentity, err: dict[str, Any], returncode: int, stderr: str
) -> ReferenceRunError:
    kind = err.get("kind", "error")
    message = str(err.get("message", "")).strip()
    tail = _tail(stderr)
    if kind == "missing_dependency":
        missing = [str(m) for m in err.get("missing") or []] or _missing_modules(stderr)
        return _missing_dependency_error(identity, missing or ["<unknown>"], returncode, stderr)
    if kind == "api_mismatch":
        return ReferenceApiMismatchError(
            f"the reference at {identity.spec} ({identity.short_id}) lacks what the adapter "
            f"needs: {message}. This ref's API is not supported by the adapter; use a ref it "
            "knows (e.g. speculators==0.9.0).",
            returncode=returncode, stderr_tail=tail,
        )
    if kind == "wrong_source":
        return ReferenceWrongSourceError(
            f"the reference process imported speculators from the wrong place: {message}. "
            f"Expected a module under {identity.src_dir}; uninstall other copies of speculators "
            "(`pip uninstall speculators`) or remove them from PYTHONPATH.",
            returncode=returncode, stderr_tail=tail,
        )
    return ReferenceRunError(
        f"the reference process failed (exit {returncode}): {message}"
        f"\n--- stderr (tail) ---\n{tail}",
        returncode=returncode, stderr_tail=tail,
    )


def _error_files(workdir: Path, adapter_args: list[str]) -> list[Path]:
    """Where the adapter may write error.json: the workdir, then argument directories."""
    dirs = [workdir] + [Path(a) for a in map(str, adapter_args) if Path(a).is_dir()]
    return list(dict.fromkeys(d.resolve() / "error.json" for d in dirs))


def run_reference(
    identity: ReferenceIdentity,
    adapter_args: list[str],
    workdir: Path,
    timeout_s: float,
    *,
    adapter: Path | None = None,
) -> ReferenceRun:
    """Run ``python reference/adapter.py <adapter_args>`` against the resolved source.

    The process gets ``PYTHONPATH=<source>/src:...``, ``$DFLASH_AUDIT_REFERENCE_SOURCE`` and
    ``cwd=workdir``. Exit code 0 is success; on failure the adapter writes ``error.json`` =
    {"kind", "message", "missing"} into ``workdir`` or into a directory named by an adapter
    argument (e.g. its CASES_DIR); stale ones are removed before the run.

    Args:
        adapter: the script to run (default :func:`adapter_path`); injectable for tests.

    Raises:
        ReferenceSourceError: the adapter script is absent.
        ReferenceMissingDependencyError: modules are missing (lists them and the install command).
        ReferenceApiMismatchError: the reference lacks a function/attribute the adapter needs.
        ReferenceWrongSourceError: speculators was imported from outside the resolved source.
        ReferenceTimeoutError: it ran past ``timeout_s``.
        ReferenceRunError: any other failure (with the tail of stderr).
    """
    script = Path(adapter) if adapter is not None else adapter_path()
    if not script.is_file():
        raise ReferenceSourceError(f"the reference adapter {script} does not exist.")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    error_files = _error_files(workdir, adapter_args)
    for path in error_files:
        path.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), *map(str, adapter_args)]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=workdir, env=reference_env(identity), capture_output=True, text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr or ""
        if isinstance(stderr, bytes):
            stderr = stderr.decode(errors="replace")
        raise ReferenceTimeoutError(
            f"the reference process ({identity.spec}) did not finish within {timeout_s:g} s and "
            f"was killed. Raise the timeout or use a smaller batch.\n{_tail(stderr)}",
            stderr_tail=_tail(stderr),
        ) from exc
    wall = time.monotonic() - start
    if proc.returncode == 0:
        return ReferenceRun(cmd, workdir, 0, proc.stdout, proc.stderr, wall)
    error_file = next((p for p in error_files if p.is_file()), None)
    if error_file is not None:
        try:
            err = json.loads(error_file.read_text())
            if not isinstance(err, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise ReferenceRunError(
                f"the reference process failed (exit {proc.returncode}) and wrote an unreadable "
                f"{error_file} ({exc}).\n--- stderr (tail) ---\n{_tail(proc.stderr)}",
                returncode=proc.returncode, stderr_tail=_tail(proc.stderr),
            ) from exc
        raise _error_from_json(identity, err, proc.returncode, proc.stderr)
    missing = _missing_modules(proc.stderr)
    if missing:
        raise _missing_dependency_error(identity, missing, proc.returncode, proc.stderr)
    raise ReferenceRunError(
        f"the reference process failed (exit {proc.returncode}) without writing error.json."
        f"\n--- stderr (tail) ---\n{_tail(proc.stderr)}",
        returncode=proc.returncode, stderr_tail=_tail(proc.stderr),
    )


_IMPORT_PROBE = """
import importlib.metadata, importlib.util, json, sys
version, known = sys.argv[1], json.loads(sys.argv[2])
try:  # a git checkout has no installed metadata, but speculators reads its version at import
    importlib.metadata.version("speculators")
except importlib.metadata.PackageNotFoundError:  # (reference/adapter.py does the same)
    import os
    dist = os.path.abspath(f"speculators-{version}.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\\nName: speculators\\nVersion: {version}\\n")
    sys.path.append(os.getcwd())
try:
    import speculators.models.dflash.core
    import speculators
    out = {"ok": True, "file": speculators.__file__}
except ModuleNotFoundError as e:
    extra = [m for m in known if importlib.util.find_spec(m) is None]
    out = {"ok": False, "missing": [e.name] + [m for m in extra if m != e.name], "error": repr(e)}
except ImportError as e:  # a name the module does not define
    out = {"ok": False, "import_error": str(e), "name": e.name}
print("DFLASH_AUDIT_PROBE " + json.dumps(out))
"""


def check_reference_importable(identity: ReferenceIdentity, timeout_s: float = 180.0) -> None:
    """Check, in a small subprocess, that ``speculators.models.dflash.core`` imports from the
    resolved source; cheap compared with a full reference run.

    Raises:
        ReferenceMissingDependencyError: import-time dependencies are missing (the one that
            failed plus every absent one of :data:`REFERENCE_IMPORT_DEPS`, with the install
            command).
        ReferenceApiMismatchError: the source has no ``speculators.models.dflash.core`` or a
            name it imports from speculators is missing.
        ReferenceWrongSourceError: speculators was imported from outside the resolved source.
        ReferenceTimeoutError: the import took longer than ``timeout_s``.
        ReferenceRunError: any other import failure (with the tail of stderr).
    """
    cmd = [sys.executable, "-c", _IMPORT_PROBE, identity.version or "0.0.0+git",
           json.dumps(list(REFERENCE_IMPORT_DEPS))]
    try:
        with tempfile.TemporaryDirectory(prefix="dflash-audit-probe-") as cwd:
            proc = subprocess.run(
                cmd, env=reference_env(identity), capture_output=True, text=True,
                timeout=timeout_s, cwd=cwd,
            )
    except subprocess.TimeoutExpired as exc:
        raise ReferenceTimeoutError(
            f"importing the reference ({identity.spec}) took longer than {timeout_s:g} s."
        ) from exc
    probe = next(
        (json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
         if line.startswith("DFLASH_AUDIT_PROBE ")),
        None,
    )
    if probe is None:  # crashed: an ImportError, a SyntaxError, ...
        missing = _missing_modules(proc.stderr)
        if missing:
            raise _missing_dependency_error(identity, missing, proc.returncode, proc.stderr)
        raise ReferenceRunError(
            f"importing the reference ({identity.spec}) failed (exit {proc.returncode}):\n"
            f"{_tail(proc.stderr)}",
            returncode=proc.returncode, stderr_tail=_tail(proc.stderr),
        )
    if not probe["ok"] and "import_error" in probe:
        own = (probe.get("name") or "").startswith(PACKAGE)
        raise (ReferenceApiMismatchError if own else ReferenceRunError)(
            f"importing the reference ({identity.spec}) failed: {probe['import_error']}"
            + (". This ref's API is not supported by the adapter." if own else ""),
            returncode=proc.returncode, stderr_tail=_tail(proc.stderr),
        )
    if not probe["ok"]:
        raise _missing_dependency_error(identity, probe["missing"], proc.returncode, proc.stderr)
    src = identity.src_dir.resolve()
    file = Path(probe["file"]).resolve()
    if not file.is_relative_to(src):
        raise ReferenceWrongSourceError(
            f"speculators was imported from {file}, not from the resolved source {src}. Uninstall "
            "other copies (`pip uninstall speculators`) or remove them from PYTHONPATH.",
            returncode=proc.returncode,
        )
