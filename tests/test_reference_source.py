"""Reference resolution, caching and the reference process, exercised offline.

A session fixture builds a local git repository from the speculators 0.9.0 release source (got
through our own sdist resolution), with branch ``main`` (two commits) and tag ``v0.9.0`` (the
first), and the harness clones it by file:// URL and by plain path. The sdist is cached in the
normal cache; everything else uses a per-test cache.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import git
import pytest
from cache_support import copy_of_cache

from dflash_audit import reference_source as rs
from dflash_audit.limits import limit_s
from dflash_audit.reference_source import (
    REQUIRED_PATHS,
    ReferenceApiMismatchError,
    ReferenceIdentity,
    ReferenceLock,
    ReferenceMissingDependencyError,
    ReferenceResolutionError,
    ReferenceRunError,
    ReferenceSourceError,
    ReferenceTimeoutError,
    ReferenceWrongSourceError,
    check_reference_importable,
    load_lock,
    resolve_reference,
    run_reference,
)

LOCKED_SHA256 = "ad5e21eedc89f95096d92ceeccb794df88e24394615f5e8f02957485aea3d8cf"
AFTER_RELEASE_FILE = "AFTER_0.9.0.txt"
GENERATED_BY_BUILD = (
    "PKG-INFO", "setup.cfg", "src/speculators.egg-info", "src/speculators/version.py",
    "src/speculators/version.txt",
)


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def release() -> ReferenceIdentity:
    """speculators 0.9.0 from the package index, cached in the normal cache across runs."""
    return resolve_reference("speculators==0.9.0")


def _commit_all(repo: git.Repo, message: str) -> str:
    repo.git.add(A=True)
    repo.index.commit(message)
    return repo.head.commit.hexsha


def _make_repo(path: Path, initial_branch: str = "main") -> git.Repo:
    repo = git.Repo.init(path, initial_branch=initial_branch)
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "dflash-audit tests")
        cfg.set_value("user", "email", "tests@example.invalid")
    return repo


@pytest.fixture(scope="session")
def origin(release, tmp_path_factory) -> dict:
    """A git repo of the 0.9.0 source: tag v0.9.0 on commit 1, main one commit ahead."""
    path = tmp_path_factory.mktemp("origin") / "speculators"
    shutil.copytree(release.source_dir, path)
    for generated in GENERATED_BY_BUILD:  # not in the real repository: made by setup.py
        target = path / generated
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    repo = _make_repo(path)
    v090 = _commit_all(repo, "speculators 0.9.0 release source")
    repo.create_tag("v0.9.0", message="release 0.9.0")
    (path / AFTER_RELEASE_FILE).write_text("a change after the release\n")
    main = _commit_all(repo, "a commit after 0.9.0")
    repo.create_head("feature-x", v090)
    assert main != v090
    return {"path": path, "url": path.as_uri(), "v090": v090, "main": main}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache per test (through $DFLASH_AUDIT_CACHE), with the suite's warm reference
    bytecode."""
    path = copy_of_cache(tmp_path / "cache", releases=False)
    monkeypatch.setenv(rs.CACHE_ENV, str(path))
    monkeypatch.delenv(rs.REF_URL_ENV, raising=False)
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- spec / lock ------------------------------------------------------------------------------


def test_lock_names_the_released_sdist():
    lock = load_lock()
    assert lock.spec == "speculators==0.9.0"
    assert lock.version == "0.9.0"
    assert lock.sdist_sha256 == LOCKED_SHA256
    assert lock.git_tag == "v0.9.0"


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("speculators@main", ("git", "main")),
        ("speculators@v0.9.0", ("git", "v0.9.0")),
        ("speculators==0.9.0", ("sdist", "0.9.0")),
        ("path:/some/dir", ("path", "/some/dir")),
    ],
)
def test_parse_spec(spec, expected):
    assert rs.parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["main", "speculators", "speculators@", "speculators@-x", "path:"])
