"""What a checkpoint was trained as: the reference's own reading of it (``reference/
serve_probe.py`` in the reference's process) and our drafter's (:mod:`dflash_audit.model`),
each as a :class:`~dflash_audit.serve.fields.SideRecord` with the training mask of one block
per layer."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_audit.serve.checkpoint import SPECULATORS, CheckpointFolder
from dflash_audit.serve.engines import PROBE_TIMEOUT_ENV, ServeCheckError, probe_timeout
from dflash_audit.serve.fields import MASK_EMBEDDING_ROW, SideRecord, layer_key

OURS = "dflash-audit drafter"
CONFIG = "dflash_audit/model/checkpoint.py:config_from_reference"


def probe_block(block_size: int, window: int | None) -> tuple[int, int]:
    """``(anchor, T)`` of the one-block row every side's mask is built on: the anchor far
    enough from the row's start that a window ``W`` and every slot's shift fit before it."""
    anchor = int(window or 0) + 2 * block_size + 8
    return anchor, anchor + block_size + 1


def ours(folder: CheckpointFolder) -> SideRecord:
    """Our drafter's reading of a speculators-format checkpoint (``config_from_reference``,
    the loader ``dflash-audit train`` and ``eval`` use) and the masks ``model/mask.py`` builds.

    Raises:
        ServeCheckError: our loader refuses the config (the message names the field).
    """
    from dflash_audit.model.checkpoint import CheckpointError, config_from_reference
    from dflash_audit.model.config import ConfigError
    from dflash_audit.model.mask import dense_mask

    record = SideRecord(OURS)
    if folder.format != SPECULATORS:
        record.refused = "not a speculators-format checkpoint (our drafter reads only those)"
        return record
    ids = folder.config.get("aux_hidden_state_layer_ids") or [1]
    try:
        c = config_from_reference(folder.config, max(max(int(i) for i in ids), 1))
    except (CheckpointError, ConfigError, AttributeError, KeyError, TypeError,
            ValueError) as exc:
        record.refused = f"{type(exc).__name__}: {exc}"
        return record
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "num_hidden_layers", "rms_norm_eps", "hidden_act"):
        record.set(key, getattr(c, key), CONFIG)
    for i in range(c.num_hidden_layers):
        window = c.sliding_window if c.is_sliding(i) else None
        record.set(layer_key(i, "attention"), "sliding" if window else "full", CONFIG)
        record.set(layer_key(i, "sliding_window"), window, CONFIG)
        anchor, T = probe_block(c.block_size, c.sliding_window)
        rows = dense_mask(torch.zeros(T, dtype=torch.long), torch.tensor([anchor]),
                          c.block_size, window, c.sliding_window_non_causal)
        record.masks[str(i)] = {"anchor": anchor, "total_seq_len": T,
                                "rows": rows.reshape(c.block_size, -1).int().tolist(),
                                "source": "dflash_audit/model/mask.py:dense_mask"}
    rope = dict(c.rope_parameters or {})
    record.set("rope.type", rope.get("rope_type", "default"), CONFIG)
    record.set("rope.theta", float(c.rope_theta), CONFIG)
    record.set("rope.scaling", {k: v for k, v in rope.items()
                                if k not in ("rope_type", "rope_theta", "partial_rotary_factor")}
               or None, CONFIG)
    from dflash_audit.model.layers import RotaryEmbedding

    record.set("rope.rotary_dim", 2 * int(RotaryEmbedding(c).inv_freq.numel()),
               "dflash_audit/model/layers.py:RotaryEmbedding")
    record.set("rope.neox_style", True, "dflash_audit/model/layers.py (rotate_half)")
    record.set("rope.max_positions", None, "dflash_audit/model/layers.py (no table)")
    record.set("norm.one_plus_weight", False, "dflash_audit/model/layers.py:RMSNorm (x * w)")
    record.set("target_layer_ids", list(c.target_layer_ids), CONFIG)
    fc = folder.weights.get("fc.weight")
    record.set("fc.in_features", fc[-1] if fc else c.num_target_layers * c.hidden_size,
               "model.safetensors fc.weight" if fc else CONFIG)
    record.set("mask_token_id", c.mask_token_id, CONFIG)
    record.set("block_size", c.block_size, CONFIG)
    record.set("sample_from_anchor", c.sample_from_anchor, CONFIG)
    record.set("num_speculative_tokens",
               c.block_size if c.sample_from_anchor else c.block_size - 1, CONFIG)
    record.set("draft_vocab_size", c.effective_draft_vocab_size, CONFIG)
    record.set("draft_vocab.mapping", "d2t offsets" if c.uses_draft_vocab else "none", CONFIG)
    record.set("lm_head.source", "checkpoint" if "lm_head.weight" in folder.weights else
               "target", "model.safetensors (lm_head.weight saved only with a draft vocabulary)")
    record.set("embed_tokens.source", "checkpoint" if "embed_tokens.weight" in folder.weights
               else "target", "dflash_audit/model/verifier_weights.py:load_verifier_weights")
    record.set("mask_embedding.source", MASK_EMBEDDING_ROW, "dflash_audit/model/drafter.py "
               "(mask slots: embed_tokens(mask_token_id); no mask_embedding.pt is read)")
    dtype = folder.config.get("dtype") or folder.config.get("torch_dtype")
    if isinstance(dtype, str):
        record.set("dtype", dtype.removeprefix("torch."), "config.json dtype (the weights' "
                   "training precision as saved)")
    return record


def reference(folder: CheckpointFolder, ref: str | None = None, offline: bool = False,
              timeout_s: float | None = None, cache: bool = True) -> SideRecord:
    """The reference's reading of the checkpoint: ``reference/serve_probe.py`` run in the
    reference's process (the pinned release unless ``ref``), or, with ``cache``, its
    verified record of an earlier run on the same config and reference
    (:mod:`dflash_audit.serve.reference_record`; then a note says so); ``cache`` False
    runs the probe and replaces the record.

    Raises:
        ServeCheckError: the reference cannot be resolved or its process failed.
    """
    from dflash_audit.reference_source.identity import ReferenceSourceError
    from dflash_audit.reference_source.runner import ReferenceTimeoutError
    from dflash_audit.reference_source.spec import resolve_reference

    if folder.format != SPECULATORS:
        return SideRecord("reference", refused="not a speculators-format checkpoint: the "
                          "reference loads only those")
    timeout_s = probe_timeout() if timeout_s is None else timeout_s
    try:
        identity = resolve_reference(ref, offline=offline)
        record = _cached_or_run(identity, folder.path, timeout_s, cache)
    except ReferenceTimeoutError:
        from dflash_audit.limits import exceeded

        raise ServeCheckError(exceeded("the reference's serve probe", timeout_s,
                                       PROBE_TIMEOUT_ENV)) from None
    except ReferenceSourceError as exc:
        raise ServeCheckError(f"the reference could not read the checkpoint: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ServeCheckError(f"the reference's serve probe wrote no readable record "
                              f"({type(exc).__name__}: {exc})") from None
    record.side = identity.spec
    return record


def _cached_or_run(identity: Any, path: Path, timeout_s: float, cache: bool) -> SideRecord:
    """The probe's record of ``path``: from its trusted cache record (``cache``), else from a
    run of the probe, stored when the config did not change meanwhile (the key is read
    again after the run)."""
    from dflash_audit.reference_source.identity import reference_dir
    from dflash_audit.reference_source.runner import run_reference
    from dflash_audit.report.fingerprint import report_key
    from dflash_audit.serve import reference_record as rr

    try:
        signing = report_key(create=True)
    except OSError:
        signing = None  # no key to sign or check records with: no cache
    key = rr.probe_key(identity, path) if signing is not None else None
    if key is not None and cache:
        data, why = rr.read_probe(key, signing)
        try:
            record = SideRecord.from_dict(data) if data is not None else None
        except (KeyError, TypeError, ValueError) as exc:  # signed, of an older format
            record, why = None, f"not a record of this version ({type(exc).__name__})"
        if record is not None:
            note = (f"its reading of this config.json came from the cache (record {key[:12]}, "
                    "verified; --no-reference-cache runs it again)")
            print(f"dflash-audit: {note}", file=sys.stderr, flush=True)
            record.notes.append(note)
            return record
        if why:
            print(f"dflash-audit: the cached reading of the reference was ignored ({why}); "
                  "running it again", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="dflash-serve-ref-") as tmp:
        out = Path(tmp) / "probe.json"
        run_reference(identity, [str(path.resolve()), str(out)], Path(tmp), timeout_s,
                      adapter=reference_dir() / "serve_probe.py")
        data = json.loads(out.read_text())
    record = SideRecord.from_dict(data)
    if key is not None and key == rr.probe_key(identity, path):
        rr.store_probe(key, data, signing)
    return record
