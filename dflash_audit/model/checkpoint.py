"""Drafter checkpoints in the reference's format: ``config.json`` + ``model.safetensors``.

The format is what speculators' ``DFlashDraftModel.save_pretrained`` writes (0.9.0):
``config.json`` carries ``speculators_model_type: "dflash"``, the draft decoder as a
``transformer_layer_config`` (model_type qwen3), ``aux_hidden_state_layer_ids``,
``block_size``, ``mask_token_id``, ``draft_vocab_size``, ``sliding_window_non_causal``,
``sample_from_anchor`` and a ``speculators_config`` naming the verifier;
``model.safetensors`` holds the trained weights, and ``lm_head.weight`` / ``t2d`` / ``d2t``
only for a draft vocabulary. Verifier-owned weights (embeddings, full-vocab lm_head,
verifier_lm_head, verifier_norm) are not stored: loaders take them from the verifier named
in the config. So our checkpoints load in speculators (and vLLM), and theirs in ours.

Writes are atomic: a temporary folder renamed into place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_audit.atomic import atomic_folder, save_safetensors
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.user_input import loads_json

NOT_SAVED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: A training run's layout: ``<out>/checkpoints/step-*`` and the pointer ``<out>/checkpoints/
#: latest`` (a one-line text file naming the newest step folder).
CHECKPOINTS, LATEST = "checkpoints", "latest"


class CheckpointError(Exception):
    """A checkpoint folder is missing, incomplete, or not a DFlash checkpoint."""


def follow_latest(path: str | Path) -> Path:
    """The checkpoint folder a user means: ``path`` itself, or, for the ``latest`` pointer
    file (``<out>/checkpoints/latest``) or a run folder ``<out>`` that has one, the folder
    the pointer names. Nothing is checked here (loading says what is missing)."""
    path = Path(path)
    if path.is_dir() and (path / CHECKPOINTS / LATEST).is_file():
        path = path / CHECKPOINTS / LATEST
    if path.is_file() and path.name == LATEST:
        return path.parent / path.read_text().strip()
    return path


def reference_config(config: DFlashConfig, verifier_name_or_path: str | None,
                     verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """The reference's config.json content for a drafter config."""
    rope = {"rope_type": "default", **(config.rope_parameters or {}),
            "rope_theta": config.rope_theta}
    if rope["rope_type"] == "default" and "mrope_section" not in rope:
        # our draft layers rotate the whole head for default RoPE: an engine that honoured a
        # saved partial_rotary_factor would run another RoPE (the reference CLI drops it too)
        rope.pop("partial_rotary_factor", None)
    layer_types = list(config.effective_layer_types)
    tokens = config.block_size if config.sample_from_anchor else config.block_size - 1
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "draft_vocab_size": config.effective_draft_vocab_size,
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": config.sample_from_anchor,
        "sliding_window_non_causal": config.sliding_window_non_causal,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": {
            "model_type": "qwen3",
            "attention_bias": config.attention_bias,
            "head_dim": config.head_dim,
            "hidden_act": config.hidden_act,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "layer_types": layer_types,
            "max_position_embeddings": config.max_position_embeddings,
            "num_attention_heads": config.num_attention_heads,
            "num_hidden_layers": config.num_hidden_layers,
            "num_key_value_heads": config.num_key_value_heads,
            "pad_token_id": config.pad_token_id,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_parameters": rope,
            "sliding_window": config.sliding_window,
            # Qwen3Config drops sliding_window on load unless use_sliding_window is set
            # (the reference's training CLI sets it the same way)
            "use_sliding_window": "sliding_attention" in layer_types,
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": False,
        },
    }


