"""Bug: one anchor fewer than there are valid positions (ModelOpt's count).

ModelOpt's ``_sample_anchor_positions`` draws ``min(num_anchors, valid_count - 1)`` anchors
(``hf_dflash.py``): where ``max_anchors`` does not bind, one valid position is left out of
every step. The reference draws ``min(max_anchors, valid_count)`` (speculators
``models/dflash/utils.py: select_anchors``).

Expected audit result: ``anchors`` fails with "one anchor fewer per draw than there are valid
positions".

Run: ``dflash-audit compare --candidate examples/candidates/anchor_one_fewer.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.anchors import select_anchors, valid_anchor_mask


class AnchorOneFewerCandidate(DrafterCandidate):
    name = "bug: one anchor fewer than there are valid positions"

    def select_anchors(self, loss_mask, max_anchors, block_size, generator, document_ids=None):
        count = min(max_anchors, int(valid_anchor_mask(loss_mask, block_size).sum()) - 1)
        positions, valid = select_anchors(loss_mask, max(count, 0), block_size, generator)
        pad = max_anchors - positions.numel()
        return (torch.cat([positions, positions.new_zeros(pad)]),
                torch.cat([valid, valid.new_zeros(pad)]))


candidate = AnchorOneFewerCandidate()
