"""Anchor selection: where the draft blocks start.

Semantics of the reference (speculators ``models/dflash/utils.py: select_anchors``): the
valid anchors are the supervised positions (``loss_mask == 1``) with the last
``block_size`` positions of the packed row excluded; up to ``max_anchors`` are drawn
uniformly without replacement and sorted; the remaining slots are padding (position 0,
``anchor_valid`` False). Blocks may overlap.
"""

from __future__ import annotations

import torch


def valid_anchor_mask(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions that may start a block.

    Args:
        loss_mask: [1, T] (any dtype, 0/1).
        block_size: B >= 1.

    Returns:
        [T] bool: ``loss_mask == 1`` with the last B positions set False.

    Raises:
        ValueError: loss_mask is not [1, T], or block_size < 1.
    """
    if loss_mask.ndim != 2 or loss_mask.shape[0] != 1:
        raise ValueError(f"loss_mask must have shape [1, T], got {tuple(loss_mask.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    valid = loss_mask[0].bool().clone()
    valid[-block_size:] = False
    return valid


def select_anchors(
    loss_mask: torch.Tensor,
    max_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to ``max_anchors`` anchors uniformly without replacement, per packed row.

    Args:
        loss_mask: [1, T] 0/1.
        max_anchors: A, the number of anchor slots returned.
        block_size: B.
        generator: explicit RNG (``torch.Generator`` on loss_mask's device) so a run is
            reproducible; None uses the global RNG like the reference.
        document_ids: [1, T] packed-document ids (-1 padding), accepted for the sampler
            protocol and unused: like the reference (speculators 0.9.0), ``max_anchors`` is
            per packed row, not per document (the direction of speculators PR 1071).

    Returns:
        ``anchor_positions`` [A] int64 sorted ascending over the valid part (padding 0),
        ``anchor_valid`` [A] bool.
    """
    del document_ids  # per row, as the reference
    valid = valid_anchor_mask(loss_mask, block_size)
    candidates = valid.nonzero().squeeze(-1)  # [num_valid]
    k = min(max_anchors, candidates.numel())
    perm = torch.randperm(candidates.numel(), generator=generator, device=loss_mask.device)
    anchor_positions = torch.zeros(max_anchors, dtype=torch.long, device=loss_mask.device)
    anchor_valid = torch.zeros(max_anchors, dtype=torch.bool, device=loss_mask.device)
    anchor_positions[:k] = candidates[perm[:k]].sort().values
    anchor_valid[:k] = True
    return anchor_positions, anchor_valid


def check_anchors(
    anchor_positions: torch.Tensor,
    anchor_valid: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
) -> None:
    """Validate explicit (injected) anchors against a batch.

    Raises:
        ValueError: shapes differ, a valid anchor is not a valid anchor position, or
            an anchor is out of range. The message names the first bad anchor index.
    """
    if anchor_positions.ndim != 1 or anchor_positions.shape != anchor_valid.shape:
        raise ValueError(
            f"anchor_positions {tuple(anchor_positions.shape)} and anchor_valid "
            f"{tuple(anchor_valid.shape)} must both be [A]")
    T = loss_mask.shape[-1]
    if anchor_positions.numel() and (anchor_positions.min() < 0 or anchor_positions.max() >= T):
        raise ValueError(f"anchor positions must lie in [0, {T}), got "
                         f"[{int(anchor_positions.min())}, {int(anchor_positions.max())}]")
    allowed = valid_anchor_mask(loss_mask, block_size)
    bad = (anchor_valid.bool() & ~allowed[anchor_positions]).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise ValueError(
            f"anchor {j} at position {int(anchor_positions[j])} is marked valid but is not a "
            f"supervised position at least block_size={block_size} before the row end")
