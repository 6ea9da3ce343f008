"""Bug: a correct boolean attention mask added to the scores as numbers.

The candidate builds the right masks (the ``mask`` check passes), but its attention passes
``mask.float()`` to scaled-dot-product attention, which adds a float mask to the scores: True
becomes +1, False 0, and nothing is masked. Every query sees the whole context and block.

Expected audit result: every ``mask`` passes; ``logits`` fails with the diagnosis "attention
ignores the mask: the boolean mask is added to the scores"; ``loss`` / ``gradients`` fail as
consequences.

Run: ``dflash-audit compare --candidate examples/candidates/bool_mask_added.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.layers import DraftAttention


class BoolMaskAddedAttention(DraftAttention):
    """Our draft attention, handed the boolean mask as a float (additive) mask."""

    def forward(self, x, context, cos, sin, mask):
        if isinstance(mask, torch.Tensor):
            mask = mask.float()  # the bug: True -> +1 added to the scores, nothing masked
        return super().forward(x, context, cos, sin, mask)


class BoolMaskAddedCandidate(DrafterCandidate):
    name = "bug: boolean attention mask added to the scores"

    def build(self, config):
        model = DFlashDrafter(config)
        for layer in model.layers:
            layer.self_attn.__class__ = BoolMaskAddedAttention
        return model


candidate = BoolMaskAddedCandidate()
