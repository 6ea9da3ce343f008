"""Which xdist worker runs what, and in what order: the suite's scheduler for ``--dist
loadfile`` (pyproject.toml), installed through xdist's ``pytest_xdist_make_scheduler`` hook.

* The tests of one module run on one worker (a unit of work), so a module-scoped fixture (a
  compare, a framework's install, a server's start: 20-40 s each) is set up once per run, not
  once per worker. A module whose tests took more than :data:`MAX_GROUP_S` together is split
  into that many units (its tests dealt in turn), so no worker is left alone with one long
  module at the end.
* The units are sent slowest first, by the durations the suite's earlier runs measured
  (:data:`DURATIONS_FILE` in the suite's cache, written by the controller at the end of each
  run): the longest start while every worker is busy, and the run ends on short ones. Units
  of similar weight (the same power of two of seconds) keep their collection order, so
  ``--random-order`` still shuffles among them; units under :data:`HEAVY_S` keep theirs.

Without a durations file (a fresh cache) the units go in collection order, one module each.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

#: The measured durations (seconds, setup + call + teardown per test id), in the suite's cache.
DURATIONS_FILE = "test-durations.json"
#: Units lighter than this keep their place (their order barely changes the run's length).
HEAVY_S = 4.0
#: A module is split above this many seconds (about a tenth of the suite's work on 2 cores).
MAX_GROUP_S = 150.0


def durations_path() -> Path:
    """The durations file in the suite's cache (``$DFLASH_AUDIT_CACHE``, set by conftest)."""
    return Path(os.environ["DFLASH_AUDIT_CACHE"]) / DURATIONS_FILE


def read_durations(path: Path) -> dict[str, float]:
    """``{test id: seconds}`` from ``path``; empty when it is missing or not such a map."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}


def assign_units(ids: list[str], durations: dict[str, float]) -> dict[str, str]:
    """``{test id: unit}``: the test's module, or ``module#i`` when the module's tests took
    more than :data:`MAX_GROUP_S` together (split into that many parts, its tests dealt in
    turn in sorted order: the same split whatever the collection's order)."""
    modules: dict[str, list[str]] = {}
    for nodeid in ids:
        modules.setdefault(nodeid.split("::", 1)[0], []).append(nodeid)
    units = {}
    for module, members in modules.items():
        parts = max(1, math.ceil(sum(durations.get(i, 0.0) for i in members) / MAX_GROUP_S))
        for n, nodeid in enumerate(sorted(members)):
            units[nodeid] = module if parts == 1 else f"{module}#{n % parts}"
    return units


def slowest_first(ids: list[str], durations: dict[str, float]) -> OrderedDict:
    """The units of :func:`assign_units` as ``{unit: {test id: False}}`` (xdist's work queue),
    heaviest weight class first, in order of first appearance within a class."""
    units = assign_units(ids, durations)
    queue: OrderedDict = OrderedDict()
    weights: dict[str, float] = {}
    for nodeid in ids:
        queue.setdefault(units[nodeid], {})[nodeid] = False
        weights[units[nodeid]] = weights.get(units[nodeid], 0.0) + durations.get(nodeid, 0.0)

    def weight_class(unit: str) -> int:
        return int(math.log2(weights[unit])) if weights[unit] >= HEAVY_S else -1

    return OrderedDict((u, queue[u]) for u in sorted(queue, key=lambda u: -weight_class(u)))


def _scheduler_class() -> type:
    from xdist.scheduler import LoadScopeScheduling

    class SlowestFirst(LoadScopeScheduling):
        """xdist's scope scheduling over the units of :func:`slowest_first`."""

        def schedule(self) -> None:
            if self.collection is not None:  # a node added later: as xdist does
                super().schedule()
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            self.workqueue = slowest_first(self.collection, read_durations(durations_path()))
            for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than work
                node, _assigned = self.assigned_work.popitem()
                node.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return SlowestFirst


class _Order:
    """The scheduler (in the controller, for ``--dist loadfile``) and the recording."""

    def __init__(self, config: pytest.Config) -> None:
        self.config, self.measured = config, {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadfile":
            return None
        return _scheduler_class()(config, log)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        if hasattr(self.config, "workerinput") or not self.measured:
            return  # a worker: its controller records
        path = durations_path()
        durations = {**read_durations(path), **self.measured}
        tmp = path.with_name(f".{DURATIONS_FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(durations, indent=0, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache: the next run keeps its order


def register(config: pytest.Config) -> None:
    """Install the scheduler and the recording (called from conftest's ``pytest_configure``)."""
    config.pluginmanager.register(_Order(config), "suite-order")
