"""``speculators==X.Y.Z``: the release's source distribution from the package index (pip),
verified against the lock's sha256 and cached by sha256.

Cache entry ``<root>/sdist/<sha256>/``: the archive and ``tree/`` (its extracted top folder);
beside it ``<root>/sdist/<sha256>.manifest.json`` (sha256 of every file of ``tree/``, written
at extraction; outside the entry, so older dflash-audit versions sharing the cache still see
one archive in it). Each
resolve checks the tree against its manifest; a removed or edited file (or a tree without a
manifest) is repaired by extracting the cached archive again -- offline too -- and, when that
is impossible, named with the exact path to remove; never blamed on the release."""

from __future__ import annotations

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
from pathlib import Path

from dflash_audit.reference_source.identity import (
    PACKAGE,
    ReferenceIdentity,
    ReferenceLock,
    ReferenceResolutionError,
    _now,
    _require_dflash,
    load_lock,
    missing_dflash_paths,
    read_version,
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _archives(entry: Path) -> list[Path]:
    return [p for p in entry.glob("*") if p.is_file() and p.name != "meta.json"]


def manifest_path(entry: Path) -> Path:
    """``<root>/sdist/<sha256>.manifest.json`` of the entry ``<root>/sdist/<sha256>``."""
    return entry.with_name(entry.name + ".manifest.json")


def tree_manifest(tree: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``tree`` outside ``__pycache__``
    folders (the reference runs with a private pycache prefix and never reads them)."""
    return {p.relative_to(tree).as_posix(): _sha256(p) for p in sorted(tree.rglob("*"))
            if p.is_file() and "__pycache__" not in p.relative_to(tree).parts}


def tree_problems(entry: Path) -> list[str]:
    """How ``entry/tree`` differs from its manifest (:func:`manifest_path`): "missing X",
    "changed Y", "no manifest"; empty when it is intact."""
    try:
        expected = json.loads(manifest_path(entry).read_text())
        if not isinstance(expected, dict) or not all(
                isinstance(v, str) for v in expected.values()):
            raise ValueError("not a {path: sha256} object")
        expected = {k: v for k, v in expected.items() if "__pycache__" not in k.split("/")}
    except (OSError, ValueError):
        return ["no manifest"]
    found = tree_manifest(entry / "tree")
    problems = [f"missing {k}" for k in expected if k not in found]
    problems += [f"changed {k}" for k in expected if k in found and found[k] != expected[k]]
    problems += [f"extra {k}" for k in found if k not in expected]  # a planted .pyc, .so, ...
    return problems


def _write_manifest(entry: Path) -> None:
    tmp = manifest_path(entry).with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(tree_manifest(entry / "tree"), indent=0))
    os.replace(tmp, manifest_path(entry))


def _reextract(entry: Path, archive: Path, problems: list[str]) -> None:
    """Replace ``entry/tree`` by a fresh extraction of ``archive`` (and its manifest).

    Raises:
        ReferenceResolutionError: the cache cannot be written (names the folder to remove).
    """
    tree = entry / "tree"
    if problems != ["no manifest"]:
        print(f"dflash-audit: the cached reference tree {tree} is damaged ("
              f"{'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}); extracting "
              "it again from the cached archive", file=sys.stderr)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tree-", dir=entry))
        try:
            fresh = _extract(archive, tmp / "x")
            old = entry / f".tree-damaged-{tmp.name}"
            if tree.exists():
                tree.rename(old)
            fresh.rename(tree)
            shutil.rmtree(old, ignore_errors=True)
            _write_manifest(entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, tarfile.TarError) as exc:
        raise ReferenceResolutionError(
            f"the cached reference tree {tree} is damaged ({'; '.join(problems[:3])}) and "
            f"cannot be extracted again here ({exc}); remove {entry} and run again (it is "
            "downloaded again; offline, copy a good cache there)") from None


def _cached_sdist(root: Path, sha256: str) -> Path | None:
    """The extracted tree of a cached sdist whose archive still has ``sha256`` (repaired
    from that archive when it differs from its manifest), else None."""
    entry = root / "sdist" / sha256
    tree = entry / "tree"
    archives = _archives(entry)
    if tree.is_dir() and len(archives) == 1 and _sha256(archives[0]) == sha256:
        problems = tree_problems(entry)
        if problems:  # also a cache from before manifests: extracted again, then verified
            _reextract(entry, archives[0], problems)
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
    archives = [p for p in (dest.iterdir() if dest.is_dir() else ())
                if p.name.endswith((".tar.gz", ".zip"))]
    output = proc.stdout + proc.stderr
    listed = re.search(r"\(from versions: ([^)]*)\)", output)
    if proc.returncode != 0 and "No matching distribution found" in output:
        known = [v.strip() for v in listed.group(1).split(",")
                 if v.strip() and v.strip() != "none"] if listed else []
        unreachable = _unreachable_index(output)
        if not known and unreachable:
            raise ReferenceResolutionError(
                f"the package index could not be reached ({unreachable}), so "
                f"{PACKAGE} {version} cannot be downloaded. Check the network or "
                "PIP_INDEX_URL / pip's index-url, or use a cached release (--offline), a git "
                "ref (--ref speculators@<ref>) or a local tree (--ref path:DIR)."
            )
        if not known:
            raise ReferenceResolutionError(
                f"the package index lists no release of {PACKAGE}, so {version} cannot be "
                "downloaded (is PIP_INDEX_URL / pip's index-url an index that carries it?). "
                "Use a git ref (--ref speculators@<ref>) or a local tree (--ref path:DIR)."
            )
        raise ReferenceResolutionError(
            f"{PACKAGE} {version} is not on the package index (releases there: "
            f"{', '.join(known[-6:])}). Use one of those (--ref speculators==X), a git ref "
            "(--ref speculators@<ref>) or a local tree (--ref path:DIR)."
        )
    if proc.returncode != 0 or len(archives) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise ReferenceResolutionError(
            f"downloading the {PACKAGE} {version} source distribution failed "
            f"(`{shlex.join(cmd)}` exit {proc.returncode}):\n{tail}\nCheck that version "
            f"{version} exists on the package index and that the index is reachable, or use "
            "--ref speculators@<tag> (git) or --ref path:DIR."
        )
    return archives[0]


_UNREACHABLE_RE = re.compile(
    r"Failed to establish a new connection: ([^')\"]+)|Could not fetch URL (\S+?):? "
    r"|(Name or service not known|Temporary failure in name resolution|timed out)")


def _unreachable_index(pip_output: str) -> str:
    """What pip said when it could not reach an index (``"[Errno 111] Connection
    refused"``, ...), else ""."""
    match = _UNREACHABLE_RE.search(pip_output)
    if not match:
        return ""
    return next(g for g in match.groups() if g).strip()


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
                f"offline, and {spec} is not in the cache ({root / 'sdist'}). Run once "
                "without --offline to download it, or use a ref that is cached."
            )
        tree, sha = _download_sdist(version, root, expected)
        index.parent.mkdir(parents=True, exist_ok=True)
        index.write_text(json.dumps({"sha256": sha, "resolved_at": _now()}))
    _require_dflash(missing_dflash_paths(tree), f"the {spec} source distribution",
                    is_speculators=(tree / "src" / "speculators").is_dir())
    archive = _archives(tree.parent)[0]
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
                _write_manifest(entry)
            except OSError:  # made by another process meanwhile
                pass
        return entry / "tree", sha
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
