"""The suite's progress lines (tests/suite_progress.py): counts, failures and the longest
running tests every interval, under xdist too, and pytest's final line stays the last."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from suite_progress import SuiteProgress

from dflash_audit.limits import limit_s

HERE = Path(__file__).resolve().parent


class Report:
    def __init__(self, nodeid, when, failed=False):
        self.nodeid, self.when, self.failed = nodeid, when, failed


def test_a_line_per_interval_with_counts_failures_and_the_longest_running():
    now, lines = [0.0], []
    progress = SuiteProgress(lines.append, 30.0, clock=lambda: now[0])
    progress.total = 4
    for name in ("a", "b", "slow"):
        progress.pytest_runtest_logstart(name, None)
    now[0] = 5.0
    progress.pytest_runtest_logreport(Report("a", "call", failed=True))
    progress.pytest_runtest_logreport(Report("a", "teardown"))
    assert lines == []  # not before the interval
    now[0] = 95.0
    progress.pytest_runtest_logreport(Report("b", "teardown"))
    assert lines == ["progress: 2/4 tests, 1 failed, 1m35s; running longest: slow (95 s)"]
    now[0] = 100.0
    progress.pytest_runtest_logreport(Report("slow", "teardown"))
    assert len(lines) == 1  # at most one line per interval


def test_under_xdist_the_lines_come_between_and_pytests_final_line_is_last(tmp_path):
    (tmp_path / "test_tiny.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(1.5)\n\n"
        "def test_fast():\n    pass\n\ndef test_fails():\n    assert False\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "suite_progress", "-p",
         "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
        timeout=limit_s(120), env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE),
                                   "DFLASH_AUDIT_TEST_PROGRESS": "0.2"})
    lines = proc.stdout.strip().splitlines()
    progress = [line for line in lines if line.startswith("progress: ")]
    assert progress and all("/3 tests, " in line for line in progress), proc.stdout
    assert any("running longest: test_tiny.py::test_slow (" in line for line in progress), \
        proc.stdout
    assert lines[-1].startswith("1 failed, 2 passed in "), proc.stdout
