"""Progress of an audit: each stage timed, shown as a rich progress bar on a terminal, else as
one line per stage on stderr."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: seconds after which a stage without a progress bar prints that it is still running
STILL_RUNNING_S = 5.0


@dataclass
class Stages:
    """Times each stage; shows a rich progress bar on a terminal, else one line per stage
    on stderr when it ends ("LABEL: 3.2 s"), preceded by "LABEL ..." when the stage runs
    longer than :data:`STILL_RUNNING_S`."""

    enabled: bool
    timing: dict[str, float] = field(default_factory=dict)
    _progress: Any = None

    def __enter__(self) -> Stages:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                      BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def say(self, text: str) -> None:
        """A line of text above the bar (or on stderr)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(f"dflash-audit: {text}", file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, key: str, label: str, total: int | None = None
              ) -> Iterator[Callable[[int], None]]:
        """Time ``key``; yields ``advance(n)`` for stages with ``total`` steps."""
        start = time.perf_counter()
        task = self._progress.add_task(label, total=total) if self._progress else None
        # without a bar, a stage still running after STILL_RUNNING_S says what it is doing
        # (a cold reference download or verifier conversion takes minutes, not silence)
        notice = None if self.enabled else threading.Timer(
            STILL_RUNNING_S, lambda: print(f"dflash-audit: {label} ...", file=sys.stderr,
                                           flush=True))
        if notice is not None:
            notice.daemon = True
            notice.start()

        def advance(n: int = 1) -> None:
            if task is not None:
                self._progress.advance(task, n)

        try:
            yield advance
        finally:
            if notice is not None:
                notice.cancel()
            self.timing[key] = self.timing.get(key, 0.0) + time.perf_counter() - start
            if task is not None:
                self._progress.update(task, completed=total or 1, total=total or 1)
            elif not self.enabled:
                print(f"dflash-audit: {label}: {self.timing[key]:.1f} s", file=sys.stderr,
                      flush=True)
