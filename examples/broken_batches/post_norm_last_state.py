"""Broken batches: the last state taken after the final norm (HF ``hidden_states[-1]``), so
the drafter norms it twice. ``check-batches`` names it ``post-norm``."""

from __future__ import annotations

import torch
from _batches import main, read_folder, write_folder

from dflash_audit.data.verifier import load_verifier


def make(src, out, verifier="smollm2-135m"):
    v = load_verifier(verifier) if isinstance(verifier, str) else verifier
    norm = v.model.get_decoder().norm
    rows = read_folder(src)
    for _, t, _ in rows:
        pad = (t["document_ids"] < 0).unsqueeze(-1)
        with torch.inference_mode():
            normed = norm(t["verifier_last_hidden_states"])
        t["verifier_last_hidden_states"] = normed.masked_fill(pad, 0.0).clone()
    return write_folder(rows, out)


if __name__ == "__main__":
    main(make, __doc__)
