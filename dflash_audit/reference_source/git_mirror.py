"""``speculators@<ref>``: a cached bare mirror of the reference's git remote and one detached
checkout per resolved commit."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from datetime import timezone
from pathlib import Path

import git

from dflash_audit.reference_source.identity import (
    REQUIRED_PATHS,
    ReferenceIdentity,
    ReferenceResolutionError,
    _now,
    _require_dflash,
    read_version,
)

DEFAULT_GIT_URL = "https://github.com/vllm-project/speculators"
REF_URL_ENV = "DFLASH_AUDIT_REF_URL"
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GCM_INTERACTIVE": "never", "GIT_ASKPASS": "true"}


def _git_url(url: str | None) -> str:
    url = url or os.environ.get(REF_URL_ENV) or DEFAULT_GIT_URL
    if "://" not in url and not re.match(r"^[\w.-]+@[\w.-]+:", url):  # a local path
        url = os.path.abspath(os.path.expanduser(url))
    return url


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
    _require_dflash(_missing_in_tree(commit), f"{url} at {ref} ({sha[:12]})",
                    is_speculators=not _missing_in_tree(commit, ("src/speculators",)))
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
        version=read_version(checkout) or git_version(mirror, sha, checkout),
        mirror_fetched_at=_fetched_at(mirror),
    )


def _missing_in_tree(commit: git.Commit, paths: tuple[str, ...] = REQUIRED_PATHS) -> list[str]:
    missing = []
    for path in paths:
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


def git_version(repo: git.Repo, sha: str, tree: Path) -> str | None:
    """The version the reference's own ``setup.py`` gives commit ``sha`` (a git checkout has no
    ``version.py``: speculators writes it at build time).

    At a release tag ``vX.Y.Z``: ``X.Y.Z``. Elsewhere, its default (nightly) build rule: the last
    ``vX.Y.Z`` tag before ``sha`` (or the tree's ``LAST_RELEASE_VERSION`` in ``setup.py``,
    whichever is newer), next minor, ``a<commits since the tag>``: ``0.10.0a12`` twelve commits
    after v0.9.0. None when neither a tag nor ``setup.py`` says.
    """
    try:
        exact = repo.git.describe("--tags", "--exact-match", "--match", "v[0-9]*", sha)
    except git.GitCommandError:
        exact = None
    if exact and (m := re.fullmatch(r"v(\d+\.\d+\.\d+)", exact)):
        return m.group(1)
    try:
        described = repo.git.describe("--tags", "--long", "--match", "v[0-9]*", sha)
        m = re.fullmatch(r"v(\d+)\.(\d+)\.\d+-(\d+)-g[0-9a-f]+", described)
    except git.GitCommandError:
        m = None
    last = (int(m.group(1)), int(m.group(2))) if m else None
    commits = int(m.group(3)) if m else 0
    setup = tree / "setup.py"
    pinned = re.search(r'LAST_RELEASE_VERSION\s*=\s*Version\(\s*["\'](\d+)\.(\d+)',
                       setup.read_text(errors="replace")) if setup.is_file() else None
    if pinned:
        last = max(last or (0, 0), (int(pinned.group(1)), int(pinned.group(2))))
    return f"{last[0]}.{last[1] + 1}.0a{commits}" if last else None


def _ensure_checkout(root: Path, mirror: git.Repo, sha: str) -> Path:
    """A clean detached checkout of ``sha`` at ``<root>/git/checkouts/<sha>`` (made once)."""
    path = root / "git" / "checkouts" / sha
    if (path / ".git").exists():
        try:
            repo = git.Repo(path)
            status = repo.git.status("--porcelain", "--ignored", "--untracked-files=all")
            extra = [ln for ln in status.splitlines() if "__pycache__/" not in ln]
            if repo.head.commit.hexsha == sha and not extra:  # planted files count too
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
