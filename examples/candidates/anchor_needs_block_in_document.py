"""Bug: an anchor needs block_size - 1 further tokens of its own document.

A sampler that keeps every block inside its document admits an anchor a only where positions
a .. a + B - 1 all belong to a's document. The reference excludes only the last B positions of
the packed row (speculators ``models/dflash/utils.py: select_anchors``); a block that crosses
into the next document is trained on the slots the loss mask allows.

Expected audit result: ``anchors`` fails with "an anchor needs block_size-1 further tokens of
its own document".

Run: ``dflash-audit compare
--candidate examples/candidates/anchor_needs_block_in_document.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.anchors import select_anchors


class AnchorNeedsBlockInDocumentCandidate(DrafterCandidate):
    name = "bug: an anchor needs block_size - 1 further tokens of its own document"

    def select_anchors(self, loss_mask, max_anchors, block_size, generator, document_ids=None):
        doc = document_ids.reshape(1, -1)
        end = torch.cat([doc[:, block_size - 1:], torch.full_like(doc[:, :block_size - 1], -2)], 1)
        return select_anchors(loss_mask * (end == doc), max_anchors, block_size, generator)


candidate = AnchorNeedsBlockInDocumentCandidate()
