"""The candidate's sandbox command (audit/sides/sandbox.py) run for real: wherever compare is
started from, /tmp included, the candidate has a private writable scratch space ($TMPDIR /
tempfile works), its working directory and its own cases readable, never another audit's work
folder (cases, reference outputs), and nothing it writes outside its output folder reaches the
host."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dflash_audit.audit.sides.sandbox import sandbox_command, sandbox_status, work_root

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
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
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
