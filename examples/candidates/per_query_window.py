"""Bug: the sliding window measured from each query's own position (the inference-time rule).

At inference a query at position p sees the keys with ``p - kv < W``. SpecForge
(``create_dflash_sdpa_mask``), ModelOpt (``_build_draft_attention_mask``) and z-lab
(``_attention_mask``) apply that rule in training too: slot s of the block of anchor a sees
``kv >= a + s - W + 1``, i.e. W-1-s context tokens before the anchor. The reference bounds every
slot of the block alike, ``kv >= a - W`` (speculators ``models/dflash/attention.py``).

Expected audit result: ``mask`` fails for the sliding layer type with the diagnosis "sliding
window measured from the query's own position: kv >= a + s - W + 1"; ``logits`` follows from
the mask difference; full-attention masks pass.

Run: ``dflash-audit compare --candidate examples/candidates/per_query_window.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.config import SLIDING_ATTENTION
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.mask import dense_mask


def window_from_query(mask, document_ids, anchor_positions, block_size, window):
    """[Q, T+Q] bool mask -> the same with its context part bounded by ``a + s - kv < W`` (s
    the query's slot) instead of ``kv >= a - W``; the block part unchanged."""
    Q = mask.shape[0]
    T = mask.shape[1] - Q
    a = anchor_positions.long().repeat_interleave(block_size)[:, None]
    s = (torch.arange(Q) % block_size)[:, None]
    kv = torch.arange(T)[None, :]
    unbounded = dense_mask(document_ids, anchor_positions, block_size, None)[:, :T]
    return torch.cat([unbounded & (kv >= a + s - window + 1), mask[:, T:]], 1)


class PerQueryWindowDrafter(DFlashDrafter):
    """Our drafter with the per-query window in its sliding layers."""

    def attention_masks(self, document_ids, anchor_positions):
        masks = super().attention_masks(document_ids, anchor_positions)
        c = self.config
        if SLIDING_ATTENTION in masks:
            masks[SLIDING_ATTENTION] = window_from_query(
                masks[SLIDING_ATTENTION], document_ids, anchor_positions, c.block_size,
                c.sliding_window)
        return masks


class PerQueryWindowCandidate(DrafterCandidate):
    name = "bug: sliding window measured from the query's own position"

    def build(self, config):
        return PerQueryWindowDrafter(config)


candidate = PerQueryWindowCandidate()
