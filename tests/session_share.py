"""One computation per test run for an expensive fixture, whichever xdist worker asks first:
the others wait for it (a file lock in the run's shared base folder) and read its pickled
result. pytest-xdist's worksteal moves half of a worker's remaining tests to an idle one near
the end of the run, which splits a module: without this, each worker would make the module's
fixture again (a framework audit, a probe of vLLM: 10-30 s of CPU each)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

T = TypeVar("T")


def shared_folder(tmp_path_factory: Any, name: str) -> Path:
    """``<the run's base folder>/<name>`` (the same folder for every worker of this run;
    ``tmp_path_factory``'s own base without xdist), created."""
    base = tmp_path_factory.getbasetemp()  # an xdist worker's: popen-gwN in the run's folder
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def once_per_run(tmp_path_factory: Any, name: str, make: Callable[[Path], T]) -> T:
    """``make(folder)`` (its files go into ``folder``, shared by the workers) run once in this
    test run; every caller gets the result (a pickled copy in the other workers). A ``make``
    that raises leaves nothing: the next caller runs it again (and fails the same way)."""
    folder = shared_folder(tmp_path_factory, name)
    result = folder / "result.pickle"
    with FileLock(str(folder) + ".lock"):
        if not result.is_file():
            value = make(folder)
            result.write_bytes(pickle.dumps(value))
            return value
    return pickle.loads(result.read_bytes())
