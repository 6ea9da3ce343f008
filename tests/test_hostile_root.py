"""Hostile inputs against the candidate's sandbox when the audit runs as root (CI containers
do; bubblewrap as root keeps every capability unless told otherwise) and as a user: each
route runs inside the real sandbox and fails with the errno the kernel gives, the sandbox's
proof from inside is recorded, a ``bwrap`` first on PATH is never the sandbox, the
``--candidate-python`` check runs sandboxed, and an external adapter cannot pass for a
built-in framework. The full compare with these routes is ``tests/test_hostile.py``'s
sandboxed one (``tests/hostile/all_routes.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_audit.audit.sides import sandbox as sb
from dflash_audit.audit.sides import sandbox_proof as sp

HOSTILE = Path(__file__).resolve().parent / "hostile"
needs_sandbox = pytest.mark.skipif(not sb.sandbox_status().available,
                                   reason="no bubblewrap sandbox on this machine")


@pytest.fixture
def fresh_status():
    """``sandbox_status`` computed again in this test (and after it, as it really is)."""
    sb.sandbox_status.cache_clear()
    yield
    sb.sandbox_status.cache_clear()


# the candidate: every route a root candidate would try, each attempt's errno name printed
ROUTES = """
import errno, json, os, sys
sys.path.insert(0, sys.argv[2])
import tamper
from pathlib import Path
args = json.loads(sys.argv[1])
def errno_of(fn, *a):
    try:
        fn(*a)
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
out = {"umount": {p: errno_of(tamper.unmount, p) for p in ["/tmp", "/proc", *args["keys"]]},
       "remount": {p: errno_of(tamper.remount_rw, p) for p in ["/", *args["keys"]]},
       "steal": {k: errno_of(tamper.steal_key, Path(k, "report.key"),
                             Path(args["out"], f"stolen-{i}")) for i, k in enumerate(args["keys"])},
       "write_site_packages": errno_of(lambda: open(args["module"], "a").close()),
       "write_cwd": errno_of(Path("planted.txt").write_text, "x"),
       "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
print(json.dumps(out))
"""


@needs_sandbox
def test_a_root_candidate_cannot_escape_the_sandbox(tmp_path, monkeypatch):
    """Unmount /tmp, /proc and the key covers, remount / read-write, copy a report key out
    (one made by an earlier audit with another $DFLASH_AUDIT_CACHE, under /tmp, which stays
    visible when compare starts in /tmp), write into site-packages or the working directory:
    each fails, and no host process is visible."""
    from dflash_audit.report.fingerprint import report_key

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the registries of this test only
    keys = []
    for cache in ("earlier", "now"):  # the earlier audit's key first, then this audit's
        monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / cache))
        report_key(create=True)
        keys.append(str(tmp_path / cache / "keys"))
    monkeypatch.chdir("/tmp")
    module = Path(sysconfig.get_paths()["purelib"]) / "torch" / "__init__.py"
    assert module.is_file()
    folder = Path(__import__("tempfile").mkdtemp(dir=sb.work_root()))
    try:
        args = {"keys": keys, "out": str(folder), "module": str(module)}
        cmd = sb.sandboxed([sys.executable, "-I", "-c", ROUTES, json.dumps(args), str(HOSTILE)],
                           None, folder, folder, env={})
        assert cmd[0] in sp.TRUSTED_BWRAP and "--cap-drop" in cmd
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["umount"] == {p: "EPERM" for p in ["/tmp", "/proc", *keys]}
        assert out["remount"] == {p: "EPERM" for p in ["/", *keys]}
        assert out["steal"] == {k: "ENOENT" for k in keys}  # an empty folder inside
        assert not list(folder.glob("stolen-*"))
        assert out["write_site_packages"] == "EROFS" and out["write_cwd"] == "EROFS"
        assert not Path("/tmp/planted.txt").exists()
        assert len(out["pids"]) <= sp.MAX_PIDS and os.getpid() not in out["pids"]
    finally:
        __import__("shutil").rmtree(folder, ignore_errors=True)


def _read_inside(path: Path) -> subprocess.CompletedProcess:
    """``cat path`` inside the candidate's sandbox, started in /tmp (so /tmp stays visible)."""
    folder = Path(__import__("tempfile").mkdtemp(dir=sb.work_root()))
    try:
        cmd = sb.sandboxed(["cat", str(path)], None, folder, folder, env={})
        return subprocess.run(cmd, capture_output=True, timeout=60)
    finally:
        __import__("shutil").rmtree(folder, ignore_errors=True)


@needs_sandbox
def test_a_key_made_under_another_home_stays_hidden(tmp_path, monkeypatch):
    """An audit run with another $HOME (its registries there) still hides the key an audit
    made with the account's home, or with yet another $HOME: the registries are recorded in,
    and read from, the account's home whatever $HOME says (root: every account's)."""
    import pwd

    from dflash_audit.report.fingerprint import key_dirs, report_key

    monkeypatch.delenv("DFLASH_AUDIT_CACHE")  # the key in $HOME's default cache
    monkeypatch.setenv("HOME", str(tmp_path / "earlier"))
    report_key(create=True)
    key = tmp_path / "earlier" / ".cache" / "dflash-audit" / "keys" / "report.key"
    assert key.is_file()
    monkeypatch.setenv("HOME", str(tmp_path / "now"))
    account = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    assert account / ".cache" / "dflash-audit" / "keys" in key_dirs()
    monkeypatch.chdir("/tmp")
    done = _read_inside(key)
    assert done.returncode != 0 and done.stdout == b"" and b"No such file" in done.stderr


@needs_sandbox
@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_a_key_folder_reached_through_a_bind_mount_stays_hidden(tmp_path, monkeypatch,
                                                               fresh_status):
    """The cache bind-mounted at a second path (a container volume mounted twice): the key is
    hidden at both paths, and the proof checks both."""
    from dflash_audit.report.fingerprint import report_key

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    report_key(create=True)
    alias = tmp_path / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path), str(alias)],
                      capture_output=True).returncode != 0:
        pytest.skip("mount --bind refused here")
    try:
        monkeypatch.chdir("/tmp")
        stolen = alias / "cache" / "keys" / "report.key"
        assert stolen.read_bytes() == (tmp_path / "cache" / "keys" / "report.key").read_bytes()
        done = _read_inside(stolen)
        assert done.returncode != 0 and done.stdout == b"" and b"No such file" in done.stderr
        proof = sb.sandbox_status().proof["report_key"]
        assert proof["ok"] and f"{alias}/cache/keys: empty" in proof["evidence"]
    finally:
        subprocess.run(["umount", "-l", str(alias)], capture_output=True)


