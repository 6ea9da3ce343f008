"""Hostile candidates (tests/hostile/): the gamma-7 candidate, which FAILs on its own, plus one
route each to turn its audit into a PASS (DESIGN.md section 9). Each route ends in exit 1 or
2, never 0: in the sandbox every write is refused and the cache and the installed tool stay
byte for byte as they were (one compare with every route at once); without a sandbox
(``DFLASH_AUDIT_SANDBOX=off``) each route is detected (exit 2 naming the file or the process)
and a damaged reference cache is rebuilt by the next resolve, never reused; a record it signs
for the reference cache is removed (its own audit read its records before it ran: exit 1).

Every run works on copies: the cached release tree (``$DFLASH_AUDIT_CACHE``) and the
dflash-audit package (first on PYTHONPATH), so a route that succeeded could not damage the
real ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_audit.limits import limit_s

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "hostile"
sys.path.insert(0, str(HOSTILE))
import tamper  # noqa: E402
from cache_support import copy_of_cache, records_lock  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def daemons_alive() -> list[int]:
    alive = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if tamper.DAEMON_MARK.encode() in cmd and b"pytest" not in cmd:
            alive.append(int(pid))
    return alive


class World:
    """Copies of the cached release and of the tool, and a compare run against them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.tool = tmp, tmp / "tool"
        self.cache = copy_of_cache(tmp / "cache", private_bytecode=True)
        for name in ("dflash_audit", "reference"):  # bytecode too: valid (copy2 keeps mtimes)
            shutil.copytree(ROOT / name, self.tool / name)

    def compare(self, route: str, sandbox: bool, cases: int = 1, python: str = sys.executable,
                extra: tuple[str, ...] = (), **env_extra: str) -> subprocess.CompletedProcess:
        """``compare`` of the candidate ``tests/hostile/ROUTE.py`` under ``python``, with
        ``extra`` arguments; stdout and stderr merged."""
        env = {**os.environ, "PYTHONPATH": str(self.tool), "DFLASH_AUDIT_CACHE": str(self.cache),
               "DFLASH_AUDIT_SANDBOX": "" if sandbox else "off", "CI": "",
               "DFLASH_AUDIT_PROGRESS_INTERVAL": "0", "OMP_NUM_THREADS": "1", **env_extra}
        out = self.tmp / f"reports-{route}"
        with records_lock(exclusive=False) if not sandbox else contextlib.nullcontext():
            return subprocess.run(
                [python, "-m", "dflash_audit.cli", "compare", "--candidate",
                 f"{HOSTILE / route}.py:candidate", "--cases", str(cases), "--rows", "0",
                 "--offline", "--out", str(out), *extra], cwd=self.tmp, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=limit_s(600),
                check=False)

    def reports(self, route: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in
                (self.tmp / f"reports-{route}").glob("*/report.json")]


@pytest.fixture
def world(tmp_path: Path, reference_identity) -> World:
    return World(tmp_path)


def _sandbox_available() -> bool:
    from dflash_audit.audit.sides.sandbox import sandbox_status

    return sandbox_status().available


@pytest.mark.skipif(not _sandbox_available(), reason="no bubblewrap sandbox on this machine")
def test_in_the_sandbox_every_route_is_refused_and_nothing_changes(world: World) -> None:
    """All routes at once, sandboxed: each write fails (read-only file system), the daemon
    dies with the candidate's PID namespace, and as root (CI) unmounting /tmp, /proc or the
    key's cover and remounting read-write fail too (no capability); the verdict is the
    gamma-7 FAIL (exit 1), the report records what the sandbox proved from inside, cache and
    tool are unchanged and the key was not copied out."""
    cache, tool = digest(world.cache / "reference"), digest(world.tool)
    result = world.compare("all_routes", sandbox=True)
    assert result.returncode == 1, result.stdout
    assert "decay gamma 7" in result.stdout and "without a sandbox" not in result.stdout
    assert ("the reference's outputs of none of the 1 cases are in the cache"  # a cache of its
            in " ".join(result.stdout.split())), result.stdout  # own: it says why it runs
    (report,) = world.reports("all_routes")
    box = report["candidate"]["sandbox"]
    assert report["verdict"] == "fail" and box["sandboxed"] is True
    assert box["bwrap"] in ("/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap")
    assert box["version"] and {name for name, e in box["proof"].items() if e["ok"]} == {
        "capabilities", "read_only", "mounts", "nested_namespace", "pid_namespace",
        "report_key", "network"}
    assert "CapEff 0000000000000000" in box["proof"]["capabilities"]["evidence"]
    (folder,) = [p.parent for p in (world.tmp / "reports-all_routes").glob("*/report.json")]
    assert f"Sandbox: bubblewrap {box['version']} ({box['bwrap']}), proven from inside" in (
        folder / "report.md").read_text()
    assert "What the sandbox proved" in (folder / "report.html").read_text()
    assert digest(world.cache / "reference") == cache
    assert digest(world.tool) == tool
    assert not (world.cache / "stolen.key").exists()
    assert not (world.cache / "reference-outputs" / tamper.FORGED).exists()
    assert daemons_alive() == []


