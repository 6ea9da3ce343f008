"""Broken batches: ``verifier_last_hidden_states`` taken two layers short of the last layer
(HF ``hidden_states[-3]`` instead of the last layer's pre-norm output).
``check-batches`` names it ``layer N-2``."""

from __future__ import annotations

from _batches import main, read_folder, write_folder

from dflash_audit.data.capture import capture_row
from dflash_audit.data.verifier import load_verifier


def make(src, out, verifier="smollm2-135m"):
    v = load_verifier(verifier) if isinstance(verifier, str) else verifier
    rows = read_folder(src)
    for _, t, _ in rows:
        short, _ = capture_row(v.model, t["input_ids"], t["document_ids"], [v.num_layers - 2])
        t["verifier_last_hidden_states"] = short
    return write_folder(rows, out)


if __name__ == "__main__":
    main(make, __doc__)
