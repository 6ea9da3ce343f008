"""Broken batches: a z-lab drafter's ``target_layer_ids`` given to a speculators-convention
capture (z-lab id k means HF ``hidden_states[k+1]``; the capture took ``hidden_states[k]``).
Writes the z-lab drafter's ``drafter_config.json`` beside the batches; ``check-batches
--drafter-config OUT/drafter_config.json`` (or ``--profile zlab``) names it
``zlab ids read as speculators ids``."""

from __future__ import annotations

import json
from pathlib import Path

from _batches import main, read_folder, set_meta, write_folder

from dflash_audit.data.capture import capture_row
from dflash_audit.data.verifier import load_verifier
from dflash_audit.model.config import default_target_layer_ids


def make(src, out, verifier="smollm2-135m"):
    v = load_verifier(verifier) if isinstance(verifier, str) else verifier
    zlab = [i - 1 for i in default_target_layer_ids(v.num_layers, "zlab")]  # z-lab's own ids
    rows = read_folder(src)
    mask_token_id = None
    for _, t, meta in rows:
        t["hidden_states"], _ = capture_row(v.model, t["input_ids"], t["document_ids"], zlab)
        set_meta(meta, "target_layer_ids", zlab)
        mask_token_id = json.loads(meta["mask_token_id"])
    folder = write_folder(rows, out)
    config = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 5,
              "dflash_config": {"target_layer_ids": zlab, "mask_token_id": mask_token_id}}
    (Path(folder) / "drafter_config.json").write_text(json.dumps(config, indent=2))
    return folder


if __name__ == "__main__":
    main(make, __doc__)