@pytest.mark.parametrize("route, named", [
    ("pyc_plant", "ref/src/speculators/losses/__pycache__/utils."),
    ("sitecustomize_pyc", "ref/src/sitecustomize.pyc"),
    ("edits_tool", "dflash_audit/audit/checks/loss.py"),
    ("prefix_pyc", f"bytecode-ref/speculators/losses/utils.{sys.implementation.cache_tag}.pyc"),
    ("daemon", "process(es) running after its own process ended"),
    ("stdlib_prefix_pyc", f"json/__init__.{sys.implementation.cache_tag}.pyc"),
])
def test_without_a_sandbox_each_route_is_detected(world: World, route: str, named: str) -> None:
    """Unsandboxed, each route is detected: exit 2 naming the file (or the daemon, which is
    killed), no report; a damaged release tree is extracted again by the next resolve."""
    result = world.compare(route, sandbox=False)
    flat = " ".join(result.stdout.split())
    assert result.returncode == 2, result.stdout
    assert named in flat and "Traceback" not in flat, result.stdout
    assert "candidate ran without a sandbox" in flat
    assert world.reports(route) == []
    assert daemons_alive() == []
    if route in ("pyc_plant", "sitecustomize_pyc"):  # the damaged tree is never reused
        from dflash_audit.reference_source.sdist import tree_problems

        (entry,) = [p for p in (world.cache / "reference" / "sdist").iterdir()
                    if p.is_dir() and len(p.name) == 64]
        assert tree_problems(entry) == ["no manifest"]
    if route in ("prefix_pyc", "stdlib_prefix_pyc"):  # the planted file is gone, never reused
        tag = sys.implementation.cache_tag
        sources = (sorted(world.cache.glob("reference/sdist/*/tree/src/speculators/losses/"
                                           "utils.py")) if route == "prefix_pyc"
                   else [Path(json.__file__)])
        assert sources
        for source in sources:
            planted = (world.cache / "pycache" / tag / str(source.parent).lstrip(os.sep)
                       / f"{source.stem}.{tag}.pyc")
            assert not planted.exists(), planted
    if route == "daemon":  # killed before the reference started: the code is untouched
        (utils,) = [p for p in world.cache.rglob("losses/utils.py")]
        assert tamper.POISON not in utils.read_text()
    if route == "edits_tool":  # the edit stays: every later audit refuses until reinstalled
        refused_until_restored(world, world.tool / "dflash_audit/audit/checks/loss.py",
                               ROOT / "dflash_audit/audit/checks/loss.py", "reinstall dflash-audit")


def refused_until_restored(world: World, changed: Path, original: Path, hint: str,
                           python: str = sys.executable) -> None:
    """After an audit whose candidate changed ``changed``: the next audit (any candidate) is
    refused before any candidate code runs, naming the file and ``hint``; once ``changed`` is
    restored from ``original`` the record clears itself and audits start again (an unknown
    profile is then what stops this one)."""
    again = world.compare("gamma7_good", sandbox=False, python=python)
    flat = " ".join(again.stdout.split())
    assert again.returncode == 2, again.stdout
    assert "changed by an earlier audit's candidate" in flat and str(changed) in flat, flat
    assert hint in flat and "Traceback" not in flat, flat
    assert (world.cache / "integrity" / "tampered.json").is_file()
    shutil.copy2(original, changed)
    after = world.compare("gamma7_good", sandbox=False, python=python,
                          extra=("--profile", "no-such-profile"))
    assert after.returncode == 2, after.stdout
    assert "unknown profile 'no-such-profile'" in after.stdout, after.stdout
    assert "earlier audit" not in after.stdout, after.stdout
    assert not (world.cache / "integrity" / "tampered.json").exists()