def test_a_report_key_with_another_name_signs_nothing(tmp_path, monkeypatch):
    """A hard link to the key (a backup made with links, or a link planted next to it) is a
    name outside the hidden folder: the key is refused, naming it, until it is remade."""
    from dflash_audit.report.fingerprint import report_key

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    key = report_key(create=True)
    os.link(tmp_path / "cache" / "keys" / "report.key", tmp_path / "copy")
    with pytest.raises(OSError, match="has another name \\(a hard link\\)"):
        report_key(create=False)
    (tmp_path / "copy").unlink()
    assert report_key(create=False) == key


@needs_sandbox
def test_the_sandbox_proves_itself_from_inside():
    """The report's entry: the trusted bwrap, its version, and each property proven with its
    evidence (errno names, capability masks, the PID namespace)."""
    entry = sb.sandbox_status().to_dict()
    assert entry["sandboxed"] is True and entry["bwrap"] in sp.TRUSTED_BWRAP
    assert entry["version"] == sp.bwrap_version(Path(entry["bwrap"])) != ""
    proof = entry["proof"]
    assert set(proof) == set(sp.PROPERTIES) and all(e["ok"] for e in proof.values())
    assert "CapEff 0000000000000000" in proof["capabilities"]["evidence"]
    assert "remount / read-write: EPERM" in proof["mounts"]["evidence"]
    assert "/proc: EPERM" in proof["mounts"]["evidence"]
    assert "/etc: EROFS" in proof["read_only"]["evidence"]
    assert proof["network"]["evidence"] == "network interfaces: lo"


GOOD_FACTS = {
    "status": {"uid": 0, "CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16,
               "CapBnd": "000001fffeffffff", "CapAmb": "0" * 16, "NoNewPrivs": "1"},
    "pidns": "pid:[2]", "pids": [1, 2], "writes": {"/etc": "EROFS"},
    "hidden": {"/k": []}, "interfaces": ["lo"],
    "nested": {"unshare": "ok", "umount": {"/proc": "EINVAL"}, "remount": "EPERM"},
    "umount": {"/proc": "EPERM", "/tmp": "EPERM"}, "remount": "EPERM"}


