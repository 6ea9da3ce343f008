"""Training metrics: per-step summary, JSONL file, TensorBoard, and progress (a rich bar on a
terminal, a line every ~10 s otherwise: :mod:`dflash_audit.progress`).

Per step (``<out>/metrics.jsonl``, one JSON object per line, ``"kind": "train"``):
``step``, ``loss``, ``lr`` (one per optimizer), ``grad_norm``, ``acc_<s>`` (per draft slot s,
pooled over the step's rows and ranks), ``full_acc``, ``eal`` (leading-run acceptance length,
the 0.9.0 definition), ``eal_product`` (product of per-slot accuracies, main@c05b95b),
``supervised`` (draft slots supervised), ``step_s``, ``elapsed_s``. Evaluations are lines
with ``"kind": "eval"``. TensorBoard scalars go to ``<out>/tensorboard`` under ``train/``
and ``eval/``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_audit.user_input import loads_json

_SLOT = re.compile(r"^position_(\d+)_acc_sum$")


def summarize(raw: dict[str, float]) -> dict[str, float]:
    """Pooled raw ``*_sum``/``*_total`` metrics -> ratios (see the module docstring)."""
    out: dict[str, float] = {}
    if raw.get("loss_total"):
        out["loss"] = raw["loss_sum"] / raw["loss_total"]
    slots = sorted(int(m.group(1)) for k in raw if (m := _SLOT.match(k)))
    product, running = 0.0, 1.0
    for s in slots:
        total = raw.get(f"position_{s}_acc_total", 0.0)
        acc = raw[f"position_{s}_acc_sum"] / total if total else float("nan")
        out[f"acc_{s}"] = acc
        running *= acc if total else 0.0
        product += running
    if slots:
        out["eal_product"] = product
    for name in ("full_acc", "eal"):
        total = raw.get(f"{name}_total", 0.0)
        if f"{name}_sum" in raw:
            out[name] = raw[f"{name}_sum"] / total if total else float("nan")
    if "full_acc_total" in raw:
        out["supervised"] = raw["full_acc_total"]
    return out


def _fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def describe(summary: dict[str, Any], max_slots: int = 4) -> str:
    """One line for the progress bar: loss, first per-slot accuracies, acceptance length."""
    slots = sorted(int(k[4:]) for k in summary if k.startswith("acc_"))
    accs = " ".join(_fmt(summary[f"acc_{s}"]) for s in slots[:max_slots])
    more = " ..." if len(slots) > max_slots else ""
    return (f"loss {_fmt(summary.get('loss'))} | acc {accs}{more} | "
            f"eal {_fmt(summary.get('eal'))}")


def read_metrics(metrics_path: str | Path) -> tuple[dict[int, dict[str, Any]],
                                                    list[dict[str, Any]]]:
    """The ``"kind": "train"`` lines of ``metrics.jsonl`` by step (a resumed run re-logs the
    steps after its checkpoint: the last line of a step wins; a line cut by a kill is
    skipped, as is any line that is not a JSON object or whose step is not an integer) and
    its ``"kind": "eval"`` lines in file order. Empty when there is no file."""
    train: dict[int, dict[str, Any]] = {}
    evals: list[dict[str, Any]] = []
    path = Path(metrics_path)
    if path.is_file():
        # a kill can cut a line inside a character; an edited file may hold anything
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = loads_json(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            step = record.get("step")
            if type(step) is not int:  # a bool is not a step
                continue
            if record.get("kind") == "train":
                train[step] = record
            elif record.get("kind") == "eval":
                evals.append(record)
    return train, evals


def loss_curve(metrics_path: str | Path, windows: int = 10) -> list[dict[str, Any]]:
    """The training loss of a run, averaged over ``windows`` consecutive step ranges.

    Reads the train lines of ``metrics.jsonl`` (:func:`read_metrics`) and splits steps into
    ``windows`` near-equal contiguous ranges. One step's loss is one packed row's, too noisy
    to read alone; a window mean is the curve.

    Returns:
        ``[{"first_step", "last_step", "loss"}, ...]`` in step order (empty without a
        train line); ``loss`` is the mean over the range's steps that logged one.
    """
    losses = {step: r["loss"] for step, r in read_metrics(metrics_path)[0].items()
              if isinstance(r.get("loss"), float)}
    steps = sorted(losses)
    curve = []
    n = min(windows, len(steps))
    for w in range(n):
        chunk = steps[w * len(steps) // n:(w + 1) * len(steps) // n]
        curve.append({"first_step": chunk[0], "last_step": chunk[-1],
                      "loss": sum(losses[s] for s in chunk) / len(chunk)})
    return curve


class Tracker:
    """Writes metrics (rank 0 only; other ranks get a tracker with ``enabled=False``)."""

    def __init__(self, out: Path, total_steps: int, start_step: int = 0, enabled: bool = True,
                 tensorboard: bool = True, progress: bool = True):
        self.enabled = enabled
        self.start = time.perf_counter()
        self._jsonl = None
        self._tb = None
        self._progress = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self._jsonl = (out / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if progress:  # a bar on a terminal, a line every ~10 s in a log
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            from dflash_audit.progress import progress_display

            self._progress = progress_display((
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}")))
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, info="")

    def log_step(self, step: int, raw: dict[str, float], grad_norm: float, lrs: list[float],
                 step_s: float) -> dict[str, Any]:
        """Record one step; returns the summary written."""
        summary = summarize(raw)
        record = {"kind": "train", "step": step, **summary, "grad_norm": grad_norm,
                  "lr": lrs, "step_s": round(step_s, 4),
                  "elapsed_s": round(time.perf_counter() - self.start, 2)}
        if not self.enabled:
            return record
        self._write(record)
        if self._tb is not None:
            for k, v in summary.items():
                self._tb.add_scalar(f"train/{k}", v, step)
            self._tb.add_scalar("train/grad_norm", grad_norm, step)
            for i, lr in enumerate(lrs):
                self._tb.add_scalar(f"train/lr_{i}", lr, step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=describe(summary))
        return record

    def log_eval(self, step: int, name: str, result: dict[str, Any]) -> None:
        """Record an acceptance evaluation (``name``: ``untrained`` / ``trained``)."""
        if not self.enabled:
            return
        self._write({"kind": "eval", "step": step, "name": name, **result})
        if self._tb is not None:
            self._tb.add_scalar(f"eval/acceptance_length_{name}", result["acceptance_length"],
                                step)

    def eval_progress(self, name: str) -> Callable[[Any], None] | None:
        """A progress callback for :func:`dflash_audit.train.evaluate.evaluate_acceptance` that
        shows the ``name`` evaluation as a second task of the training display (tokens done
        of the most possible, prompts, running acceptance length, tokens/s, ETA); None when
        this tracker shows no progress."""
        if not self.enabled or self._progress is None:
            return None
        task = self._progress.add_task(f"eval {name}", total=None, info="")

        def update(p: Any) -> None:
            self._progress.update(task, completed=p.tokens, total=p.max_tokens,
                                  info=p.describe())

        return update

    def message(self, text: str) -> None:
        """A line on stderr (through the progress bar's console when it is running)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
