"""SpecForge 0.2.0's configuration side: its layer-id convention, its own draft-config
derivation from a verifier config (flattened for the ``derivation`` check), and a reader of its
training run config (YAML / JSON) into dflash-audit profile fields.

Citations are to ``specforge==0.2.0``: ``model_loading.py`` = ``specforge/training/
model_loading.py``, ``model_providers.py`` = ``specforge/algorithms/model_providers.py``,
``schema.py`` = ``specforge/config/schema.py``, ``dflash.py`` = ``specforge/modeling/draft/
dflash.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dflash_audit.model.derivation import SAVED_KEYS, rope_fields
from dflash_audit.model.layer_ids import from_zlab_ids
from dflash_audit.user_input import loads_json


def _write_verifier(verifier_config: Any, folder: Path) -> None:
    text = getattr(verifier_config, "text_config", None) or verifier_config
    data = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
    (folder / "config.json").write_text(json.dumps(data, default=str))


#: The derived fields a sliding layout sets on SpecForge's generated (all full-attention)
#: draft config.
LAYOUT_FIELDS = ("layer_types", "sliding_window")


def derive_config(verifier_config: Any, config: Any) -> dict[str, Any]:
    """SpecForge's own draft config for a verifier, flattened like
    :func:`dflash_audit.model.derivation.derivation_fields`.

    Runs ``resolve_draft_config`` (``model_loading.py:288-313``): ``_generate_draft_config``
    copies ``_TARGET_ARCHITECTURE_FIELDS`` from the target config (``:47-68``, ``:211-258``),
    ``populate_dflash_generated_config`` (``model_providers.py:456-474``) and the overrides
    ``model.draft_num_hidden_layers`` / ``model.draft_block_size`` set to the case's layer count
    and block size (``:477-501``: the target ids become ``build_target_layer_ids(N, k)``). The
    generated config is all full attention; a sliding layout needs a user draft config in
    SpecForge, so the case's ``layer_types`` / ``sliding_window`` are set on it as such a file
    would: those fields are the adapter's (its ``"provenance"`` entry says so, and the
    derivation check is then no plain PASS). The RoPE reported is what SpecForge's draft builds,
    ``Qwen3RotaryEmbedding(config)`` (``dflash.py:361``). No ``verifier_norm`` (SpecForge's
    DFlash has no verifier norm) and no ``mask_token_id`` (resolved from a tokenizer at
    training time, ``training/model_utils.py:8-60``).

    Raises:
        Exception: whatever SpecForge's own derivation raises (e.g. ``KeyError: 'rope_type'``
            for a nested per-layer-type ``rope_parameters``, research sec. 2.9).
    """
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.modeling.draft.dflash import build_target_layer_ids
    from specforge.modeling.target.target_utils import target_vocab_size
    from specforge.training.model_loading import resolve_draft_config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    provider = algorithm_providers().model.draft_config
    with tempfile.TemporaryDirectory(prefix="specforge-derive-") as tmp:
        _write_verifier(verifier_config, Path(tmp))
        run = SimpleNamespace(
            model=SimpleNamespace(target_model_path=tmp, cache_dir=None, trust_remote_code=False,
                                  draft_model_config=None, draft_checkpoint_path=None,
                                  draft_num_hidden_layers=int(config.num_hidden_layers),
                                  draft_block_size=int(config.block_size)),
            training=SimpleNamespace(strategy="dflash"))
        draft = resolve_draft_config(run, provider=provider)
    types = list(config.effective_layer_types)
    provenance = {}
    if "sliding_attention" in types:  # what a user draft config would set: the adapter's
        draft.layer_types, draft.sliding_window = types, config.sliding_window
        draft.use_sliding_window = True
        provenance = {k: "adapter" for k in (*LAYOUT_FIELDS, *(f"saved.{f}" for f in (
            *LAYOUT_FIELDS, "use_sliding_window")))}
    rotary = Qwen3RotaryEmbedding(draft)
    rope = dict(getattr(draft, "rope_parameters", None) or {})
    saved = draft.to_dict()
    text = getattr(verifier_config, "text_config", None) or verifier_config
    n = int(draft.num_target_layers)
    default_ids = from_zlab_ids(build_target_layer_ids(n, int(draft.num_hidden_layers)))
    return {
        "hidden_size": draft.hidden_size, "intermediate_size": draft.intermediate_size,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": getattr(draft, "head_dim", None)
        or draft.hidden_size // draft.num_attention_heads,
        "rms_norm_eps": draft.rms_norm_eps, "hidden_act": draft.hidden_act,
        "attention_bias": bool(draft.attention_bias),
        "max_position_embeddings": draft.max_position_embeddings,
        "tie_word_embeddings": bool(draft.tie_word_embeddings),
        "vocab_size": draft.vocab_size, "target_vocab_size": target_vocab_size(text),
        "layer_types": list(draft.layer_types),
        "sliding_window": draft.sliding_window if "sliding_attention" in draft.layer_types
        else None,
        **rope_fields(rope, rotary, default_theta=10000.0),
        "default_target_layer_ids": default_ids,
        "framework.target_layer_ids": list(draft.dflash_config["target_layer_ids"]),
        "framework.block_size": int(draft.block_size),
        "provenance": provenance,
        **{f"saved.{k}": saved.get(k) for k in SAVED_KEYS},
    }


# ---------------------------------------------------------------------- run config reader
#: Keys (dotted) a run config may set that do not change what DFlash trains on or how it is
#: served: logging, topology, I/O, caching, capture-server tuning, checkpoint cadence.
NEUTRAL_PREFIXES = ("tracking", "profiling", "runtime", "deployment", "run_id",
                    "output_dir", "model.sglang_", "model.target_backend",
                    "model.shard_target_output", "model.input_modality",
                    "model.trust_remote_code", "model.cache_dir", "data.train_data_path",
                    "data.prompts_path", "data.hidden_states_path", "data.eval_data_path",
                    "data.eval_hidden_states_path", "data.build_dataset_num_proc",
                    "data.dataloader_num_workers", "data.cache_dir", "data.cache_key",
                    "training.save_interval", "training.eval_interval",
                    "training.log_interval", "training.max_checkpoints", "training.resume_from",
                    "training.role", "training.fsdp_sharding", "training.optimizer_cpu_offload",
                    "training.tp_size", "training.sp_ulysses_size", "training.sp_ring_size",
                    "training.dist_timeout", "training.prompt_seed", "training.strategy")
#: Keys that change training but lie outside a profile (optimiser, data, numerics): read and
#: returned under ``recipe``.
RECIPE_KEYS = ("model.target_model_path", "model.draft_checkpoint_path", "model.torch_dtype",
               "model.use_liger_kernel", "model.embedding_key", "model.lm_head_key",
               "model.tokenizer_pad_token_id", "data.max_length", "data.chat_template",
               "data.is_preformatted", "data.train_only_last_turn", "data.max_prompts",
               "training.num_epochs", "training.max_steps", "training.total_steps",
               "training.batch_size", "training.accumulation_steps", "training.learning_rate",
               "training.lr_scheduler", "training.warmup_ratio", "training.max_grad_norm",
               "training.attention_backend", "training.objective_chunk_blocks",
               "training.seed")
#: Keys SpecForge's DFlash strategy does not read (other strategies' knobs), with why.
UNUSED_BY_DFLASH = {
    "model.aux_hidden_state_layer_ids": "DFlash captures the draft config's dflash_config."
    "target_layer_ids only (model_providers.py:230-241)",
    "model.vocab_mapping_path": "EAGLE vocabulary maps; DFlash has no draft vocabulary",
    "model.load_target_embedding": "EAGLE / P-EAGLE draft embeddings",
    **{f"training.{k}": "another strategy's knob" for k in (
        "ttt_length", "lk_loss_type", "kl_scale", "kl_decay", "lambda_base_start",
        "lambda_base_decay_ratio", "dspark_ce_loss_alpha", "dspark_l1_loss_alpha",
        "dspark_confidence_head_alpha", "num_depths", "down_sample_ratio",
        "down_sample_ratio_min", "norm_before_residual", "compact_teacher",
        "compact_teacher_chunk_size")},
}
#: Keys mapped onto profile fields.
PROFILE_KEYS = ("model.draft_model_config", "model.draft_num_hidden_layers",
                "model.draft_block_size", "model.mask_token_id", "training.num_anchors",
                "training.loss_decay_gamma", "training.loss_type", "training.dpace_alpha")


def _set_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out += _set_keys(v, f"{prefix}{k}.")
        else:
            out.append(prefix + k)
    return out


def read_run_config(path: str | Path) -> dict[str, Any]:
    """Profile fields (:mod:`dflash_audit.profile`) of a SpecForge DFlash run config, validated
    by SpecForge's own schema (``Config.from_file``, ``schema.py``; unknown keys are refused
    there).

    Returns the profile fields ``block_size``, ``gamma``, ``loss``, ``weighting``,
    ``dpace_alpha``, ``max_anchors``, ``target_layers``, ``num_draft_layers``,
    ``layer_layout``, ``sliding_window``, ``sliding_window_non_causal``,
    ``sample_from_anchor``, ``optimizer``, ``dtype`` and, when set, ``mask_token_id``; values
    a profile cannot express today use the names being added to it: ``weighting = "none"``
    (no ``training.loss_decay_gamma``: SpecForge's default, no decay; ``gamma`` is then None),
    ``target_layers = "per-draft-layer"`` (``build_target_layer_ids(N, k)``, k = draft layers,
    ``dflash.py:271-281``), ``loss = "ce-data"`` (cross-entropy against the data tokens). Also
    ``recipe`` (training keys outside a profile, see :data:`RECIPE_KEYS`), ``unused_by_dflash``
    (keys set that SpecForge's DFlash path does not read, with why) and ``source``.

    Raises:
        ValueError: the file is not a valid SpecForge config, its strategy is not ``dflash``,
            or it sets a key that changes training which no field here reads (the key named).
        ImportError: ``specforge`` is not importable.
    """
    from specforge.config.schema import Config

    try:
        cfg = Config.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - pydantic / yaml / OSError, one message
        errors = getattr(exc, "errors", None)
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                        for e in errors()) if callable(errors) else str(exc).splitlines()[0]
        raise ValueError(f"{path}: not a valid SpecForge 0.2.0 run config: {why}") from None
    if cfg.training.strategy != "dflash":
        raise ValueError(f"{path}: training.strategy is {cfg.training.strategy!r}; only "
                         "'dflash' runs are DFlash training")
    set_keys = _set_keys(cfg.model_dump(exclude_unset=True))
    known = set(PROFILE_KEYS) | set(RECIPE_KEYS) | set(UNUSED_BY_DFLASH)
    unread = [k for k in set_keys if k not in known and not k.startswith(NEUTRAL_PREFIXES)]
    if unread:
        raise ValueError(f"{path}: {min(unread)} changes training but no profile field "
                         "reads it; remove it or audit without this run config")
    t, m = cfg.training, cfg.model
    if t.loss_type not in ("dflash", "dpace"):
        raise ValueError(f"{path}: training.loss_type {t.loss_type!r} has no profile weighting "
                         "(only 'dflash' and 'dpace' do)")
    draft: dict[str, Any] = {}
    if m.draft_model_config:
        draft = _draft_config_file(m.draft_model_config)
    num_layers = m.draft_num_hidden_layers or int(draft.get("num_hidden_layers", 1))
    layer_types = list(draft.get("layer_types") or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        layer_types = [layer_types[0]] * num_layers  # model_providers.py:484-492
    explicit = (draft.get("dflash_config") or {}).get("target_layer_ids")
    sliding = "sliding_attention" in layer_types
    decay = t.loss_type == "dflash" and t.loss_decay_gamma is not None and t.loss_decay_gamma > 0
    mask = m.mask_token_id if m.mask_token_id is not None else (
        draft.get("dflash_config") or {}).get("mask_token_id")
    out: dict[str, Any] = {
        "block_size": m.draft_block_size or int(draft.get("block_size", 16)),
        "gamma": float(t.loss_decay_gamma) if decay else None,
        "loss": "ce-data",
        "weighting": "dpace" if t.loss_type == "dpace" else (
            "fixed-exp-decay" if decay else "none"),
        "dpace_alpha": float(t.dpace_alpha),
        "max_anchors": int(t.num_anchors),
        "target_layers": from_zlab_ids(explicit) if explicit and not
        m.draft_num_hidden_layers else "per-draft-layer",
        "num_draft_layers": num_layers,
        "layer_layout": ["sliding" if x == "sliding_attention" else "full" for x in layer_types]
        if len(set(layer_types)) > 1 else ("sliding" if sliding else "full"),
        "sliding_window": int(draft["sliding_window"]) if sliding else None,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "optimizer": "adamw",  # optimizer.py: BF16Optimizer wraps torch.optim.AdamW
        "dtype": {"float32": "fp32", "bfloat16": "bf16"}.get(m.torch_dtype, m.torch_dtype),
        "recipe": {k: _get(cfg, k) for k in RECIPE_KEYS},
        "unused_by_dflash": {k: UNUSED_BY_DFLASH[k] for k in set_keys if k in UNUSED_BY_DFLASH},
        "source": str(path),
    }
    if mask is not None:
        out["mask_token_id"] = int(mask)
    return out


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _draft_config_file(source: str) -> dict[str, Any]:
    """The draft config a run names (a JSON file or a folder with ``config.json``).

    Raises:
        ValueError: it is not a local file (a Hugging Face repository is not fetched here).
    """
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model.draft_model_config {source!r} is not a local config file; "
                         "download it and name the file")
    return loads_json(path.read_text())
