"""Bug: the context rule written ``kv_base_pos <= q_anchor`` where the reference has ``<``.

Every draft query also sees the context at its own anchor position, i.e. the verifier's
hidden state of the token the block starts from (in every layer type).

Expected audit result: ``mask`` fails for every layer type with the diagnosis "context rule
kv <= anchor (reference: kv < anchor)"; ``logits`` fails with the diagnosis that the mask
difference explains it; ``loss`` / ``gradients`` fail as consequences.

Run: ``dflash-audit compare --candidate examples/candidates/context_rule_le.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter


def allow_anchor_position(mask, document_ids, anchor_positions, block_size):
    """[Q, T+Q] bool mask -> the same with kv == anchor allowed (``<=``), padding excluded."""
    mask = mask.clone()
    q = torch.arange(mask.shape[0])
    a = anchor_positions.long().repeat_interleave(block_size)
    mask[q, a] |= document_ids.reshape(-1)[a] != -1
    return mask


class ContextRuleLeDrafter(DFlashDrafter):
    """Our drafter with ``kv <= anchor`` in the context part of every mask."""

    def attention_masks(self, document_ids, anchor_positions):
        masks = super().attention_masks(document_ids, anchor_positions)
        return {k: allow_anchor_position(m, document_ids, anchor_positions,
                                         self.config.block_size) for k, m in masks.items()}


class ContextRuleLeCandidate(DrafterCandidate):
    name = "bug: context rule kv <= anchor"

    def build(self, config):
        return ContextRuleLeDrafter(config)


candidate = ContextRuleLeCandidate()
