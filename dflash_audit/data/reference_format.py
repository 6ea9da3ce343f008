"""Write batches in the reference's offline training format, so speculators can train on
exactly the same data.

speculators 0.9.0 reads offline data as (``train/data.py: ArrowDataset`` with
``hs_connectors.FileTransfer``):

- ``<dir>/``: a ``datasets`` Arrow dataset (``save_to_disk``, torch format) with columns
  ``input_ids`` (int64 [len]), ``loss_mask`` (int64 [len]) and ``seq_len`` (int), one row per
  conversation (unpacked; its collator packs them);
- ``<dir>/hidden_states/hs_{i}.safetensors`` for row i: ``hidden_states``
  [len, n+1, H] (the n target layers in ascending id, then the last layer's pre-norm
  output) and ``token_ids`` int64 [len], which must equal the row's ``input_ids``.

The reader takes ``hidden_states[:, :-1].flatten(1)`` as its ``hidden_states`` and
``hidden_states[:, -1]`` as ``verifier_last_hidden_states``, so our packed rows split back
into documents reproduce its samples exactly. Here the hidden states are stored in float32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_audit.atomic import save_safetensors
from dflash_audit.data.batch import Batch
from dflash_audit.data.errors import DataError

HIDDEN_STATES_DIR = "hidden_states"
INFO_FILE = "dflash_audit_reference_format.json"


def split_documents(batch: Batch) -> list[dict[str, torch.Tensor]]:
    """The documents of a packed batch as reference offline samples.

    Returns:
        One dict per document with ``token_ids`` int64 [len], ``loss_mask`` int64 [len] and
        ``hidden_states`` float32 [len, n+1, H].
    """
    H = batch.hidden_size
    n = len(batch.target_layer_ids)
    docs = batch.document_ids[0]
    samples = []
    for k in range(batch.num_documents):
        pos = (docs == k).nonzero().flatten()
        s, e = int(pos[0]), int(pos[-1]) + 1
        layers = batch.hidden_states[0, s:e].reshape(e - s, n, H)
        last = batch.verifier_last_hidden_states[0, s:e].unsqueeze(1)
        samples.append({
            "token_ids": batch.input_ids[0, s:e].clone(),
            "loss_mask": batch.loss_mask[0, s:e].clone(),
            "hidden_states": torch.cat([layers, last], dim=1).contiguous(),
        })
    return samples


def write_reference_offline(batches: Sequence[Batch], out_dir: str | Path) -> Path:
    """Write every document of ``batches`` in the reference's offline format into ``out_dir``.

    Also writes ``dflash_audit_reference_format.json`` (verifier, target_layer_ids,
    mask_token_id) so the matching speculators options can be set.

    Returns:
        ``out_dir``.

    Raises:
        DataError: ``datasets`` is not installed.
    """
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - declared dependency
        raise DataError("--reference-format needs the 'datasets' package. "
                        "Fix: pip install 'datasets>=4,<=5.1'") from exc
    out_dir = Path(out_dir)
    samples = [s for b in batches for s in split_documents(b)]
    columns = {"input_ids": [s["token_ids"].tolist() for s in samples],
               "loss_mask": [s["loss_mask"].tolist() for s in samples],
               "seq_len": [int(s["token_ids"].numel()) for s in samples]}
    dataset = datasets.Dataset.from_dict(columns)
    dataset.set_format(type="torch")
    out_dir.mkdir(parents=True, exist_ok=True)
    datasets.disable_progress_bars()
    try:
        dataset.save_to_disk(str(out_dir))
    finally:
        datasets.enable_progress_bars()
    hs_dir = out_dir / HIDDEN_STATES_DIR
    hs_dir.mkdir(exist_ok=True)
    for i, s in enumerate(samples):
        save_safetensors({"hidden_states": s["hidden_states"], "token_ids": s["token_ids"]},
                         hs_dir / f"hs_{i}.safetensors")
    first = batches[0].metadata if batches else {}
    info = {k: first.get(k) for k in ("verifier", "target_layer_ids", "layer_id_convention",
                                      "mask_token_id", "mask_token_reason", "tokenizer")}
    info["num_samples"] = len(samples)
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return out_dir