@pytest.mark.parametrize("prop, change", [
    ("capabilities", {"status": {**GOOD_FACTS["status"], "CapEff": "000001fffeffffff"}}),
    ("capabilities", {"status": {**GOOD_FACTS["status"], "NoNewPrivs": "0"}}),
    ("read_only", {"writes": {"/etc": "EROFS", "/usr/lib/python3/site-packages": "ok"}}),
    ("mounts", {"remount": "ok"}),
    ("mounts", {"umount": {"/proc": "EPERM", "/tmp": "ok"}}),
    ("nested_namespace", {"nested": {"unshare": "ok", "umount": {"/proc": "ok"},
                                     "remount": "EPERM"}}),
    ("pid_namespace", {"pidns": "pid:[1]"}),
    ("pid_namespace", {"pids": list(range(1, 40))}),
    ("report_key", {"hidden": {"/k": ["report.key"]}}),
    ("network", {"interfaces": ["eth0", "lo"]}),
])
def test_the_proof_names_what_does_not_hold(prop, change):
    assert not sp.failed(sp.judge(GOOD_FACTS, 4242, "pid:[1]"))
    proof = sp.judge({**GOOD_FACTS, **change}, 4242, "pid:[1]")
    assert [name for name, e in proof.items() if not e["ok"]] == [prop]
    assert sp.failed(proof)[0].startswith(f"{prop}: ")


@needs_sandbox
@pytest.mark.skipif(os.geteuid() != 0, reason="as a user bubblewrap holds no capability anyway")
def test_a_sandbox_that_fails_its_proof_runs_nothing(monkeypatch, fresh_status):
    """bubblewrap as root without --cap-drop starts, but its proof fails (the candidate could
    remount / and unmount its covers): a setup error (exit 2) always, never an unsandboxed
    run and never a sandbox the report calls one."""
    from dflash_audit.audit.compare import sandbox_note
    from dflash_audit.audit.setup_error import CompareSetupError

    monkeypatch.setattr(sb, "ISOLATION", tuple(f for f in sb.ISOLATION
                                               if f not in ("--cap-drop", "ALL")))
    status = sb.sandbox_status()
    assert status.state == sb.UNPROVEN and not status.available
    assert not status.proof["capabilities"]["ok"] and not status.proof["mounts"]["ok"]
    assert "remount / read-write: ok" in status.reason
    for required in (True, False):
        with pytest.raises(CompareSetupError, match=r"starts but does not prove its isolation: "
                                                    r".*capabilities: uid 0"):
            sandbox_note(SimpleNamespace(sandbox_required=required))
    with pytest.raises(sb.SandboxError):
        sb.sandboxed(["true"], None, Path("/"), Path("/"), {})


FAKE_BWRAP = """#!/bin/sh
touch "{marker}"
while [ "$1" != "--" ]; do shift; done
shift
exec "$@"
"""


def test_a_bwrap_first_on_path_is_never_the_sandbox(tmp_path, monkeypatch, fresh_status):
    """A fake ``bwrap`` (runs the command as it is) first on PATH, also under CI: never run;
    a copy at an untrusted place is refused naming why; with none at the fixed system paths
    there is no sandbox (the reason names the one on PATH), and CI refuses."""
    from dflash_audit.audit.compare import sandbox_note
    from dflash_audit.audit.setup_error import CompareSetupError

    marker = tmp_path / "fake-bwrap-ran"
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text(FAKE_BWRAP.format(marker=marker))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CI", "true")
    status = sb.sandbox_status()
    if status.available:  # this machine has a trusted bubblewrap: that one is the sandbox
        assert status.bwrap in sp.TRUSTED_BWRAP and Path(status.bwrap) != fake
        assert sb.sandboxed(["true"], None, tmp_path, tmp_path, {})[0] == status.bwrap
    assert not marker.exists()

    sb.sandbox_status.cache_clear()
    monkeypatch.setattr(sp, "TRUSTED_BWRAP", (str(fake),))  # a "trusted" path under /tmp
    status = sb.sandbox_status()
    assert status.state == sb.ABSENT and "bubblewrap is not trusted" in status.reason
    assert "writable by group or others (mode 1777)" in status.reason  # /tmp
    with pytest.raises(CompareSetupError, match="a sandbox is required"):
        sandbox_note(SimpleNamespace(sandbox_required=True))

    sb.sandbox_status.cache_clear()
    monkeypatch.setattr(sp, "TRUSTED_BWRAP", (str(tmp_path / "nowhere" / "bwrap"),))
    status = sb.sandbox_status()
    assert status.state == sb.ABSENT and "is not installed at" in status.reason
    assert f"the bwrap on PATH ({fake}) is not used" in status.reason
    assert sb.sandboxed(["true"], None, tmp_path, tmp_path, {}) == ["true"]  # unsandboxed
    assert not marker.exists()


