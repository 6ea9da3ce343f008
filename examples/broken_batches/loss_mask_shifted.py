"""Broken batches: ``loss_mask`` shifted one token later (a labels-vs-inputs alignment slip).
``check-batches`` names it ``shift +1``."""

from __future__ import annotations

import torch
from _batches import main, read_folder, write_folder


def make(src, out, verifier=None):
    rows = read_folder(src)
    for _, t, _ in rows:
        lm = t["loss_mask"]
        t["loss_mask"] = torch.cat([lm.new_zeros(1, 1), lm[:, :-1]], dim=1)
        t["loss_mask"][t["document_ids"] < 0] = 0
    return write_folder(rows, out)


if __name__ == "__main__":
    main(make, __doc__)
