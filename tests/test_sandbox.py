"""The candidate's sandbox command (audit/sides/sandbox.py) run for real: wherever compare is
started from, /tmp included, the candidate has a private writable scratch space ($TMPDIR /
tempfile works), its working directory readable, and nothing it writes outside its output
folder reaches the host."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dflash_audit.audit.sides.sandbox import sandbox_command, sandbox_status

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
    out = tmp_path / "out"
    out.mkdir()
    planted = f"planted-{uuid.uuid4().hex}"
    try:
        cmd = sandbox_command([sys.executable, "-I", "-c", PROBE, str(marker), planted,
                               str(out)], bwrap=sandbox_status().bwrap, writable=[out],
                              readable=[cwd], cwd=cwd)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert lines["sees"] == "the user's file"  # the working directory is readable
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
