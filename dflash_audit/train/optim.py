"""Optimizers and learning-rate schedules of a training run.

``adamw``: one ``torch.optim.AdamW`` over every trainable parameter.
``muon``: ``torch.optim.Muon`` over the 2-D weight matrices (both dims > 1, not an
embedding or output head) and ``AdamW`` over the rest (norms, biases) - the split the
reference's training CLI uses (speculators ``train/optimizers.py``; its CLI default).
Muon needs ``torch.optim.Muon`` (torch >= 2.9); without it ``muon`` raises a clear error.

Schedules: linear warmup from 0 to the base LR over ``warmup_steps``, then linear or
cosine decay to ``min_lr_ratio * base`` at ``total_steps`` (``constant`` keeps the base LR
after warmup). One ``LambdaLR`` per optimizer, so Muon's and AdamW's base LRs are
warmed up and decayed independently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant")
# 2-D parameters that stay on AdamW under Muon (embedding / vocabulary heads).
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head")


class OptimConfigError(ValueError):
    """An optimizer or schedule setting is invalid; the message names it."""


@dataclass(frozen=True)
class OptimSpec:
    """Optimizer and schedule hyperparameters.

    ``lr``: AdamW (base) learning rate; ``muon_lr``: Muon group LR (None = ``lr``);
    ``warmup_steps``/``total_steps``: optimizer steps; ``min_lr_ratio``: final LR as a
    fraction of the base LR.
    """

    optimizer: str = "adamw"
    lr: float = 6e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    muon_lr: float | None = None
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5
    muon_adjust_lr_fn: str = "match_rms_adamw"
    schedule: str = "cosine"
    warmup_steps: int = 20
    total_steps: int = 300
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # click reads "inf" / "nan" as floats
            values = getattr(self, f.name)
            for v in values if isinstance(values, tuple) else (values,):
                if isinstance(v, float) and not math.isfinite(v):
                    raise OptimConfigError(f"{f.name} must be a finite number, got {v}")
        if self.optimizer not in OPTIMIZERS:
            raise OptimConfigError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise OptimConfigError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not self.lr > 0:
            raise OptimConfigError(f"lr must be > 0, got {self.lr}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise OptimConfigError(f"total_steps must be >= 1 and warmup_steps >= 0, got "
                                   f"{self.total_steps} / {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise OptimConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.grad_clip > 0:
            raise OptimConfigError(f"grad_clip must be > 0, got {self.grad_clip}")


def muon_available() -> bool:
    """Whether this torch provides ``torch.optim.Muon``."""
    return hasattr(torch.optim, "Muon")


def split_for_muon(named: Iterable[tuple[str, nn.Parameter]]
                   ) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon group, AdamW group) of the trainable parameters: Muon takes 2-D matrices with
    both dimensions > 1 whose name has no embedding/head hint; AdamW takes the rest."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS):
            muon.append((name, p))
        else:
            adamw.append((name, p))
    return muon, adamw


def build_optimizers(model: nn.Module, spec: OptimSpec) -> list[torch.optim.Optimizer]:
    """The optimizer(s) over ``model``'s trainable parameters: ``[AdamW]`` or ``[Muon, AdamW]``.

    Raises:
        OptimConfigError: ``muon`` on a torch without ``torch.optim.Muon``, or no
            trainable parameter.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise OptimConfigError("the model has no trainable parameters")
    adamw_kw = dict(lr=spec.lr, weight_decay=spec.weight_decay, betas=spec.betas)
    if spec.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], **adamw_kw)]
    if not muon_available():
        raise OptimConfigError(
            f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this torch "
            f"{torch.__version__} has none. Use --optimizer adamw or upgrade torch.")
    muon, adamw = split_for_muon(named)
    optimizers: list[torch.optim.Optimizer] = []
    if muon:
        optimizers.append(torch.optim.Muon(
            [p for _, p in muon], lr=spec.muon_lr or spec.lr, momentum=spec.muon_momentum,
            weight_decay=spec.muon_weight_decay, ns_steps=spec.muon_ns_steps,
            adjust_lr_fn=spec.muon_adjust_lr_fn))
    if adamw:
        optimizers.append(torch.optim.AdamW([p for _, p in adamw], **adamw_kw))
    return optimizers


def lr_factor(spec: OptimSpec) -> Callable[[int], float]:
    """Multiplier of the base LR after ``step`` optimizer steps (``LambdaLR`` convention:
    factor(0) applies to the first step). Linear warmup ``(step+1)/warmup``, then decay."""
    warmup, total, floor = spec.warmup_steps, spec.total_steps, spec.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if spec.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if spec.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_schedulers(optimizers: list[torch.optim.Optimizer], spec: OptimSpec
                     ) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One ``LambdaLR`` per optimizer with :func:`lr_factor`."""
    return [torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(spec)) for opt in optimizers]
