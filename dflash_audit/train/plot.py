"""The picture of a training run: ``<out>/curves.png`` from its ``metrics.jsonl``.

Two panels over the global step: the training loss (each step's value, faint, and its running
mean over ``window`` steps; a log scale when every value is positive), and the acceptance
length -- the training rows' leading-run acceptance length per step (``eal``, teacher-forced;
running mean) and the held-out evaluations by speculative decoding (``"kind": "eval"`` lines:
untrained, trained) as labelled points. Drawn with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from dflash_audit.train.track import read_metrics

PLOT_FILE = "curves.png"


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start); NaNs
    and infinities are skipped (a window without a finite value gives NaN). O(n)."""
    sums, counts, out = [0.0], [0], []
    for v in values:
        ok = math.isfinite(v)
        sums.append(sums[-1] + (v if ok else 0.0))
        counts.append(counts[-1] + ok)
    for i in range(1, len(values) + 1):
        j = max(0, i - window)
        n = counts[i] - counts[j]
        out.append((sums[i] - sums[j]) / n if n else math.nan)
    return out


def plot_run(out: str | Path, window: int | None = None) -> Path | None:
    """Draw ``<out>/curves.png`` (written to a temporary file, then renamed into place).

    Args:
        out: the run folder (holds ``metrics.jsonl``).
        window: steps in the running means (default: 1/50 of the steps, at least 1).

    Returns:
        The PNG's path, or None when the run logged no training step.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

    out = Path(out)
    train, evals = read_metrics(out / "metrics.jsonl")
    if not train:
        return None
    steps = sorted(train)
    window = window or max(1, len(steps) // 50)

    def series(key: str) -> list[float]:
        return [float(v) if isinstance(v := train[s].get(key), (int, float)) else math.nan
                for s in steps]

    loss, eal = series("loss"), series("eal")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True)
    if window > 1:
        top.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.8,
                 label="loss per step")
    top.plot(steps, running_mean(loss, window), color="tab:blue", linewidth=1.8,
             label=f"running mean ({window} steps)" if window > 1 else "loss per step")
    if all(v > 0 for v in loss if math.isfinite(v)) and any(math.isfinite(v) for v in loss):
        top.set_yscale("log")  # the first steps' loss is often 10x the rest
        top.yaxis.set_major_formatter(ScalarFormatter())  # 1, 10 (not 10^0, 10^1)
        top.yaxis.set_minor_formatter(NullFormatter())
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("training loss")
    top.legend(loc="best")
    top.grid(alpha=0.3)
    bottom.plot(steps, running_mean(eal, window), color="tab:orange", linewidth=1.8,
                label="training rows, teacher-forced" + (
                    f" (running mean, {window} steps)" if window > 1 else ""))
    for record in evals:
        value, at = record.get("acceptance_length"), record["step"]  # an int: read_metrics
        if isinstance(value, (int, float)):
            bottom.plot([at], [value], "o", color="tab:green")
            bottom.annotate(f"{record.get('name', 'eval')} {value:.3f}", (at, value),
                            textcoords="offset points", xytext=(-6, 8) if at else (6, 8),
                            ha="right" if at else "left")  # step 0's label inside the frame
    if evals:
        bottom.plot([], [], "o", color="tab:green", label="held-out, speculative decoding")
    bottom.set_ylabel("acceptance length")
    bottom.set_xlabel("step")
    bottom.legend(loc="best")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"{out.name}: {steps[-1]} steps")
    fig.tight_layout()
    target = out / PLOT_FILE
    partial = out / f".{PLOT_FILE}.partial-{os.getpid()}"
    try:
        fig.savefig(partial, format="png", dpi=100)
        os.replace(partial, target)
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
    return target


def plot_or_warn(out: str | Path, warn: Callable[[str], None]) -> Path | None:
    """:func:`plot_run` at the end of a finished run: the picture is a by-product of
    ``metrics.jsonl``, so an OS error writing it (a full disk) is a warning through ``warn``
    naming the file, not the run's failure (its checkpoints and metrics are complete)."""
    try:
        return plot_run(out)
    except OSError as exc:
        warn(f"warning: {Path(out) / PLOT_FILE} not written ({exc.strerror or exc}); the "
             "run's checkpoints and metrics.jsonl are complete")
        return None
