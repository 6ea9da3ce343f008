"""Bug: anchors admitted at T - block_size (``a <= T - B``, ModelOpt's rule).

ModelOpt's ``_sample_anchor_positions`` admits ``a <= T - B`` (``max_anchor = T - B``,
``hf_dflash.py``); the block of an anchor at T - B ends at T - 1, inside the row. The reference
excludes the last B positions, T - B included (``valid_mask[:, -block_size:] = False``,
speculators ``models/dflash/utils.py: select_anchors``).

Expected audit result: ``anchors`` fails with "anchors admitted at T-B"; where the case's
loss_mask is set at T - B.

Run: ``dflash-audit compare --candidate examples/candidates/anchor_at_t_minus_b.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.anchors import select_anchors


class AnchorAtTMinusBCandidate(DrafterCandidate):
    name = "bug: anchors admitted at T - block_size"

    def select_anchors(self, loss_mask, max_anchors, block_size, generator, document_ids=None):
        # one position more: select_anchors then excludes T+1-B.. only, admitting T-B
        longer = torch.cat([loss_mask, torch.zeros_like(loss_mask[:, :1])], 1)
        return select_anchors(longer, max_anchors, block_size, generator)


candidate = AnchorAtTMinusBCandidate()
