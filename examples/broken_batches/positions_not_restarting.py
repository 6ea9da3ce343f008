"""Broken batches: ``position_ids`` counting on across the packed documents instead of
restarting at 0 in each. ``check-batches`` names it ``positions continue``: a warning (a
per-document offset keeps every RoPE distance; a failure for a position-dependent rope_type)."""

from __future__ import annotations

import torch
from _batches import main, read_folder, write_folder


def make(src, out, verifier=None):
    rows = read_folder(src)
    for _, t, _ in rows:
        valid = t["document_ids"][0] >= 0
        t["position_ids"][0, valid] = torch.arange(int(valid.sum()))
    return write_folder(rows, out)


if __name__ == "__main__":
    main(make, __doc__)
