"""Progress of long work, on a terminal and in CI logs alike.

On a TTY the commands draw rich progress bars. On anything else (a CI log, a pipe, a file)
a bar prints nothing useful, so :class:`LineProgress` prints one line per task at a steady
interval instead: ``dflash-audit: <task>: <done>/<total> (<rate>/s, ETA <m:ss>)``.
:func:`progress_display` picks one of the two; both offer ``add_task`` / ``advance`` /
``update`` / ``console.print``, the subset of ``rich.progress.Progress`` the commands use.

The interval is 10 s, or ``$DFLASH_AUDIT_PROGRESS_INTERVAL`` seconds (0: every update).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

PREFIX = "dflash-audit: "
DEFAULT_INTERVAL_S = 10.0


def interval_s() -> float:
    """Seconds between two progress lines on a non-TTY (``$DFLASH_AUDIT_PROGRESS_INTERVAL``,
    default 10)."""
    try:
        return max(0.0, float(os.environ.get("DFLASH_AUDIT_PROGRESS_INTERVAL", "")))
    except ValueError:
        return DEFAULT_INTERVAL_S


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is an interactive terminal."""
    stream = stream or sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    initial: float = 0.0  # units already done when the task was added (a resumed run)
    start: float = field(default_factory=time.monotonic)
    last_print: float = field(default_factory=time.monotonic)
    printed_at: float = -1.0
    info: str = ""


class _LineConsole:
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def print(self, text: Any, **_: Any) -> None:
        print(text, file=self._stream, flush=True)


class LineProgress:
    """A progress display for non-TTY output: per task, a line at most every
    :func:`interval_s` seconds (and one when the task completes) with done/total, rate and
    ETA. Mirrors the part of ``rich.progress.Progress`` the commands use."""

    def __init__(self, stream: TextIO | None = None, interval: float | None = None) -> None:
        self._stream = stream or sys.stderr
        self.interval = interval_s() if interval is None else interval
        self.console = _LineConsole(self._stream)
        self._tasks: dict[int, _Task] = {}

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Nothing to start (rich compatibility)."""

    def stop(self) -> None:
        """Print the last state of every task not yet printed at its final count."""
        for task in self._tasks.values():
            if task.printed_at != task.completed:
                self._print(task)

    def add_task(self, description: str, total: float | None = None, completed: float = 0,
                 **fields: Any) -> int:
        """A new task; returns its id."""
        task_id = len(self._tasks)
        self._tasks[task_id] = _Task(description, total, completed, initial=completed,
                                     printed_at=completed, info=fields.get("info", ""))
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        """Count ``advance`` more units done."""
        task = self._tasks[task_id]
        self.update(task_id, completed=task.completed + advance)

    def update(self, task_id: int, completed: float | None = None, total: float | None = None,
               **fields: Any) -> None:
        """Set the task's count (and total / info); prints when the interval has passed or
        the task is complete."""
        task = self._tasks[task_id]
        if completed is not None:
            task.completed = completed
        if total is not None:
            task.total = total
        if "info" in fields:
            task.info = fields["info"]
        now = time.monotonic()
        done = task.total is not None and task.completed >= task.total
        if now - task.last_print >= self.interval or done:
            self._print(task)

    def line(self, task_id: int) -> str:
        """The progress line of a task (without printing it)."""
        task = self._tasks[task_id]
        return self._format(task)

    def _format(self, task: _Task) -> str:
        elapsed = max(time.monotonic() - task.start, 1e-9)
        rate = (task.completed - task.initial) / elapsed
        total = f"/{task.total:g}" if task.total is not None else ""
        eta = ""
        if task.total is not None and rate > 0:
            eta = f", ETA {_clock((task.total - task.completed) / rate)}"
        info = f" | {task.info}" if task.info else ""
        return (f"{PREFIX}{task.description}: {task.completed:g}{total} "
                f"({rate:.2f}/s, {_clock(elapsed)} elapsed{eta}){info}")

    def _print(self, task: _Task) -> None:
        print(self._format(task), file=self._stream, flush=True)
        task.last_print = time.monotonic()
        task.printed_at = task.completed


def progress_display(columns: tuple[Any, ...] = (), stream: TextIO | None = None) -> Any:
    """A rich ``Progress`` on ``stream`` (default stderr) when it is a terminal, else a
    :class:`LineProgress`. ``columns``: rich columns (default: description, bar, n/total,
    elapsed, remaining). Use as a context manager or with ``start()`` / ``stop()``."""
    stream = stream or sys.stderr
    if not is_terminal(stream):
        return LineProgress(stream)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = columns or (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TimeRemainingColumn())
    return Progress(*columns, console=Console(file=stream), transient=False)
