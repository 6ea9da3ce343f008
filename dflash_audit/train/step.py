"""One optimizer step, independent of which model computes the loss.

:func:`train_step` only needs a *forward function* ``forward(inputs) -> (loss, metrics)``:
our drafter (:func:`drafter_forward`) and the reference's ``DFlashDraftModel`` (driven by
``benchmarks/bench_trajectory.py`` in the reference's own process) run through the same
step: zero grads, forward + backward per micro-batch (loss divided by their count),
gradient clipping, optimizer steps, scheduler steps.

This module imports only torch (and, lazily, our loss/metrics for :func:`drafter_forward`),
so the reference process can import it without pulling in the rest of dflash-audit.

``inputs`` of one micro-batch (reference tensor names, T packed length, A anchors):
``hidden_states`` [1,T,n*H], ``verifier_last_hidden_states`` [1,T,H], ``input_ids``,
``loss_mask``, ``position_ids``, ``document_ids`` [1,T], ``anchor_positions`` [A] int64,
``anchor_valid`` [A] bool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

ForwardFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]

MODEL_INPUTS = ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
                "document_ids", "position_ids", "anchor_positions", "anchor_valid")


@dataclass
class StepResult:
    """What one step did. ``loss``: mean over micro-batches (fp32 float); ``metrics``: raw
    ``*_sum`` / ``*_total`` pairs summed over micro-batches; ``grad_norm``: total L2 norm
    before clipping; ``lrs``: LR of each optimizer's first group used for this step."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    grad_norm: float = float("nan")
    lrs: list[float] = field(default_factory=list)


def autocast_context(device: torch.device | str):
    """bf16 autocast on CUDA, nothing (fp32) elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    forward: ForwardFn,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    parameters: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler] = (),
    grad_clip: float | None = 1.0,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    device: torch.device | str = "cpu",
) -> StepResult:
    """Run one optimizer step over ``micro_batches`` (gradient accumulation).

    Args:
        forward: inputs -> (scalar loss with grad, metrics dict of floats).
        micro_batches: one dict of tensors per packed row (see module docstring).
        parameters: the trainable parameters (for clipping).
        optimizers, schedulers: stepped once each, in order.
        grad_clip: max total gradient L2 norm (None: no clipping).
        no_sync: DDP's ``model.no_sync`` (or :func:`dflash_audit.train.fsdp.no_gradient_sync`)
            so only the last micro-batch reduces gradients across ranks.
        device: where the forward runs (bf16 autocast on CUDA).

    Returns:
        :class:`StepResult`.

    Raises:
        ValueError: no micro-batch, or a non-finite loss (the step is not applied).
    """
    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch")
    lrs = [float(opt.param_groups[0]["lr"]) for opt in optimizers]
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    n = len(micro_batches)
    total_loss = 0.0
    metrics: dict[str, float] = {}
    for i, inputs in enumerate(micro_batches):
        sync = contextlib.nullcontext() if (no_sync is None or i == n - 1) else no_sync()
        with sync:
            with autocast_context(device):
                loss, m = forward(inputs)
            if not torch.isfinite(loss.detach()):
                raise ValueError(f"non-finite loss {float(loss.detach())} on micro-batch {i}; "
                                 "the step was not applied")
            (loss / n).backward()
        total_loss += float(loss.detach()) / n
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    if grad_clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), grad_clip)
    else:
        grads = [p.grad.detach().norm() for p in parameters if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else torch.zeros(())
    # FSDP: the norm of sharded (DTensor) gradients is a DTensor; its value is the full one
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    for opt in optimizers:
        opt.step()
    for sched in schedulers:
        sched.step()
    return StepResult(loss=total_loss, metrics=metrics, grad_norm=grad_norm, lrs=lrs)


def drafter_forward(model: torch.nn.Module, loss_spec, block_size: int,
                    sample_from_anchor: bool = False) -> ForwardFn:
    """The forward function of a :class:`~dflash_audit.model.drafter.DFlashDrafter` (or a
    DDP wrapper of one): the drafter's forward, :func:`~dflash_audit.model.loss.dflash_loss`
    under ``loss_spec`` and :func:`~dflash_audit.model.metrics.dflash_metrics`."""
    from dflash_audit.model.loss import dflash_loss
    from dflash_audit.model.metrics import dflash_metrics

    def forward(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        out = model(**{k: inputs[k] for k in MODEL_INPUTS})
        result = dflash_loss(out.logits, out.targets, out.aligned_loss_mask, block_size,
                             loss_spec, sample_from_anchor)
        metrics = dflash_metrics(out.logits, out.targets, out.aligned_loss_mask, block_size,
                                 sample_from_anchor)
        metrics["loss_sum"], metrics["loss_total"] = float(result.loss.detach()), 1.0
        return result.loss, metrics

    return forward