def config_from_reference(d: dict[str, Any], num_verifier_layers: int,
                          verifier_model_type: str = "llama") -> DFlashConfig:
    """Inverse of :func:`reference_config`. ``num_verifier_layers`` (N) is not stored by the
    reference; take it from the verifier's config.

    Raises:
        CheckpointError: not a DFlash config.
    """
    if d.get("speculators_model_type") != "dflash":
        raise CheckpointError(f"not a DFlash checkpoint config "
                              f"(speculators_model_type={d.get('speculators_model_type')!r})")
    tl = d["transformer_layer_config"]
    rope = dict(tl.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", tl.get("rope_theta", 1e6)))
    if rope.get("rope_type", "default") == "default":
        rope.pop("rope_type", None)
    layer_types = tl.get("layer_types")
    if layer_types and not tl.get("use_sliding_window", False):
        # Qwen3Config sets sliding_window=None when use_sliding_window is false, and the
        # reference then runs "sliding" layers as full bidirectional attention: load them so.
        layer_types = ["full_attention"] * len(layer_types)
    vocab = int(tl["vocab_size"])
    from dflash_audit.model.config import ONE_PLUS_WEIGHT_NORM_MODEL_TYPES

    return DFlashConfig(
        hidden_size=tl["hidden_size"], intermediate_size=tl["intermediate_size"],
        num_attention_heads=tl["num_attention_heads"],
        num_key_value_heads=tl.get("num_key_value_heads") or tl["num_attention_heads"],
        head_dim=tl.get("head_dim") or tl["hidden_size"] // tl["num_attention_heads"],
        num_hidden_layers=tl["num_hidden_layers"], vocab_size=vocab,
        num_verifier_layers=num_verifier_layers,
        target_layer_ids=tuple(d["aux_hidden_state_layer_ids"]),
        mask_token_id=d["mask_token_id"], block_size=d.get("block_size", 8),
        draft_vocab_size=None if d.get("draft_vocab_size") in (None, vocab)
        else d["draft_vocab_size"],
        layer_types=tuple(layer_types) if layer_types else None,
        sliding_window=tl.get("sliding_window") if layer_types and
        "sliding_attention" in layer_types else None,
        sliding_window_non_causal=d.get("sliding_window_non_causal", False),
        sample_from_anchor=d.get("sample_from_anchor", False),
        rms_norm_eps=tl.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
        rope_parameters=rope or None,
        max_position_embeddings=tl.get("max_position_embeddings", 32768),
        attention_bias=tl.get("attention_bias", False), hidden_act=tl.get("hidden_act", "silu"),
        pad_token_id=tl.get("pad_token_id"), verifier_model_type=verifier_model_type,
        verifier_norm_one_plus_weight=verifier_model_type in ONE_PLUS_WEIGHT_NORM_MODEL_TYPES,
    )


def _speculative_tokens(d: dict[str, Any]) -> Any:
    methods = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return (methods[0] or {}).get("speculative_tokens")


def validate_checkpoint(path: str | Path, num_verifier_layers: int,
                        verifier_hidden_size: int | None = None) -> dict[str, Any]:
    """Check a checkpoint folder against the reference's DFlash config rules before loading.

    Rules (speculators 0.9.0, ``models/dflash/core.py``): ``speculative_tokens`` of the
    greedy proposal = ``block_size`` (``sample_from_anchor``) else ``block_size - 1``; every
    ``aux_hidden_state_layer_ids`` entry in [0, N] for an N-layer verifier (the same rule,
    and message, as ``dflash-audit data``); ``fc.weight`` reads ``len(ids) * H`` features;
    with a draft vocabulary, ``t2d`` (bool, [V]) has ``draft_vocab_size`` True entries and
    ``d2t`` ([V_d]) maps draft id i to target id ``i + d2t[i]``, the i-th True position of
    ``t2d``. Also: ``config.json`` parses; ``model.safetensors`` is whole (its manifest, or
    its header's length) .

    Returns:
        The parsed ``config.json``.

    Raises:
        CheckpointError: one line naming the folder, the rule and the values.
    """
    from safetensors import safe_open

    from dflash_audit.atomic import manifest_problems, safetensors_problem
    from dflash_audit.data.errors import LayerIdError
    from dflash_audit.model.layer_ids import resolve_target_layer_ids

    path = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} has no {name}: not a finished checkpoint")
    problems = manifest_problems(path) or []
    bad = safetensors_problem(path / "model.safetensors")
    if problems or bad:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems or [bad])}); "
                              "use an intact checkpoint (an earlier step-* folder)")
    try:
        d = loads_json((path / "config.json").read_text())
        tl = d["transformer_layer_config"]
        block_size, hidden = int(d["block_size"]), int(tl["hidden_size"])
        ids = [int(i) for i in d["aux_hidden_state_layer_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}/config.json is not a DFlash checkpoint config "
                              f"({type(exc).__name__}: {exc})") from exc
    if d.get("speculators_model_type") != "dflash":
        raise CheckpointError(f"{path}/config.json: not a DFlash checkpoint config "
                              f"(speculators_model_type={d.get('speculators_model_type')!r})")
    want = block_size if d.get("sample_from_anchor") else block_size - 1
    if _speculative_tokens(d) != want:
        raise CheckpointError(
            f"{path}/config.json: speculative_tokens {_speculative_tokens(d)!r} does not fit "
            f"block_size {block_size} (the reference requires block_size"
            f"{'' if d.get('sample_from_anchor') else ' - 1'} = {want}); fix the config")
    try:
        resolve_target_layer_ids(num_verifier_layers, ids)
    except LayerIdError as exc:
        raise CheckpointError(f"checkpoint {path}: aux_hidden_state_layer_ids: {exc}") from exc
    if verifier_hidden_size is not None and hidden != verifier_hidden_size:
        raise CheckpointError(f"checkpoint {path}: hidden_size {hidden}, the verifier's is "
                              f"{verifier_hidden_size}; use the verifier it was trained with")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        fc = list(f.get_slice("fc.weight").get_shape()) if "fc.weight" in keys else None
        if fc is not None and fc[-1] != len(ids) * hidden:
            raise CheckpointError(
                f"checkpoint {path}: fc.weight reads {fc[-1]} features, but "
                f"{len(ids)} target layers x H={hidden} = {len(ids) * hidden}")
        vocab, vd = int(tl.get("vocab_size", 0)), d.get("draft_vocab_size")
        if vd not in (None, vocab) and {"t2d", "d2t"} <= keys:
            _check_draft_vocab(path, f.get_tensor("t2d"), f.get_tensor("d2t"), int(vd), vocab)
    return d


def _check_draft_vocab(path: Path, t2d: torch.Tensor, d2t: torch.Tensor, vd: int,
                       vocab: int) -> None:
    """t2d: bool [V] with V_d True entries; d2t: [V_d], i + d2t[i] = i-th True of t2d."""
    where = f"checkpoint {path}: draft vocabulary"
    if t2d.shape != (vocab,) or d2t.shape != (vd,):
        raise CheckpointError(f"{where}: t2d shape {list(t2d.shape)} (want [{vocab}]), d2t "
                              f"shape {list(d2t.shape)} (want [{vd}])")
    kept = torch.nonzero(t2d.bool()).flatten()
    if kept.numel() != vd:
        raise CheckpointError(f"{where}: t2d has {kept.numel()} True entries, "
                              f"draft_vocab_size is {vd}")
    mapped = torch.arange(vd) + d2t.long()
    wrong = torch.nonzero(mapped != kept).flatten()
    if wrong.numel():
        i = int(wrong[0])
        raise CheckpointError(f"{where}: d2t disagrees with t2d at {wrong.numel()} draft ids "
                              f"(first: draft id {i} -> target {int(mapped[i])}, t2d's is "
                              f"{int(kept[i])})")


def save_pretrained(model: DFlashDrafter, out_dir: str | Path,
                    verifier_name_or_path: str | None = None,
                    verifier_architectures: list[str] | None = None,
                    metadata: dict[str, str] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` atomically into ``out_dir``.

    ``metadata`` (str -> str) goes into the safetensors header (e.g. the audit report
    fingerprint). Returns the folder.
    """
    config = model.config
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
             if k not in NOT_SAVED and not (k == "lm_head.weight" and not config.uses_draft_vocab)}
    with atomic_folder(out_dir) as tmp:
        save_safetensors(state, tmp / "model.safetensors",
                         metadata={"format": "pt", **(metadata or {})})
        (tmp / "config.json").write_text(json.dumps(
            reference_config(config, verifier_name_or_path, verifier_architectures), indent=2))
    return Path(out_dir)


def load_pretrained(path: str | Path, verifier=None, num_verifier_layers: int | None = None
                    ) -> DFlashDrafter:
    """Load a reference-format checkpoint (ours or speculators') into a :class:`DFlashDrafter`.

    Args:
        path: checkpoint folder.
        verifier: a transformers causal LM to take the verifier-owned weights from; None
            loads it from the checkpoint's ``speculators_config.verifier.name_or_path``.
        num_verifier_layers: N when the verifier is not available to read it from.

    Raises:
        CheckpointError: missing files, not a DFlash checkpoint, missing trained weights.
    """
    path = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} has no {name}: not a finished checkpoint")
    try:
        d = loads_json((path / "config.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path}/config.json is not JSON ({exc})") from exc
    if verifier is None:
        name = (d.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
        if not name:
            raise CheckpointError(f"{path}/config.json names no verifier; pass verifier=")
        from transformers import AutoModelForCausalLM

        verifier = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    vc = getattr(verifier.config, "text_config", None) or verifier.config
    validate_checkpoint(path, num_verifier_layers or vc.num_hidden_layers, vc.hidden_size)
    config = config_from_reference(d, num_verifier_layers or vc.num_hidden_layers,
                                   str(getattr(vc, "model_type", "llama")))
    model = DFlashDrafter(config)
    state = load_file(path / "model.safetensors")
    from dflash_audit.model.verifier_weights import load_verifier_weights

    if config.uses_draft_vocab:  # t2d selects the verifier's head rows
        model.load_state_dict({k: state[k] for k in ("t2d", "d2t") if k in state}, strict=False)
    load_verifier_weights(model, verifier)
    missing, unexpected = model.load_state_dict(state, strict=False)
    full_vocab_head = set() if config.uses_draft_vocab else {"lm_head.weight"}
    expected_missing = set(NOT_SAVED) | full_vocab_head
    really_missing = sorted(set(missing) - expected_missing)
    if really_missing or unexpected:
        raise CheckpointError(f"{path}/model.safetensors: missing {really_missing}, "
                              f"unexpected {sorted(unexpected)}")
    return model
