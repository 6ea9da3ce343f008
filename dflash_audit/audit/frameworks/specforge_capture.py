"""Recording what SpecForge 0.2.0 computes inside ``OnlineDFlashModel.forward`` without
recomputing any of it: the attention masks its module-level builder returns, and the labels,
weight mask and per-slot loss weights its objective ``_dflash_objective_chunk_terms`` uses.

Runs INSIDE the candidate's process with ``specforge`` importable. File:line citations are to
``specforge==0.2.0`` (``specforge/algorithms/common/dflash_family_model.py`` = ``dfm``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dflash_audit.audit.frameworks.kit import record_locals

FULL, SLIDING = "full_attention", "sliding_attention"


@contextlib.contextmanager
def recorded_masks(module: Any, into: dict[str, torch.Tensor]) -> Iterator[None]:
    """Wrap ``module.create_dflash_sdpa_mask`` and ``module.create_dflash_block_mask`` (looked
    up by global name at call time, ``dfm:300-304``) for the duration of the block: each call's
    result is recorded into ``into[layer type]`` as a dense ``[Q, T+Q]`` bool (True = attend),
    the full-attention mask for a call without ``sliding_window``, the sliding one with it
    (``dfm:312-322``). A flex ``BlockMask`` is densified block by block (full blocks attend
    everywhere, partial blocks where SpecForge's own ``mask_mod`` allows), as the kernel reads
    it. Restores both builders on exit."""
    originals = {n: getattr(module, n) for n in (
        "create_dflash_sdpa_mask", "create_dflash_block_mask")}

    def wrap(build: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            mask = build(*args, **kwargs)
            kind = FULL if kwargs.get("sliding_window") is None else SLIDING
            into[kind] = dense_mask(mask)
            return mask
        return record

    try:
        for name, build in originals.items():
            setattr(module, name, wrap(build))
        yield
    finally:
        for name, build in originals.items():
            setattr(module, name, build)


def dense_mask(mask: Any) -> torch.Tensor:
    """[Q, KV] bool of SpecForge's dense bool mask [1, 1, Q, KV] (``dfm:47-88``) or of a flex
    ``BlockMask`` (``dfm:91-133``; row 0 of the batch).

    Raises:
        ValueError: the mask holds more than one row of a batch.
    """
    if not hasattr(mask, "mask_mod"):
        if mask.shape[0] != 1:
            raise ValueError(f"expected one row, SpecForge built a mask for {mask.shape[0]}")
        return mask.reshape(mask.shape[-2], mask.shape[-1]).bool().detach()
    from torch.nn.attention.flex_attention import create_mask

    q_len, kv_len = mask.seq_lengths
    qb, kb = mask.BLOCK_SIZE

    def blocks(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(idx.shape[-2], idx.shape[-1] + 1, dtype=torch.bool,
                          device=idx.device)
        cols = torch.where(torch.arange(idx.shape[-1], device=idx.device) < num[0, 0, :, None],
                           idx[0, 0], idx.shape[-1])
        out.scatter_(1, cols.long(), True)
        return out[:, :-1].repeat_interleave(qb, 0).repeat_interleave(kb, 1)[:q_len, :kv_len]

    partial = blocks(mask.kv_num_blocks, mask.kv_indices)
    full = (blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
            if mask.full_kv_num_blocks is not None else torch.zeros_like(partial))
    mod = create_mask(mask.mask_mod, 1, None, q_len, kv_len, device=partial.device)[0, 0]
    return (full | (partial & mod)).detach()


@contextlib.contextmanager
def recorded_objective(model: Any, into: dict[str, Any]) -> Iterator[None]:
    """Record what SpecForge's objective ``_dflash_objective_chunk_terms(hidden, target_ids,
    weight_mask)`` (``dfm:332-383``) receives and the per-slot weights it multiplies the
    cross-entropy with: ``into["target_ids"]`` [1, N, B] long (``dfm:406-416``),
    ``into["weight_mask"]`` [1, N, B] float (``dfm:418-432``), ``into["loss_weights"]``
    [1, N, B]: its local ``loss_weights`` for ``loss_type="dflash"`` (the weight mask, times
    ``exp(-(s-1).clamp(0)/gamma)`` when a gamma is set, ``dfm:350-360``) or
    ``weight_mask * dpace_weights`` for the D-PACE types (``dfm:363-371``), read from the
    function's own frame when it returns (a profile hook on its code object), never
    recomputed. Needs ``objective_chunk_blocks=0`` (one call over all blocks); a second call
    raises ``RuntimeError``. Restores the method on exit."""
    function = type(model)._dflash_objective_chunk_terms

    def record(hidden: torch.Tensor, target_ids: torch.Tensor, weight_mask: torch.Tensor):
        if "target_ids" in into:
            raise RuntimeError("SpecForge's objective ran more than once: the adapter needs "
                               "objective_chunk_blocks=0")
        into["target_ids"] = target_ids.detach().clone()
        into["weight_mask"] = weight_mask.detach().clone()
        with record_locals(function, ("loss_weights", "dpace_weights", "weight_mask")) as ret:
            out = function(model, hidden, target_ids, weight_mask)
        local = ret[-1]
        if "loss_weights" in local:
            into["loss_weights"] = local["loss_weights"].detach().clone()
        elif "dpace_weights" in local:
            into["loss_weights"] = (local["weight_mask"] * local["dpace_weights"]).detach()
        return out

    model._dflash_objective_chunk_terms = record
    try:
        yield
    finally:
        del model._dflash_objective_chunk_terms
