"""FSDP2 for drafters larger than one GPU: ``fully_shard`` per draft layer, then the model,
with the reference's mixed precision (speculators ``train/distributed.py``
``apply_fully_sharded``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``),
and full (unsharded) model / optimizer state dicts for checkpoints and exact resume.

Needs an initialised process group (``torchrun``: gloo on CPU, NCCL on CUDA). Frozen
verifier-owned weights (``requires_grad=False``) are sharded with the rest and skipped by the
optimizers. Build the optimizers after :func:`shard_drafter`. Used by ``dflash-audit train
--fsdp`` (:func:`dflash_audit.train.loop.train`; tested on CPU with gloo in
``tests/test_train_fsdp.py``, on a GPU in ``tests/test_cuda.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def shard_drafter(model: nn.Module, param_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each ``model.layers[i]`` and then to ``model``.

    Args:
        model: a drafter with a ``layers`` ModuleList (fp32 master weights, on its device).
        param_dtype: the dtype parameters are gathered in for compute (bf16 as the reference;
            gradients are reduced in fp32).

    Returns:
        The same module, now an ``FSDPModule`` (parameters are DTensors).

    Raises:
        RuntimeError: no initialised process group.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch.distributed.is_initialized():
        raise RuntimeError("shard_drafter needs an initialised process group (run under torchrun)")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype :func:`shard_drafter` gathers parameters in: bf16 on CUDA (the reference's
    policy), fp32 elsewhere (CPU training is fp32 throughout)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation under FSDP2: backward passes inside keep their (unsharded)
    gradients local instead of reduce-scattering them; the next backward outside reduces the
    sum (``FSDPModule.set_requires_gradient_sync``; DDP's ``no_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (CPU tensors; complete on rank 0) of a sharded model, in the
    unsharded model's key names: what a checkpoint saves."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded optimizer state (keyed by parameter names) for an exact resume."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options())


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    model_state: dict[str, torch.Tensor] | None,
                    optimizer_state: dict[str, Any] | None = None) -> None:
    """Load full state dicts (as saved by :func:`full_model_state` /
    :func:`full_optimizer_state`) into a sharded model and its optimizer; every rank passes
    the full dicts (``None``: that part is left as it is)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    if model_state is not None:
        set_model_state_dict(model, model_state, options=options)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


class ShardedDrafter:
    """A drafter sharded in place by :func:`shard_drafter` for ``train --fsdp``, with an
    unsharded CPU copy on rank 0 that checkpoints are written from and evaluation runs on.

    Args:
        model: the drafter train trains (on CPU, weights final for step 0 or the resume);
            sharded in place, its shards moved to ``device`` (CUDA) by ``fully_shard``.
        device: the rank's device (bf16 compute on CUDA, fp32 on CPU: :func:`compute_dtype`).
        keep_copy: keep the unsharded copy (rank 0).
    """

    def __init__(self, model: nn.Module, device: torch.device, keep_copy: bool) -> None:
        import copy

        self.model = model
        self.copy = copy.deepcopy(model) if keep_copy else None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shard_drafter(model, compute_dtype(device))

    def unsharded(self) -> nn.Module | None:
        """The copy holding the sharded model's current weights (a collective: every rank
        calls it; rank 0 gets the copy, the others None)."""
        state = full_model_state(self.model)
        if self.copy is None:
            return None
        self.copy.load_state_dict(state)
        return self.copy