def test_bad_spec_lists_the_forms(spec):
    with pytest.raises(ReferenceResolutionError, match=r"speculators@<branch\|tag\|sha>|invalid"):
        rs.parse_spec(spec)


def test_ref_url_with_non_git_spec_is_rejected(cache, origin):
    with pytest.raises(ReferenceResolutionError, match=r"--ref speculators@v0\.9\.0"):
        resolve_reference(None, url=origin["url"])
    with pytest.raises(ReferenceResolutionError, match="only applies"):
        resolve_reference("speculators==0.9.0", url=origin["url"])


# --- sdist ------------------------------------------------------------------------------------


def test_default_resolves_the_locked_sdist(release, monkeypatch):
    ident = resolve_reference(None, offline=True)  # the lock's spec, from the cache
    assert ident.kind == "sdist"
    assert ident.spec == "speculators==0.9.0"
    assert ident.sdist_sha256 == LOCKED_SHA256
    assert ident.sdist_filename == "speculators-0.9.0.tar.gz"
    assert ident.short_id == LOCKED_SHA256[:12]
    assert ident.version == "0.9.0"
    assert ident.source_dir == release.source_dir
    assert (ident.source_dir / "src/speculators/models/dflash/core.py").is_file()
    assert ident.source_dir.parent.name == LOCKED_SHA256


