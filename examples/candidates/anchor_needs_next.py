"""Bug: an anchor also needs ``loss_mask[a+1]`` (SpecForge's anchor rule).

SpecForge's ``_sample_anchor_positions`` admits an anchor a only where ``loss_mask[a]`` and
``loss_mask[a+1]`` are both set (``dflash_family_model.py``): the last supervised token before
an unsupervised one (e.g. the end-of-turn token of each assistant reply) is never an anchor.
The reference admits every supervised position a < T - block_size (speculators
``models/dflash/utils.py: select_anchors``).

Expected audit result: ``anchors`` fails with "an anchor also needs loss_mask[a+1]".

Run: ``dflash-audit compare --candidate examples/candidates/anchor_needs_next.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.anchors import select_anchors


class AnchorNeedsNextCandidate(DrafterCandidate):
    name = "bug: an anchor also needs loss_mask[a+1]"

    def select_anchors(self, loss_mask, max_anchors, block_size, generator, document_ids=None):
        next_supervised = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], 1)
        return select_anchors(loss_mask * next_supervised, max_anchors, block_size, generator)


candidate = AnchorNeedsNextCandidate()