def test_without_a_sandbox_a_forged_reference_record_is_discarded(world: World) -> None:
    """Unsandboxed, the candidate can read the report key and sign a record of the reference
    cache: its own audit read its records before it ran (the gamma-7 FAIL stands, exit 1), and
    every record that changed while it ran is removed, so no later audit takes it."""
    result = world.compare("forges_record", sandbox=False)
    assert result.returncode == 1, result.stdout
    assert "decay gamma 7" in result.stdout
    records = world.cache / "reference-outputs"
    assert not (records / tamper.FORGED).exists()
    (report,) = world.reports("forges_record")
    stored = {c["record"] for c in report["reference"]["cache"]["cases"].values()}
    assert {p.name for p in records.iterdir()} == stored  # the reference's own, verified


@pytest.mark.skipif(not _sandbox_available(), reason="no bubblewrap sandbox on this machine")
def test_planted_symlinks_are_never_followed(world: World) -> None:
    """A candidate that links its log names to a victim file and to the report key, then dies
    to be restarted: the tool writes and reads its logs outside the candidate's folder and
    never through a link, so the victim and the key are unchanged and the key's bytes appear
    in no report (found by the hostile review: the key could be emptied, then any report
    forged)."""
    from dflash_audit.report.fingerprint import KEY_BYTES, KEY_FILE

    victim = world.tmp / "victim.txt"
    victim.write_text("untouched")
    key = world.cache / "keys" / KEY_FILE
    result = world.compare("log_links", sandbox=True, cases=2, VICTIM=str(victim),
                           KEY_FILE=str(key))
    assert result.returncode == 1, result.stdout
    assert victim.read_text() == "untouched"
    assert len(key.read_bytes()) == KEY_BYTES and not key.is_symlink()
    (report,) = world.reports("log_links")
    assert key.read_bytes().hex() not in json.dumps(report)
    assert key.read_bytes().decode(errors="replace")[:8] not in json.dumps(report)


def test_a_damaged_report_key_signs_nothing(tmp_path: Path, monkeypatch) -> None:
    """An emptied, truncated or symlinked key is refused (a named error), never used to sign:
    with an empty key anyone could forge a report."""
    from dflash_audit.report import fingerprint as fp

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path))
    key = fp.report_key(create=True)
    assert len(key) == fp.KEY_BYTES and fp.report_key() == key
    path = tmp_path / "keys" / fp.KEY_FILE
    path.write_bytes(b"")
    with pytest.raises(OSError, match="has 0 bytes, not 32"):
        fp.report_key()
    assert "has 0 bytes" in fp.signature_problem({"signature": {"value": "x", "key_id": "y"}})
    path.unlink()
    other = tmp_path / "elsewhere"
    other.write_bytes(b"k" * fp.KEY_BYTES)
    path.symlink_to(other)
    with pytest.raises(OSError, match="not a regular file"):
        fp.report_key()


def test_require_sandbox_refuses_without_one(world: World) -> None:
    """``--require-sandbox`` (CI's default) with no sandbox: exit 2 before any candidate
    code runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_AUDIT_CACHE": str(world.cache),
           "DFLASH_AUDIT_SANDBOX": "off", "CI": "true"}
    result = subprocess.run([sys.executable, "-m", "dflash_audit.cli", "compare", "--candidate",
                             f"{HOSTILE / 'edits_tool'}.py:candidate", "--cases", "1", "--rows",
                             "0", "--offline", "--out", str(world.tmp / "r")], cwd=world.tmp,
                            env=env, text=True, capture_output=True,
                            timeout=limit_s(300), check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "a sandbox is required" in result.stderr and "Traceback" not in result.stderr
    assert not (world.tmp / "r").exists()
