"""Broken batches: every hidden state captured in one forward over the whole packed row
(padding included) with a plain causal mask, so each document attends to the documents packed
before it (cross-document attention in the capture). The files' ``position_ids`` and
``document_ids`` stay correct; only the captured values are wrong. ``check-batches`` names it
``cross-document attention``.

``positions="continue"`` (the default) is ``model(input_ids=row)``: positions count on across
the row. ``positions="restart"`` passes the files' own ``position_ids`` (restarting per
document) with the tokenizer's all-ones ``attention_mask``: still one causal mask over the
row. The padding at the end is attended by nothing (a causal mask looks back only)."""

from __future__ import annotations

import json

import torch
from _batches import main, read_folder, write_folder

from dflash_audit.data.capture import LayerCapture
from dflash_audit.data.verifier import load_verifier


@torch.inference_mode()
def capture_packed(model, input_ids, position_ids, ids, positions="continue"):
    """``(hidden_states [1, T, n*H], last [1, T, H])`` of one causal forward over the row."""
    T = input_ids.shape[1]
    pos = torch.arange(T).unsqueeze(0) if positions == "continue" else position_ids
    hidden = int(model.get_input_embeddings().weight.shape[1])
    hs = torch.zeros(1, T, len(ids) * hidden)
    with LayerCapture(model, ids) as cap:
        model.get_decoder()(input_ids=input_ids, position_ids=pos, use_cache=False,
                            attention_mask=torch.ones(1, T, dtype=torch.long))
        for j, layer in enumerate(ids):
            plane = cap.captured["last" if layer == len(cap.layers) else layer]
            hs[0, :, j * hidden:(j + 1) * hidden] = plane[0]
        last = cap.captured["last"].float().clone()
    return hs, last


def make(src, out, verifier="smollm2-135m", positions="continue"):
    v = load_verifier(verifier) if isinstance(verifier, str) else verifier
    rows = read_folder(src)
    for _, t, meta in rows:
        t["hidden_states"], t["verifier_last_hidden_states"] = capture_packed(
            v.model, t["input_ids"], t["position_ids"], json.loads(meta["target_layer_ids"]),
            positions)
    return write_folder(rows, out)


if __name__ == "__main__":
    main(make, __doc__)