@needs_sandbox
def test_the_candidate_python_check_runs_in_the_sandbox(tmp_path, monkeypatch):
    """``--candidate-python`` names the user's program: it runs in the sandbox, so its write
    to the host fails, it holds no capability, and the check says it is no Python."""
    from dflash_audit.audit.frameworks.registry import FrameworkError, candidate_launch

    marker = Path(os.environ["DFLASH_AUDIT_CACHE"]) / f"hostile-python-{os.getpid()}"
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho pwned > "{marker}"\ngrep CapEff /proc/self/status '
                      ">&2\nexit 3\n")
    python.chmod(0o755)
    try:
        with pytest.raises(FrameworkError, match=r"does not run Python code \(exit 3: "
                                                 r"CapEff:\s+0000000000000000\)"):
            candidate_launch(None, python=str(python))
        assert not marker.exists()
    finally:
        marker.unlink(missing_ok=True)


ADAPTER = 'NAME = {name!r}\nVERSION = {version!r}\ncandidate = None\n'


@pytest.mark.parametrize("file, name, version, why", [
    ("myfw", "SpecForge", "0.2.0", "takes the name of the built-in framework 'SpecForge'"),
    ("myfw", "Spec Forge", "0.2.0", "takes the name of the built-in framework 'SpecForge'"),
    ("myfw", "NVIDIA ModelOpt", "9", "takes the name of the built-in framework 'NVIDIA ModelOpt'"),
    ("myfw", "SpecForge 0.2.0", "", "takes the name of the built-in framework 'SpecForge'"),
    ("specforge", "Mine", "1", "takes the key of the built-in framework 'specforge'"),
])
def test_an_external_adapter_cannot_pass_for_a_built_in(file, name, version, why, tmp_path,
                                                        monkeypatch):
    """An adapter on $DFLASH_AUDIT_ADAPTER_PATH that would label its report as a built-in
    framework (its NAME, its label, or its file's key) is refused before anything runs;
    one with a name of its own is found."""
    from dflash_audit.audit.frameworks import registry

    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / f"{file}_adapter.py").write_text(ADAPTER.format(name=name, version=version))
    monkeypatch.setenv(registry.ADAPTER_PATH_ENV, str(folder))
    with pytest.raises(registry.FrameworkError, match=why) as info:
        registry.candidate_launch(f"framework:{file}")
    assert "\n" not in str(info.value) and f"remove it from ${registry.ADAPTER_PATH_ENV}" in str(
        info.value)
    (folder / f"{file}_adapter.py").unlink()
    (folder / "myfw_adapter.py").write_text(ADAPTER.format(name="MyFramework", version="1"))
    assert registry.lookup(registry.parse_framework_spec("framework:myfw"))["NAME"] == \
        "MyFramework"


def test_an_external_adapter_cannot_take_a_built_in_name_when_it_loads(tmp_path):
    """Its module may compute NAME at import (not a literal): the names the candidate process
    loaded it with are checked too."""
    from dflash_audit.audit.frameworks.registry import FrameworkError, framework_facts
    from dflash_audit.audit.sides.launch import CandidateLaunch

    path = str(tmp_path / "myfw_adapter.py")
    launch = CandidateLaunch(spec="myfw_adapter:candidate", framework={
        "key": "myfw", "name": "MyFramework", "version": "1", "module": "myfw_adapter",
        "spec": "framework:myfw", "external": path})
    with pytest.raises(FrameworkError, match=f"the adapter {path} .*takes the name of the "
                                             "built-in framework 'SpecForge'"):
        framework_facts(launch, {"adapter": {"NAME": "SpecForge", "VERSION": "0.2.0"}})
    facts = framework_facts(launch, {"adapter": {"NAME": "MyFramework", "VERSION": "1"}})
    assert facts["label"] == "MyFramework 1" and facts["external"] == path
