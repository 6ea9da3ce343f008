"""Bug: causal attention inside the block of a full-attention layer.

The reference's full-attention draft layers are bidirectional inside a block (every slot
sees every other slot of its block); this candidate makes them causal (slot s sees slots <= s),
as a sliding layer without ``sliding_window_non_causal`` would.

Expected audit result: ``mask`` fails for ``full_attention`` with the diagnosis "causal
attention inside the block (reference: bidirectional)"; a sliding layer's mask passes;
``logits`` / ``loss`` / ``gradients`` fail as consequences.

Run: ``dflash-audit compare --candidate examples/candidates/causal_block.py:candidate``
"""

from __future__ import annotations

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.config import FULL_ATTENTION
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.mask import dense_mask

NO_WINDOW = 1 << 62  # a "sliding window" wider than any row: causal block, no window bound


class CausalBlockDrafter(DFlashDrafter):
    """Our drafter whose full-attention mask is causal inside the block."""

    def attention_masks(self, document_ids, anchor_positions):
        masks = super().attention_masks(document_ids, anchor_positions)
        if FULL_ATTENTION in masks:
            masks[FULL_ATTENTION] = dense_mask(document_ids, anchor_positions,
                                               self.config.block_size, sliding_window=NO_WINDOW)
        return masks


class CausalBlockCandidate(DrafterCandidate):
    name = "bug: causal block in a full-attention layer"

    def build(self, config):
        return CausalBlockDrafter(config)


candidate = CausalBlockCandidate()
