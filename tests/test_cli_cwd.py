"""Started from a working directory that was deleted, every command says so in one line and
exits 2 (importing torch there would die with an oneMKL fatal error, exit code 2 too, with no
word of the cause)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_audit.limits import limit_s

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", ["compare", "train"])
def test_a_deleted_working_directory_is_one_line(command, tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    script = f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m dflash_audit.cli {command} --help'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["sh", "-c", script, sys.executable], capture_output=True, text=True,
                          timeout=limit_s(120), env=env, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("shell-init")]
    assert lines == [("error: the current working directory no longer exists (deleted while "
                      "this shell was in it): cd to an existing folder and rerun")]
