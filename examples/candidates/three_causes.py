"""Three bugs at once, as a SpecForge-style training step makes them on a packed row.

1. the sliding window measured from each query's own position (``kv >= a + s - W + 1``, the
   inference-time rule) instead of the reference's ``kv >= a - W`` for every slot of the block;
2. the row treated as one sequence: positions 0..T-1 that do not restart per document, and no
   same-document rule in the masks;
3. the loss divided by the sum of the per-slot weights, ``sum(l*m*w) / sum(m*w)``, instead of
   the number of supervised tokens (speculators ``losses/utils.py``: ``sum(m) + 1e-5``).

Expected audit result: ``mask`` names (1) and the cross-document leakage of (2) for the sliding
layer type and the leakage for the full-attention one; ``logits`` names the positions of (2)
and follows from the mask difference together with them; ``loss`` names (3); nothing
"unexplained".

Run: ``dflash-audit compare --candidate examples/candidates/three_causes.py:candidate``
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch

import dflash_audit.candidate as candidate_module
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.config import SLIDING_ATTENTION
from dflash_audit.model.loss import LOSSES, parse_loss


def _sibling(name):
    """Another example of this folder, by file name (the folder is not a package)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"dflash_audit_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


packed = _sibling("packed_positions")
per_query = _sibling("per_query_window")


def over_weight_sum(dflash_loss):
    """``dflash_loss`` whose total divides by sum(m*w) (SpecForge ``dflash_family_model.py``
    ``_dflash_objective_chunk_terms``) instead of sum(m) + 1e-5."""
    def loss(logits, targets, aligned_loss_mask, block_size, spec, sample_from_anchor=False,
             target_ids=None):
        result = dflash_loss(logits, targets, aligned_loss_mask, block_size, spec,
                             sample_from_anchor)
        m = aligned_loss_mask.float()
        total = 0.0
        for name, coef in parse_loss(spec.loss).items():
            w = result.weights[name]
            total = total + coef * (LOSSES[name](logits, targets) * m * w).sum() / (m * w).sum()
        result.loss = total
        return result
    return loss


@contextlib.contextmanager
def patched(module, name, make):
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)


class ThreeCausesDrafter(packed.PackedPositionsDrafter):
    """Packed positions and no document rule, plus the per-query window in sliding layers."""

    def attention_masks(self, document_ids, anchor_positions):
        masks = super().attention_masks(document_ids, anchor_positions)
        c = self.config
        if SLIDING_ATTENTION in masks:
            one_document = torch.where(document_ids != -1, 0, -1)
            masks[SLIDING_ATTENTION] = per_query.window_from_query(
                masks[SLIDING_ATTENTION], one_document, anchor_positions, c.block_size,
                c.sliding_window)
        return masks


class ThreeCausesCandidate(DrafterCandidate):
    name = "bugs: per-query window + packed positions + loss over the sum of weights"

    def build(self, config):
        return ThreeCausesDrafter(config)

    def run_case(self, config, loss, weights, inputs):
        with patched(candidate_module, "dflash_loss", over_weight_sum):
            return super().run_case(config, loss, weights, inputs)


candidate = ThreeCausesCandidate()