def test_sdist_second_resolve_does_not_download(release, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("pip download was called for a cached sdist")

    monkeypatch.setattr(rs.sdist, "_pip_download", no_network)
    ident = resolve_reference("speculators==0.9.0")
    assert ident.source_dir == release.source_dir
    assert ident.sdist_sha256 == LOCKED_SHA256


def test_sdist_sha256_mismatch_is_rejected(cache):
    wrong = "0" * 64
    lock = ReferenceLock(spec="speculators==0.9.0", version="0.9.0", sdist_sha256=wrong)
    with pytest.raises(ReferenceResolutionError, match="sha256 mismatch") as exc:
        resolve_reference("speculators==0.9.0", lock=lock)
    assert wrong in str(exc.value) and LOCKED_SHA256 in str(exc.value)
    assert not (cache / "reference" / "sdist" / LOCKED_SHA256).exists()
    assert not (cache / "reference" / "sdist" / wrong).exists()


def test_a_version_not_on_the_index_names_the_releases_there(cache):
    with pytest.raises(ReferenceResolutionError, match=r"speculators 0\.0\.0\.dev7 is not on the "
                       r"package index \(releases there: .*0\.9\.0\)") as exc:
        resolve_reference("speculators==0.0.0.dev7", lock=ReferenceLock(spec="x"))
    assert "WARNING" not in str(exc.value) and "Looking in" not in str(exc.value)


def test_sdist_download_failure_is_reported(cache, monkeypatch):
    import subprocess

    def unreachable(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: connection refused\n")

    monkeypatch.setattr(rs.sdist.subprocess, "run", unreachable)
    with pytest.raises(ReferenceResolutionError, match=r"downloading the speculators 0\.9\.1 "
                       r"source distribution failed (?s:.*)connection refused"):
        resolve_reference("speculators==0.9.1", lock=ReferenceLock(spec="x"))


@pytest.mark.parametrize("stderr, want", [
    ("WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) "
     "after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection."
     "HTTPConnection object at 0x7f>: Failed to establish a new connection: [Errno 111] "
     "Connection refused')': /simple/speculators/\n",
     r"the package index could not be reached \(\[Errno 111\] Connection refused\)"),
    ("", r"the package index lists no release of speculators"),
])
def test_an_unreachable_or_empty_index_is_not_a_missing_version(cache, monkeypatch, stderr,
                                                                want):
    import subprocess

    tail = ("ERROR: Could not find a version that satisfies the requirement "
            "speculators==0.8.1 (from versions: none)\n"
            "ERROR: No matching distribution found for speculators==0.8.1\n")

    def pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", stderr + tail)

    monkeypatch.setattr(rs.sdist.subprocess, "run", pip)
    with pytest.raises(ReferenceResolutionError, match=want) as exc:
        resolve_reference("speculators==0.8.1", lock=ReferenceLock(spec="x"))
    message = str(exc.value)
    assert "releases there" not in message and "Use one of those" not in message
    assert "WARNING" not in message and "\n" not in message


# --- git --------------------------------------------------------------------------------------


def test_resolve_branch_by_file_url(cache, origin):
    ident = resolve_reference("speculators@main", url=origin["url"])
    assert ident.kind == "git"
    assert ident.commit == origin["main"]
    assert ident.ref == "main" and ident.ref_kind == "branch"
    assert ident.url == origin["url"]
    assert ident.short_id == origin["main"][:12]
    assert ident.describe == f"v0.9.0-1-g{origin['main'][:7]}"
    # no version.py in git: the reference's own nightly rule, one commit after v0.9.0
    assert ident.version == "0.10.0a1"
    assert not (ident.source_dir / "src/speculators/version.py").exists()
    assert ident.source_dir == cache / "reference" / "git" / "checkouts" / origin["main"]
    assert (ident.source_dir / AFTER_RELEASE_FILE).is_file()
    assert git.Repo(ident.source_dir).head.commit.hexsha == origin["main"]
    for p in REQUIRED_PATHS:
        assert (ident.source_dir / p).exists()


def test_resolve_tag(cache, origin):
    ident = resolve_reference("speculators@v0.9.0", url=origin["url"])
    assert ident.commit == origin["v090"]
    assert ident.ref_kind == "tag"
    assert ident.describe == "v0.9.0"
    assert ident.version == "0.9.0"  # from the tag
    assert not (ident.source_dir / AFTER_RELEASE_FILE).exists()


def test_git_version_follows_the_references_setup_rule(origin, tmp_path):
    repo = git.Repo(origin["path"])
    assert rs.git_version(repo, origin["v090"], origin["path"]) == "0.9.0"
    assert rs.git_version(repo, origin["main"], origin["path"]) == "0.10.0a1"
    untagged = _make_repo(tmp_path / "untagged")
    (tmp_path / "untagged" / "setup.py").write_text('LAST_RELEASE_VERSION = Version("0.8.0")\n')
    sha = _commit_all(untagged, "no tags")
    assert rs.git_version(untagged, sha, tmp_path / "untagged") == "0.9.0a0"
    (tmp_path / "untagged" / "setup.py").unlink()
    assert rs.git_version(untagged, sha, tmp_path / "untagged") is None


@pytest.mark.parametrize("length", [40, 12, 7])
def test_resolve_full_and_short_sha(cache, origin, length):
    ident = resolve_reference(f"speculators@{origin['v090'][:length]}", url=origin["url"])
    assert ident.commit == origin["v090"]
    assert ident.ref_kind == "commit"
    assert git.Repo(ident.source_dir).head.commit.hexsha == origin["v090"]


def test_resolve_by_plain_path_and_env_url(cache, origin, monkeypatch):
    by_path = resolve_reference("speculators@feature-x", url=str(origin["path"]))
    assert by_path.commit == origin["v090"]
    assert by_path.url == str(origin["path"])
    monkeypatch.setenv(rs.REF_URL_ENV, origin["url"])
    by_env = resolve_reference("speculators@main")
    assert by_env.url == origin["url"]
    assert by_env.commit == origin["main"]


def test_identity_is_json_and_dated(cache, origin):
    before = datetime.now(timezone.utc).replace(microsecond=0)
    ident = resolve_reference("speculators@v0.9.0", url=origin["url"])
    d = json.loads(json.dumps(ident.to_dict()))
    assert d["kind"] == "git" and d["commit"] == origin["v090"] and d["url"] == origin["url"]
    assert d["source_dir"] == str(ident.source_dir)
    resolved = datetime.fromisoformat(d["resolved_at"])
    assert resolved.utcoffset() == timedelta(0)
    assert before <= resolved <= before + timedelta(minutes=2)
    commit_date = datetime.fromisoformat(d["commit_date"])
    assert abs(commit_date - resolved) < timedelta(hours=1)  # committed by the session fixture
    assert ReferenceIdentity.from_dict(d) == ident


def test_cache_is_reused_without_the_origin(cache, origin, tmp_path):
    work = tmp_path / "origin-copy"
    shutil.copytree(origin["path"], work)
    url = work.as_uri()
    first = resolve_reference("speculators@v0.9.0", url=url)
    main = resolve_reference("speculators@main", url=url)
    work.rename(tmp_path / "gone")  # the remote disappears

    again = resolve_reference("speculators@v0.9.0", url=url)
    by_sha = resolve_reference(f"speculators@{origin['main']}", url=url)
    by_short = resolve_reference(f"speculators@{origin['v090'][:10]}", url=url)
    assert again.source_dir == first.source_dir and again.commit == origin["v090"]
    assert by_sha.source_dir == main.source_dir
    assert by_short.commit == origin["v090"]
    mirrors = list((cache / "reference" / "git" / "mirrors").iterdir())
    assert len(mirrors) == 1

    # a branch moves, so it is re-fetched; offline it resolves to the cached head
    with pytest.raises(ReferenceResolutionError, match="unreachable") as exc:
        resolve_reference("speculators@main", url=url)
    assert f"speculators@{origin['main']}" in str(exc.value)
    offline = resolve_reference("speculators@main", url=url, offline=True)
    assert offline.commit == origin["main"]


def test_new_commits_and_tags_are_fetched(cache, origin, tmp_path):
    work = tmp_path / "origin-copy"
    shutil.copytree(origin["path"], work)
    url = work.as_uri()
    assert resolve_reference("speculators@main", url=url).commit == origin["main"]
    repo = git.Repo(work)
    (work / "NEXT.txt").write_text("next\n")
    newer = _commit_all(repo, "newer")
    repo.create_tag("v0.9.1")
    assert resolve_reference("speculators@main", url=url).commit == newer
    tagged = resolve_reference("speculators@v0.9.1", url=url)
    assert tagged.commit == newer and tagged.ref_kind == "tag"


def test_unknown_ref_lists_known_refs_and_alternatives(cache, origin):
    with pytest.raises(ReferenceResolutionError) as exc:
        resolve_reference("speculators@no-such-branch", url=origin["url"])
    msg = str(exc.value)
    assert "unknown ref 'no-such-branch'" in msg
    for name in ("main", "v0.9.0", "feature-x", "--ref speculators==0.9.0", "--ref path:DIR"):
        assert name in msg


@pytest.mark.parametrize("kind", ["missing-file-url", "closed-port-http"])
def test_unreachable_remote(cache, tmp_path, kind):
    if kind == "missing-file-url":
        url = (tmp_path / "does-not-exist").as_uri()
    else:
        url = f"http://127.0.0.1:{_closed_port()}/vllm-project/speculators.git"
    with pytest.raises(ReferenceResolutionError) as exc:
        resolve_reference("speculators@main", url=url)
    msg = str(exc.value)
    assert url in msg and "unreachable" in msg
    for alt in ("--ref speculators==0.9.0", "--ref path:DIR", "--ref-url file:///", rs.REF_URL_ENV):
        assert alt in msg
    assert not list((cache / "reference" / "git" / "mirrors").glob("*.git"))


def test_repo_without_dflash_modules_is_rejected(cache, tmp_path):
    path = tmp_path / "old-speculators"
    (path / "src/speculators/models/eagle3").mkdir(parents=True)
    (path / "src/speculators/__init__.py").write_text("")
    (path / "src/speculators/models/eagle3/core.py").write_text("")
    _commit_all(_make_repo(path), "eagle3 only")
    with pytest.raises(ReferenceResolutionError, match="no DFlash reference modules") as exc:
        resolve_reference("speculators@main", url=path.as_uri())
    assert "src/speculators/models/dflash/core.py" in str(exc.value)
    assert "src/speculators/losses" in str(exc.value)
    assert not (cache / "reference" / "git" / "checkouts").exists()


# --- path -------------------------------------------------------------------------------------


def test_path_spec_uses_the_tree_in_place(release, origin):
    ident = resolve_reference(f"path:{release.source_dir}")
    assert ident.kind == "path"
    assert ident.source_dir == release.source_dir.resolve()
    assert ident.version == "0.9.0"
    assert ident.commit is None
    assert len(ident.short_id) == 12
    assert resolve_reference(f"path:{release.source_dir}").short_id == ident.short_id

    checkout = resolve_reference(f"path:{origin['path']}")
    assert checkout.commit == origin["main"] and checkout.dirty is False
    assert checkout.short_id != ident.short_id


def test_path_spec_errors(tmp_path):
    with pytest.raises(ReferenceResolutionError, match="is not a directory"):
        resolve_reference(f"path:{tmp_path / 'nope'}")
    (tmp_path / "src/speculators").mkdir(parents=True)
    with pytest.raises(ReferenceResolutionError, match="no DFlash reference modules"):
        resolve_reference(f"path:{tmp_path}")
    with pytest.raises(ReferenceResolutionError, match="has no src/speculators"):
        resolve_reference(f"path:{tmp_path / 'src'}")


# --- importability ----------------------------------------------------------------------------


def _fake_source(root: Path, init: str) -> ReferenceIdentity:
    for p in REQUIRED_PATHS:
        target = root / p
        if p.endswith(".py"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("")
        else:
            target.mkdir(parents=True, exist_ok=True)
    for d in ("src/speculators", "src/speculators/models", "src/speculators/models/dflash"):
        (root / d / "__init__.py").write_text("")
    (root / "src/speculators/__init__.py").write_text(init)
    return resolve_reference(f"path:{root}")


@pytest.mark.reference
def test_real_release_is_importable(release):
    check_reference_importable(release)


@pytest.mark.reference
def test_real_git_checkout_is_importable(cache, origin):
    """A clone has no installed metadata, which speculators reads at import time."""
    ident = resolve_reference("speculators@main", url=origin["url"])
    assert not list((ident.source_dir / "src").glob("*.egg-info"))
    check_reference_importable(ident)


def test_import_error_of_a_speculators_name_is_api_mismatch(tmp_path):
    ident = _fake_source(tmp_path, "from speculators.models import no_such_name\n")
    with pytest.raises(ReferenceApiMismatchError, match="no_such_name"):
        check_reference_importable(ident)


def test_missing_module_is_listed_with_install_command(tmp_path):
    ident = _fake_source(tmp_path, "import dflash_audit_no_such_dep\n")
    with pytest.raises(ReferenceMissingDependencyError) as exc:
        check_reference_importable(ident)
    assert exc.value.missing == ["dflash_audit_no_such_dep"]
    assert exc.value.install_command.endswith("-m pip install dflash-audit-no-such-dep")
    assert "dflash_audit_no_such_dep" in str(exc.value)
    assert exc.value.install_command in str(exc.value)


def test_import_from_elsewhere_is_wrong_source(tmp_path):
    ident = _fake_source(tmp_path, "__file__ = '/elsewhere/speculators/__init__.py'\n")
    with pytest.raises(ReferenceWrongSourceError, match="/elsewhere/speculators"):
        check_reference_importable(ident)


def test_import_check_record_follows_the_trees_content(tmp_path):
    """A passed import check's record (import-checks/) names the tree's files, not its
    short_id: a path ref whose module was renamed away, or edited with its mtime kept (short_id,
    path + newest mtime, unchanged), is checked again -- a stale record would otherwise be the
    only evidence the reference imports in an audit that never runs it (a candidate failing
    every case); its own bytecode does not count."""
    import os

    from dflash_audit.audit.sides.import_check import import_ok_marker

    root = tmp_path / "ref"
    ident = _fake_source(root, "")
    module = root / "src/speculators/helper.py"
    module.write_text("X = 1\n")
    os.utime(module, ns=(1, 1))  # older than every other file: not the tree's newest mtime
    marker = import_ok_marker(ident, tmp_path / "cache")
    (root / "src/speculators/__pycache__").mkdir()
    (root / "src/speculators/__pycache__/helper.cpython-311.pyc").write_bytes(b"x")
    assert import_ok_marker(resolve_reference(f"path:{root}"), tmp_path / "cache") == marker
    module.rename(module.with_name("helper_old.py"))
    moved = resolve_reference(f"path:{root}")
    assert moved.short_id == ident.short_id
    assert import_ok_marker(moved, tmp_path / "cache") != marker
    module.with_name("helper_old.py").rename(module)
    module.write_text("X = 2\n")
    os.utime(module, ns=(1, 1))
    edited = resolve_reference(f"path:{root}")
    assert edited.short_id == ident.short_id
    assert import_ok_marker(edited, tmp_path / "cache") != marker


def test_reference_zygote_over_a_reference_that_does_not_import(tmp_path):
    """The suite's reference zygote (tests/reference_zygote.py) over a reference whose import
    fails: a run through it raises naming the zygote's death (the adapter's message is on its
    stderr), and the adapter's error.json is not left in the checkout it starts in."""
    from reference_zygote import ROOT, ReferenceZygote

    zygote = ReferenceZygote(_fake_source(tmp_path / "ref", ""))  # no speculators.losses
    try:
        with pytest.raises(RuntimeError, match="the zygote died"):
            zygote.run(ROOT / "reference" / "adapter.py", [tmp_path], tmp_path, timeout=300)
    finally:
        zygote.close()
    assert not (ROOT / "error.json").exists()


def test_install_command_maps_known_modules():
    cmd = rs.install_command(["hs_connectors", "pydantic_settings", "loguru", "datasets.utils"])
    pkgs = "hs-connectors pydantic-settings loguru 'datasets<=5.1'"
    assert cmd == f"{sys.executable} -m pip install {pkgs}"


# --- running the reference --------------------------------------------------------------------

FAKE_ADAPTER = """
import json, os, sys
from pathlib import Path
kind = sys.argv[1]
if kind == "ok":
    print(json.dumps({"pythonpath0": os.environ["PYTHONPATH"].split(os.pathsep)[0],
                      "source": os.environ["DFLASH_AUDIT_REFERENCE_SOURCE"],
                      "cwd": os.getcwd(), "args": sys.argv[2:]}))
    sys.exit(0)
if kind == "sleep":
    import time; time.sleep(30)
if kind == "crash":
    print("boom: something broke", file=sys.stderr); sys.exit(3)
if kind == "garbage":
    Path("error.json").write_text("{not json"); sys.exit(1)
if kind == "uncaught-import":
    import dflash_audit_absent_module
err = {"kind": kind, "message": sys.argv[2]}
if kind == "missing_dependency":
    err["missing"] = sys.argv[3].split(",")
Path("error.json").write_text(json.dumps(err))
print("adapter stderr line", file=sys.stderr)
sys.exit(1)
"""


@pytest.fixture
def fake_adapter(tmp_path) -> Path:
    path = tmp_path / "fake_adapter.py"
    path.write_text(FAKE_ADAPTER)
    return path


@pytest.fixture
def ident(tmp_path) -> ReferenceIdentity:
    return _fake_source(tmp_path / "ref", "")


def _run(ident, adapter, args, tmp_path, timeout_s=None):
    return run_reference(ident, args, tmp_path / "work", timeout_s or limit_s(30.0),
                         adapter=adapter)


def test_run_reference_ok_sets_env_and_cwd(ident, fake_adapter, tmp_path):
    run = _run(ident, fake_adapter, ["ok", "--batch", "b.safetensors"], tmp_path)
    out = json.loads(run.stdout)
    src = str(ident.source_dir / "src")
    assert out == {"pythonpath0": src, "source": src, "cwd": str(tmp_path / "work"),
                   "args": ["--batch", "b.safetensors"]}
    assert run.returncode == 0 and run.command[0] == sys.executable


def test_run_reference_missing_dependency(ident, fake_adapter, tmp_path):
    with pytest.raises(ReferenceMissingDependencyError) as exc:
        args = ["missing_dependency", "no module", "hs_connectors,loguru"]
        _run(ident, fake_adapter, args, tmp_path)
    assert exc.value.missing == ["hs_connectors", "loguru"]
    assert "-m pip install hs-connectors loguru" in str(exc.value)


def test_run_reference_api_mismatch(ident, fake_adapter, tmp_path):
    msg = "speculators.models.dflash.core has no attribute 'select_anchors'"
    with pytest.raises(ReferenceApiMismatchError) as exc:
        _run(ident, fake_adapter, ["api_mismatch", msg], tmp_path)
    assert msg in str(exc.value) and "not supported by the adapter" in str(exc.value)


def test_run_reference_wrong_source(ident, fake_adapter, tmp_path):
    with pytest.raises(ReferenceWrongSourceError, match="/site-packages/speculators"):
        _run(ident, fake_adapter, ["wrong_source", "imported /site-packages/speculators"], tmp_path)


def test_run_reference_other_errors_carry_stderr(ident, fake_adapter, tmp_path):
    with pytest.raises(ReferenceRunError) as exc:
        _run(ident, fake_adapter, ["error", "shape mismatch in fc"], tmp_path)
    assert "shape mismatch in fc" in str(exc.value) and "adapter stderr line" in str(exc.value)
    assert exc.value.returncode == 1
    with pytest.raises(ReferenceRunError, match="boom: something broke"):
        _run(ident, fake_adapter, ["crash"], tmp_path)
    with pytest.raises(ReferenceRunError, match="unreadable"):
        _run(ident, fake_adapter, ["garbage"], tmp_path)
    with pytest.raises(ReferenceMissingDependencyError) as exc:
        _run(ident, fake_adapter, ["uncaught-import"], tmp_path)
    assert exc.value.missing == ["dflash_audit_absent_module"]


def test_error_json_in_an_argument_directory(ident, fake_adapter, tmp_path):
    """reference/adapter.py writes error.json into its CASES_DIR argument."""
    cases = tmp_path / "cases"
    cases.mkdir()
    adapter = tmp_path / "cases_adapter.py"
    adapter.write_text(
        "import json, sys, pathlib\n"
        "pathlib.Path(sys.argv[1], 'error.json').write_text(json.dumps("
        "{'kind': 'api_mismatch', 'message': \"core has no 'select_anchors'\", 'missing': []}))\n"
        "sys.exit(3)\n"
    )
    with pytest.raises(ReferenceApiMismatchError, match="core has no 'select_anchors'") as exc:
        run_reference(ident, [str(cases)], tmp_path / "work", limit_s(30.0), adapter=adapter)
    assert exc.value.returncode == 3


def test_stale_error_json_is_removed(ident, fake_adapter, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "error.json").write_text(json.dumps({"kind": "api_mismatch"}))
    assert _run(ident, fake_adapter, ["ok"], tmp_path).returncode == 0
    assert not (tmp_path / "work" / "error.json").exists()


def test_run_reference_timeout(ident, fake_adapter, tmp_path):
    with pytest.raises(ReferenceTimeoutError, match="did not finish in 1 s"):
        _run(ident, fake_adapter, ["sleep"], tmp_path, timeout_s=1.0)


def test_missing_adapter_is_a_clear_error(ident, tmp_path):
    with pytest.raises(ReferenceSourceError, match="does not exist"):
        _run(ident, tmp_path / "nope.py", [], tmp_path)


def test_errors_share_one_base():
    for cls in (ReferenceResolutionError, ReferenceRunError, ReferenceMissingDependencyError,
                ReferenceApiMismatchError, ReferenceWrongSourceError, ReferenceTimeoutError):
        assert issubclass(cls, ReferenceSourceError)
    assert issubclass(ReferenceSourceError, ReferenceError)
