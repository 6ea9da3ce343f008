"""Bug: a packed row treated as one sequence: positions 0..T-1 and no same-document rule.

SpecForge and ModelOpt train on one conversation per row: context positions are
``arange(T)``, slot s of anchor a sits at ``a + s``, and the mask has no document condition.
Fed a packed row of several documents, a query then attends the context of earlier documents,
at positions that do not restart per document. The reference restarts ``position_ids`` at 0 per
document and masks other documents out (speculators ``models/dflash/attention.py``, ``core.py``).
Two causes at once: either alone does not reproduce what this drafter computes.

Expected audit result: ``mask`` fails for every layer type with "cross-document leakage";
``logits`` names the positions ("position ids: context not restarting per document (0..T-1),
noise block a+s") and follows from the mask difference together with them.

Run: ``dflash-audit compare --candidate examples/candidates/packed_positions.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter


class PackedPositionsDrafter(DFlashDrafter):
    """Our drafter that sees one document per row: positions arange(T), one document id."""

    def attention_masks(self, document_ids, anchor_positions):
        one_document = torch.where(document_ids != -1, 0, -1)
        return super().attention_masks(one_document, anchor_positions)

    def forward(self, **inputs):
        T = inputs["position_ids"].shape[-1]
        inputs["position_ids"] = torch.arange(T, device=inputs["position_ids"].device)[None]
        return super().forward(**inputs)


class PackedPositionsCandidate(DrafterCandidate):
    name = "bug: packed row as one sequence (positions 0..T-1, no document rule)"

    def build(self, config):
        return PackedPositionsDrafter(config)


candidate = PackedPositionsCandidate()
