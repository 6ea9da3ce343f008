"""A line every ``$DFLASH_AUDIT_TEST_PROGRESS`` seconds (default 30; 0: none) while the suite
runs: tests done of the total, failures so far, and the tests running longest (for a whole
interval at least), so a person
watching a long or busy run knows where it is. It lives in the controller process (under
xdist the workers' reports arrive there through ``pytest_runtest_logstart`` /
``pytest_runtest_logreport``); the lines are written between pytest's own, never at the end,
so the final ``N passed`` line stays pytest's last. Quiet under ``-qq`` and in the workers.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

ENV = "DFLASH_AUDIT_TEST_PROGRESS"
DEFAULT_EVERY_S = 30.0
#: How many of the longest-running tests a line names.
SHOWN = 2


class SuiteProgress:
    """Counts tests as their teardown reports arrive and, at most every ``every_s`` seconds
    (checked at each report), writes one line through the terminal reporter."""

    def __init__(self, write_line: Any, every_s: float, clock: Any = time.monotonic):
        self.write_line, self.every_s, self.clock = write_line, every_s, clock
        self.total: int | None = None
        self.done = 0
        self.failed: set[str] = set()
        self.running: dict[str, float] = {}
        self.start = self.last = clock()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.total = len(ids)  # every worker collects the whole suite

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # not under xdist (its controller collects nothing)
            self.total = len(session.items)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.running[nodeid] = self.clock()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when == "teardown":
            self.done += 1
            self.running.pop(report.nodeid, None)
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self.write_line(self.line(now))

    def line(self, now: float) -> str:
        """``progress: 120/480 tests, 1 failed, 3m05s; running longest: ID (95 s), ...``."""
        minutes, seconds = divmod(int(now - self.start), 60)
        text = (f"progress: {self.done}/{self.total if self.total is not None else '?'} tests, "
                f"{len(self.failed)} failed, {minutes}m{seconds:02d}s")
        slow = sorted(((now - t, n) for n, t in self.running.items()
                       if now - t >= self.every_s), reverse=True)[:SHOWN]
        if slow:
            text += "; running longest: " + ", ".join(f"{n} ({age:.0f} s)" for age, n in slow)
        return text


def register(config: pytest.Config) -> None:
    """Register :class:`SuiteProgress` in the controller (or the only process) unless
    ``$DFLASH_AUDIT_TEST_PROGRESS`` is 0 (or not a number), the run is ``-qq``, or it is
    registered already."""
    try:
        every_s = float(os.environ.get(ENV, DEFAULT_EVERY_S))
    except ValueError:
        every_s = 0.0
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if (not every_s > 0 or reporter is None or hasattr(config, "workerinput")
            or config.option.verbose < -1
            or config.pluginmanager.has_plugin("dflash-suite-progress")):
        return

    def write_line(line: str) -> None:  # on a line of its own, also after -q's dots
        if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
            reporter.write("\n")
        reporter.write_line(line)

    config.pluginmanager.register(SuiteProgress(write_line, every_s), "dflash-suite-progress")


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config: pytest.Config) -> None:
    """As a plugin of its own (``-p suite_progress``): :func:`register`."""
    register(config)
