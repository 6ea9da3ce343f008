"""NVIDIA ModelOpt 0.47.0's DFlash recipe YAML (``modelopt_recipes/general/speculative_decoding/
dflash.yaml``: ``metadata``, ``model``, ``data``, ``training``, ``dflash``) as dflash-audit
profile fields (:mod:`dflash_audit.profile`), reflecting what ModelOpt will train -- not what
the file seems to say. Every key is read: mapped to a profile field, recorded in the profile's
description as not audited (optimizer schedule, logging, paths), or the file is refused naming
the key. Defaults are ModelOpt 0.47.0's (cited; ``tests/test_framework_modelopt.py`` checks them
against ModelOpt's own ``modelopt.recipe.load_recipe``). Reads YAML only: modelopt need not be
importable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dflash_audit.model.layer_ids import from_zlab_ids
from dflash_audit.profile import ProfileError

#: ``DFlashConfig`` defaults, modelopt/torch/speculative/config.py:81-279.
DFLASH_DEFAULTS: dict[str, Any] = {
    "dflash_offline": False, "dflash_block_size": 8, "dflash_freeze_base_model": True,
    "dflash_self_logit_distillation": True, "dflash_loss_decay_factor": 0.0,
    "dflash_loss_objective": "dpace", "dflash_dpace_alpha": 0.5, "dflash_num_anchors": 512,
    "dflash_report_acc": True, "dflash_mask_token_id": None, "dflash_architecture_config": {},
    "dflash_use_torch_compile": True, "dflash_swa_window_size": None,
    "dflash_draft_attention": "bidirectional", "dflash_attention_sink": False,
    "dflash_init_checkpoint": None, "dflash_export_rope_scaling": {},
    "dflash_lambda_base_start": 1.0, "dflash_lambda_base_decay_ratio": 1.0,
    "dflash_ce_loss_alpha": 0.1, "dflash_l1_loss_alpha": 0.9,
    "dflash_confidence_head_alpha": 0.0}
#: ``default_dflash_config``, modelopt/torch/speculative/dflash/default_config.py:24-35.
ARCHITECTURE_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 5, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0,
    "tie_word_embeddings": False, "_attn_implementation": "sdpa"}
#: speculative ``TrainingArguments`` defaults, plugins/hf_training_args.py:100-115.
TRAINING_DEFAULTS: dict[str, Any] = {
    "training_seq_len": 2048, "estimate_ar": False, "ar_validate_steps": 1000,
    "answer_only_loss": False, "cp_size": 1, "dp_shard_size": None}
#: dflash keys that cannot change what the drafter trains on: derived from data.mode
#: (recipe/config.py:392-398), logging, stored only (dflash_model.py:85; no compile call in
#: the DFlash path), and Domino / DSpark weights (ignored unless projector_type says so).
INERT_DFLASH = ("dflash_offline", "dflash_report_acc", "dflash_use_torch_compile",
                "dflash_lambda_base_start", "dflash_lambda_base_decay_ratio",
                "dflash_ce_loss_alpha", "dflash_l1_loss_alpha", "dflash_confidence_head_alpha")
#: dflash keys the profile cannot express: refused unless at ModelOpt's default.
FIXED_DFLASH = {"dflash_freeze_base_model": "the verifier would be trained too",
                "dflash_attention_sink": "a per-head sink parameter the reference lacks",
                "dflash_init_checkpoint": "a warm start: audit those weights with --weights",
                "dflash_export_rope_scaling": "the exported config.json's rope_scaling "
                                              "(serving) differs from what was trained"}
#: HF trainer keys that set the optimizer schedule, parallelism, logging or I/O: read and
#: listed as not audited (the profile audits one training step's semantics).
NOT_AUDITED_TRAINING = (
    "output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size",
    "per_device_eval_batch_size", "gradient_accumulation_steps", "learning_rate",
    "warmup_steps", "warmup_ratio", "lr_scheduler_type", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_epsilon", "max_grad_norm", "seed", "data_seed", "logging_steps",
    "save_steps", "save_strategy", "save_total_limit", "eval_steps", "eval_strategy",
    "do_eval", "disable_tqdm", "report_to", "dataloader_drop_last", "dataloader_num_workers",
    "remove_unused_columns", "ddp_find_unused_parameters", "ddp_timeout", "cp_size",
    "dp_shard_size", "estimate_ar", "ar_validate_steps", "tf32", "gradient_checkpointing",
    "run_name", "logging_dir", "fsdp", "fsdp_config", "deepspeed", "torch_compile")
MODEL_KEYS = ("model_name_or_path", "use_fake_base_for_offline", "trust_remote_code")
DATA_KEYS = ("mode", "data_path", "offline_data_path", "lazy_preprocess", "draft_vocab_cache",
             "chat_template", "vlm_img_dir", "vlm_processor", "sample_size",
             "streaming_server_url", "streaming_model_name", "final_aux_is_base_hidden")


class RecipeError(ProfileError):
    """A ModelOpt recipe the profile cannot represent (the message names the file and key)."""


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RecipeError(f"ModelOpt recipe {path} is not a file (give the recipe YAML)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RecipeError(f"ModelOpt recipe {path}: cannot read it as YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"ModelOpt recipe {path}: the top level must be a mapping")
    return data


def read_run_config(path: str | Path) -> dict[str, Any]:
    """The profile fields of a ModelOpt DFlash recipe (see the module docstring).

    What ModelOpt does with the keys (modelopt/torch/speculative/plugins/hf_dflash.py):
    ``dflash_loss_objective`` (default ``dpace``) decides the per-slot weights, so a
    ``dflash_loss_decay_factor`` is ignored under D-PACE (dflash/dflash_model.py:76-81) and
    ``gamma`` then only fills the profile's field; ``decay`` with factor 0 is ``weighting =
    "none"``. ``dflash_self_logit_distillation`` true is soft cross-entropy against the teacher
    (``loss = "kl_div"``: same gradient as KL, a value larger by the teacher's entropy, which
    the audit names), false is hard CE against the data token (``"ce-data"``). Without
    explicit ``target_layer_ids`` ModelOpt takes one per draft layer
    (``"per-draft-layer"``); explicit z-lab ids k become speculators ids k + 1.
    ``dflash_swa_window_size`` W windows every layer (``layer_layout = "sliding"``); the block
    is causal only with ``dflash_draft_attention = "causal"``; a causal block without a window
    is a window of ``training_seq_len`` (no context is ever cut).

    Raises:
        RecipeError: unreadable, not a DFlash recipe, or a key that changes training the
            profile cannot express (named), or an unknown key.
    """
    path = Path(path).expanduser()
    data = _load(path)
    where = f"ModelOpt recipe {path}"

    def refuse(key: str, why: str) -> RecipeError:
        return RecipeError(f"{where}: {key}: {why}")

    unknown = [k for k in data if k not in ("metadata", "model", "data", "training", "dflash")]
    if unknown:
        raise refuse(unknown[0], "unknown section (ModelOpt's DFlash recipe has metadata, "
                                 "model, data, training, dflash)")
    sections = {k: data.get(k) or {} for k in ("metadata", "model", "data", "training", "dflash")}
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise refuse(name, "must be a mapping")
        for key, value in section.items():
            if isinstance(value, str) and "${" in value:
                raise refuse(f"{name}.{key}", "an unresolved interpolation; resolve it first")
    kind = sections["metadata"].get("recipe_type", "speculative_dflash")
    if kind != "speculative_dflash":
        raise refuse("metadata.recipe_type", f"{kind!r} is not a DFlash recipe")
    notes: list[str] = []
    for key in sections["model"]:
        if key not in MODEL_KEYS:
            raise refuse(f"model.{key}", "unknown key (plugins/hf_training_args.py:39-46)")
    data_keys = sections["data"]
    for key in data_keys:
        if key not in DATA_KEYS:
            raise refuse(f"data.{key}", "unknown key (plugins/hf_training_args.py:49-71)")
    if data_keys.get("final_aux_is_base_hidden"):
        raise refuse("data.final_aux_is_base_hidden", "the top target layer doubles as the "
                     "last hidden state; the profile keeps them apart")
    if data_keys.get("offline_data_path"):
        notes.append("offline dumps: the last hidden state is taken as post-norm unless the "
                     "dump says hidden_states_prenorm (eagle/utils.py:161)")
    dflash = {**DFLASH_DEFAULTS, **sections["dflash"]}
    for key in sections["dflash"]:
        if key not in DFLASH_DEFAULTS:
            raise refuse(f"dflash.{key}", "unknown key (modelopt/torch/speculative/config.py:"
                                          "78-296)")
    for key, why in FIXED_DFLASH.items():
        if dflash[key] != DFLASH_DEFAULTS[key]:
            raise refuse(f"dflash.{key}", f"{dflash[key]!r} cannot be audited: {why}")
    fields = _dflash_fields(dflash, refuse, notes)
    fields.update(_training_fields(sections["training"], fields, refuse, notes))
    base = sections["model"].get("model_name_or_path")
    notes.insert(0, f"ModelOpt {Path(path).name}" + (f" for {base}" if base else ""))
    return {"name": f"modelopt-{path.stem}", "description": "; ".join(notes), **fields}


def _dflash_fields(dflash: dict[str, Any], refuse: Any, notes: list[str]) -> dict[str, Any]:
    arch_in = dict(dflash["dflash_architecture_config"] or {})
    for key, value in arch_in.items():
        if key in ("num_hidden_layers", "target_layer_ids") or (
                key == "projector_type" and value in (None, "dflash")):
            continue
        if ARCHITECTURE_DEFAULTS.get(key, object()) != value:
            raise refuse(f"dflash.dflash_architecture_config.{key}", f"{value!r}: the profile "
                         "derives the draft architecture from the verifier and cannot fix it")
    layers = int(arch_in.get("num_hidden_layers", ARCHITECTURE_DEFAULTS["num_hidden_layers"]))
    ids = arch_in.get("target_layer_ids")
    if ids:
        if len(ids) != layers:
            raise refuse("dflash.dflash_architecture_config.target_layer_ids",
                         f"{len(ids)} ids for {layers} draft layers: ModelOpt refuses it "
                         "(one target layer per draft layer, hf_dflash.py:457-462)")
        target_layers: Any = from_zlab_ids(ids)
    else:
        target_layers = "per-draft-layer"
    objective, decay = dflash["dflash_loss_objective"], float(dflash["dflash_loss_decay_factor"])
    if objective not in ("dpace", "decay"):
        raise refuse("dflash.dflash_loss_objective", f"{objective!r} (decay or dpace)")
    if objective == "dpace":
        weighting = "dpace"
        if decay > 0:
            notes.append(f"dflash_loss_decay_factor {decay:g} is ignored: the objective is "
                         "D-PACE (ModelOpt warns the same, dflash/dflash_model.py:76-81)")
    else:
        weighting = "fixed-exp-decay" if decay > 0 else "none"
    window = dflash["dflash_swa_window_size"]
    attention = dflash["dflash_draft_attention"]
    if attention not in ("bidirectional", "causal"):
        raise refuse("dflash.dflash_draft_attention", f"{attention!r}")
    fields = {"block_size": int(dflash["dflash_block_size"]),
              "gamma": decay if decay > 0 else 4.0, "weighting": weighting,
              "dpace_alpha": float(dflash["dflash_dpace_alpha"]),
              "loss": "kl_div" if dflash["dflash_self_logit_distillation"] else "ce-data",
              "max_anchors": int(dflash["dflash_num_anchors"]), "target_layers": target_layers,
              "num_draft_layers": layers, "sample_from_anchor": False,
              "sliding_window_non_causal": attention == "bidirectional" and window is not None,
              "layer_layout": "full" if window is None and attention == "bidirectional"
              else "sliding"}
    if fields["loss"] == "kl_div":
        notes.append("soft cross-entropy against the teacher (kl_div gradient, value + H(p))")
    if window is not None:
        fields["sliding_window"] = int(window)
    elif attention == "causal":
        fields["sliding_window"] = None  # set from training_seq_len
        notes.append("causal block without a window: a window of training_seq_len")
    if dflash["dflash_mask_token_id"] is not None:
        fields["mask_token_id"] = int(dflash["dflash_mask_token_id"])
    return fields


def _training_fields(training: dict[str, Any], fields: dict[str, Any], refuse: Any,
                     notes: list[str]) -> dict[str, Any]:
    known = set(TRAINING_DEFAULTS) | set(NOT_AUDITED_TRAINING) | {"bf16", "fp16", "optim"}
    for key in training:
        if key not in known:
            raise refuse(f"training.{key}", "unknown or not audited key that may change "
                                            "training")
    t = {**TRAINING_DEFAULTS, **training}
    if not t["answer_only_loss"]:
        raise refuse("training.answer_only_loss", "false trains every token; the profile "
                     "trains the assistant tokens (the data's loss_mask)")
    if t.get("fp16"):
        raise refuse("training.fp16", "float16 is not a profile dtype (fp32 | bf16)")
    optim = str(t.get("optim", "adamw_torch"))
    if not optim.startswith("adamw"):
        raise refuse("training.optim", f"{optim!r} (the profile's optimizer: adamw | muon)")
    seq_len = int(t["training_seq_len"])
    if seq_len % fields["block_size"]:
        raise refuse("training.training_seq_len", f"{seq_len} is not a multiple of "
                     f"dflash_block_size {fields['block_size']} (ModelOpt raises, "
                     "hf_dflash.py:930-934)")
    out: dict[str, Any] = {"optimizer": "adamw", "dtype": "bf16" if t.get("bf16") else "fp32"}
    if fields.get("layer_layout") == "sliding" and fields.get("sliding_window") is None:
        out["sliding_window"] = seq_len
    schedule = sorted(k for k in training if k in NOT_AUDITED_TRAINING)
    notes.append(f"rows of {seq_len} tokens, one conversation each")
    if schedule:
        notes.append("not audited: training." + ", training.".join(schedule))
    return out
