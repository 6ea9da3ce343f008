"""The candidate's sandbox command (audit/sides/sandbox.py) run for real: wherever compare is
started from, /tmp included, the candidate has a private writable scratch space ($TMPDIR /
tempfile works), its working directory and its own cases readable, never another audit's work
folder (cases, reference outputs), and nothing it writes outside its output folder reaches the
host."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from dflash_audit.audit.sides.sandbox import sandbox_command, sandbox_status, work_root
from dflash_audit.limits import limit_s

pytestmark = pytest.mark.skipif(not sandbox_status().available,
                                reason="no bubblewrap sandbox on this machine")

PROBE = """
import os, sys, tempfile
from pathlib import Path
with tempfile.NamedTemporaryFile() as f:
    f.write(b"scratch"); f.flush()
    print("scratch", f.name)
print("cwd", os.getcwd())
print("sees", Path(sys.argv[1]).read_text())
print("own-cases", Path(sys.argv[4], "case.json").read_text())
print("other-audit", Path(sys.argv[5]).exists())
try:
    Path("/tmp", sys.argv[2]).write_text("x")
    print("tmp-write ok")
except OSError as exc:
    print("tmp-write refused", exc.errno)
Path(sys.argv[3], "result").write_text("written")
"""


@pytest.mark.parametrize("where", ["/tmp", "under-tmp"])
def test_a_private_scratch_space_wherever_compare_starts(where, tmp_path):
    cwd = Path("/tmp") if where == "/tmp" else tmp_path
    marker = cwd / f"dflash-audit-sandbox-{uuid.uuid4().hex}.txt"
    marker.write_text("the user's file")
    tag = uuid.uuid4().hex
    mine = work_root() / f"dflash-audit-cases-test-{tag}"  # this audit's work folder
    (mine / "cases").mkdir(parents=True)
    (mine / "cases" / "case.json").write_text("my case")
    out = mine / "out"
    out.mkdir()
    other = work_root() / f"dflash-audit-cases-other-{tag}" / "reference.json"
    other.parent.mkdir()
    other.write_text("another audit's reference outputs")
    planted = f"planted-{tag}"
    try:
        cmd = sandbox_command([sys.executable, "-I", "-c", PROBE, str(marker), planted,
                               str(out), str(mine / "cases"), str(other)],
                              bwrap=sandbox_status().bwrap, writable=[out],
                              readable=[cwd, mine / "cases"], private=[work_root()], cwd=cwd)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s(60),
                              check=False)
        assert proc.returncode == 0, proc.stderr
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert lines["sees"] == "the user's file"  # the working directory is readable
        assert lines["own-cases"] == "my case" and lines["other-audit"] == "False"
        assert lines["cwd"] == str(cwd)
        scratch = Path(lines["scratch"])
        assert not scratch.exists()  # the temporary file lived in the sandbox only
        if where == "/tmp":  # /tmp stays as it is, read-only; $TMPDIR is private
            assert str(scratch).startswith("/dev/shm/")
            assert lines["tmp-write"].startswith("refused")
        else:  # a private, empty /tmp
            assert str(scratch).startswith("/tmp/") and lines["tmp-write"] == "ok"
        assert not (Path("/tmp") / planted).exists()  # nothing reached the host's /tmp
        assert (out / "result").read_text() == "written"  # its own output folder is writable
    finally:
        marker.unlink(missing_ok=True)
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(other.parent, ignore_errors=True)


LIST_ROOT = """
import os, sys
from pathlib import Path
print("root", sorted(os.listdir(sys.argv[1])))
print("own-cases", Path(sys.argv[2], "case.json").read_text())
Path(sys.argv[3], "result").write_text("written")
"""


def _audit_folders(root: Path, tag: str) -> tuple[Path, Path]:
    """This audit's cases and output folder in ``root``, and another audit's folder beside."""
    mine = root / f"dflash-audit-cases-mine-{tag}"
    (mine / "cases").mkdir(parents=True)
    (mine / "cases" / "case.json").write_text("my case")
    (mine / "out").mkdir()
    other = root / f"dflash-audit-cases-other-{tag}"
    other.mkdir(parents=True)
    (other / "reference.json").write_text("another audit's reference outputs")
    return mine, other


@pytest.mark.parametrize("holder", ["tempdir", "root"])
def test_a_readable_folder_holding_the_work_root_never_binds_it_back(holder, tmp_path):
    # $TMPDIR is the candidate's folder (or the working directory), or compare starts inside
    # the root: binding that folder back after the root's cover showed every audit's folder
    root = tmp_path / "dflash-audit-work"
    mine, _ = _audit_folders(root, uuid.uuid4().hex)
    held = tmp_path if holder == "tempdir" else root
    cmd = sandbox_command([sys.executable, "-I", "-c", LIST_ROOT, str(root), str(mine / "cases"),
                           str(mine / "out")], bwrap=sandbox_status().bwrap,
                          writable=[mine / "out"], readable=[held, mine / "cases"],
                          private=[root], cwd=held)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s(60), check=False)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["root"] == repr([mine.name]), lines  # never the other audit's folder
    assert lines["own-cases"] == "my case"
    assert (mine / "out" / "result").read_text() == "written"


def test_an_audit_with_another_tmpdir_is_hidden_too(tmp_path, monkeypatch):
    # audit A ran with $TMPDIR=a, this one with $TMPDIR=b from /tmp (so /tmp stays readable):
    # A's root is not this audit's root, yet its candidate must not read it
    import tempfile

    from dflash_audit.audit.sides.sandbox import sandboxed

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a"))
    root_a = work_root()
    _, other = _audit_folders(root_a, "a")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "b"))
    root_b = work_root()
    assert root_b != root_a
    mine, _ = _audit_folders(root_b, "b")
    monkeypatch.chdir("/tmp")
    probe = LIST_ROOT.replace('print("root"', 'print("other", Path(sys.argv[4]).exists())\n'
                                             'print("root"')
    cmd = sandboxed([sys.executable, "-I", "-c", probe, str(root_b), str(mine / "cases"),
                     str(mine / "out"), str(other / "reference.json")], None, mine / "cases",
                    mine / "out", env={})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s(60), check=False)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["other"] == "False", lines
    assert lines["root"] == repr([mine.name]) and lines["own-cases"] == "my case"


@pytest.mark.parametrize("planted", ["file", "link", "dangling-link"])
def test_a_work_root_that_is_no_folder_of_ours_is_a_setup_error(planted, tmp_path, monkeypatch):
    # a file or a link where the root goes: one message (exit 2), not a traceback, and a link
    # is never followed (the candidate's paths would not exist inside the sandbox)
    import tempfile

    from dflash_audit.audit.setup_error import CompareSetupError

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / "dflash-audit-work"
    if planted == "file":
        root.write_text("not a folder")
    else:
        (tmp_path / "elsewhere").mkdir()
        root.symlink_to(tmp_path / ("elsewhere" if planted == "link" else "gone"))
    with pytest.raises(CompareSetupError, match="cannot use the work folder"):
        work_root()
    assert not (tmp_path / "elsewhere").exists() or not any((tmp_path / "elsewhere").iterdir())
    assert not (tmp_path / "gone").exists()


def test_an_interpreter_in_a_venv_under_tmp_runs_in_the_sandbox(tmp_path_factory):
    """A venv (or clone) under /tmp, which the sandbox replaces with a private one: its
    interpreter, the file it links to and its site-packages are bound back read-only."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="dflash-audit-venv-test-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")],
                       check=True, capture_output=True, timeout=limit_s(120))
        python = base / "venv" / "bin" / "python"
        cmd = sandbox_command([str(python), "-c", "import sys, site; print(sys.prefix); "
                               "print(site.getsitepackages()[0])"],
                              bwrap=sandbox_status().bwrap, cwd=Path("/"))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s(120))
        assert done.returncode == 0, done.stderr
        prefix, site_dir = done.stdout.split()
        assert prefix == str(base / "venv") and Path(site_dir).is_relative_to(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_cache_under_tmp_gives_the_waiting_process_the_sandbox_its_cases_need(
        tmp_path, monkeypatch):
    """The waiting candidate process starts before any case is written; a case's derivation
    reads its verifier from ``<cache>/verifiers``. That folder is bound from the start, so a
    cache under /tmp (as tmp_path is) gives the same sandbox once the cases name it (no second
    candidate process); a verifier elsewhere under /tmp is still bound when a case names it,
    and one named from the start (compare's ``--verifier`` folder) gives the same sandbox."""
    from dflash_audit.audit.sides.sandbox import candidate_sandbox_command

    cache = tmp_path / "cache"
    verifier = cache / "verifiers" / "tiny"
    verifier.mkdir(parents=True)
    (verifier / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(cache))
    cases, out = tmp_path / "cases", tmp_path / "out"
    (cases / "c0").mkdir(parents=True)
    out.mkdir()
    read = [sys.executable, "-I", "-c", f"print(open({str(verifier / 'config.json')!r}).read())"]

    def command(readable=()) -> list[str]:
        return candidate_sandbox_command(read, None, cases, out, {}, sandbox_status().bwrap,
                                         readable=list(readable))

    before = command()
    (cases / "c0" / "derive.json").write_text(json.dumps({"verifier_dir": str(verifier)}))
    assert command() == before
    proc = subprocess.run(before, capture_output=True, text=True, timeout=limit_s(60))
    assert proc.returncode == 0 and "llama" in proc.stdout, proc.stderr
    elsewhere = tmp_path / "user-verifier"
    elsewhere.mkdir()
    (cases / "c0" / "derive.json").unlink()
    named = command([elsewhere])
    (cases / "c0" / "derive.json").write_text(json.dumps({"verifier_dir": str(elsewhere)}))
    assert str(elsewhere) in command() and str(elsewhere) not in before
    assert command([elsewhere]) == named and str(elsewhere) in named
    # one in a work root (another audit's files) is never bound back, named or not
    inside = Path(tempfile.mkdtemp(dir=work_root()))
    try:
        (inside / "config.json").write_text("{}")
        (cases / "c0" / "derive.json").write_text(json.dumps({"verifier_dir": str(inside)}))
        assert command([inside]) == command() and str(inside) not in command([inside])
    finally:
        shutil.rmtree(inside)


def test_a_folder_is_covered_by_every_path_a_mount_of_its_file_system_reaches(tmp_path):
    """The covered paths of a folder: itself and its path under every other mount of the same
    file system whose root holds it (when that is the same folder); other devices, mounts
    that do not hold it and folders that do not exist add nothing. A mount table given as a
    file (a space escaped as the kernel writes it): the other mount points are links into the
    first, so they reach the same folder; a mount of a subfolder shows part of it (one of
    another device, or of a sibling whose name starts alike, does not)."""
    from dflash_audit.folder_registry import folders_with_aliases

    (tmp_path / "vol" / "keys").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "again").symlink_to(tmp_path / "vol")
    table = tmp_path / "mountinfo"
    rows = enumerate([("8:1", "/", "/"), ("8:2", "/", tmp_path / "vol"),
                      ("8:2", "/", tmp_path / "again"), ("8:2", "/keys", tmp_path / "just keys"),
                      ("8:3", "/", tmp_path / "other"), ("8:2", "/keys/sub", tmp_path / "part"),
                      ("8:3", "/keys/sub", tmp_path / "other"), ("8:2", "/keysake", "/")])
    table.write_text("".join(f"{i} 1 {dev} {root} {str(point).replace(' ', chr(92) + '040')} rw"
                             " - ext4 x rw\n" for i, (dev, root, point) in rows))
    keys = tmp_path / "vol" / "keys"
    (tmp_path / "just keys").symlink_to(keys)
    (tmp_path / "part").mkdir()  # a subfolder of keys bound there: it is covered too
    got = folders_with_aliases([keys, tmp_path / "gone", keys], str(table))
    assert got == [keys, tmp_path / "again" / "keys", tmp_path / "just keys", tmp_path / "part"]
    assert folders_with_aliases([tmp_path / "other"], str(table)) == [tmp_path / "other"]
    assert folders_with_aliases([keys], str(tmp_path / "no-table")) == [keys]
