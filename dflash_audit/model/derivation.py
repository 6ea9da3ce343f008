"""Our side of the drafter-config derivation, as the flat dict the reference adapter's
``--derive`` mode writes (``reference/adapter.py: derive``), so the two compare field by
field: what the drafter runs (RoPE, head geometry, eps, norm convention, vocabularies,
layer layout, default target layers, mask token) and what its saved ``config.json`` tells an
inference engine (``saved.<key>`` of the ``transformer_layer_config``).
"""

from __future__ import annotations

from typing import Any

from dflash_audit.model.config import DFlashConfig, default_target_layer_ids

#: transformer_layer_config keys reported as ``saved.<key>`` (same list as the adapter's).
SAVED_KEYS = ("rope_parameters", "head_dim", "num_attention_heads", "num_key_value_heads",
              "hidden_act", "rms_norm_eps", "attention_bias", "tie_word_embeddings",
              "sliding_window", "use_sliding_window", "layer_types", "vocab_size",
              "max_position_embeddings", "intermediate_size", "hidden_size")


#: The drafter's architecture fields, by the same name on every config that derives them.
ARCHITECTURE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
                       "attention_bias", "max_position_embeddings")


def architecture_fields(config: Any) -> dict[str, Any]:
    """``{name: config.<name>}`` for :data:`ARCHITECTURE_FIELDS` (a DFlashConfig, or a
    framework's draft config): the first fields of a derived-config record."""
    return {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}


def rotary_fields(rotary: Any) -> dict[str, Any]:
    """``rotary_dim`` (2 x the inverse frequencies) and ``rope_attention_scaling`` of a
    transformers rotary embedding module (``inv_freq`` [rotary_dim / 2] buffer,
    ``attention_scaling`` float): what a framework's draft actually rotates with."""
    return {"rotary_dim": 2 * int(rotary.inv_freq.numel()),
            "rope_attention_scaling": float(rotary.attention_scaling)}


def rope_fields(rope: dict[str, Any], rotary: Any, default_theta: float | None = None
                ) -> dict[str, Any]:
    """The derived-config record's RoPE fields from a framework draft's ``rope_parameters``
    dict (``rope_theta``, else ``default_theta``; ``rope_type`` default "default";
    ``partial_rotary_factor``; the rest as ``rope_scaling``) and its rotary module
    (:func:`rotary_fields`)."""
    return {"rope_theta": float(rope.get("rope_theta", default_theta)),
            "rope_type": rope.get("rope_type", "default"),
            "rope_partial_rotary_factor": rope.get("partial_rotary_factor"),
            "rope_scaling": {k: v for k, v in rope.items()
                             if k not in ("rope_type", "rope_theta", "partial_rotary_factor")},
            **rotary_fields(rotary)}


def derivation_fields(config: DFlashConfig) -> dict[str, Any]:
    """The flat derivation dict of one of our drafter configs.

    ``rotary_dim`` is the number of features per head our draft layers rotate
    (2 * len(inv_freq)); ``verifier_norm`` is ``"x*(1+w)"`` or ``"x*w"``;
    ``default_target_layer_ids`` is the reference's own default ``[2, N//2, N-3]`` for the
    verifier depth N (None when N is too shallow for it).
    """
    from dflash_audit.model.checkpoint import reference_config
    from dflash_audit.model.layers import rope_inverse_frequencies

    inv_freq, scaling = rope_inverse_frequencies(config)
    params = dict(config.rope_parameters or {})
    try:
        default_ids = default_target_layer_ids(config.num_verifier_layers, style="speculators")
    except ValueError:
        default_ids = None
    layer_types = list(config.effective_layer_types)
    saved = reference_config(config, None)["transformer_layer_config"]
    return {
        **architecture_fields(config),
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size, "target_vocab_size": config.vocab_size,
        "layer_types": layer_types,
        "sliding_window": config.sliding_window if "sliding_attention" in layer_types else None,
        "rope_theta": float(config.rope_theta),
        "rope_type": params.get("rope_type", "default"),
        "rope_partial_rotary_factor": params.get("partial_rotary_factor"),
        "rope_scaling": {k: v for k, v in params.items()
                         if k not in ("rope_type", "partial_rotary_factor")},
        "rotary_dim": 2 * int(inv_freq.numel()),
        "rope_attention_scaling": float(scaling),
        "verifier_norm": "x*(1+w)" if config.verifier_norm_one_plus_weight else "x*w",
        "default_target_layer_ids": default_ids,
        "mask_token_id": config.mask_token_id,
        **{f"saved.{k}": saved.get(k) for k in SAVED_KEYS},
    }


def rederive(verifier_config: Any, config: DFlashConfig) -> DFlashConfig:
    """Our drafter config derived from ``verifier_config`` with the drafter-only fields
    (draft layers and layout, block size, target layers, mask token, draft vocabulary) of
    ``config``: what :meth:`DFlashConfig.from_verifier_config` makes of that verifier.

    Raises:
        ConfigError: an invalid resulting field.
    """
    return DFlashConfig.from_verifier_config(
        verifier_config, target_layer_ids=config.target_layer_ids,
        mask_token_id=config.mask_token_id, num_hidden_layers=config.num_hidden_layers,
        block_size=config.block_size, draft_vocab_size=config.draft_vocab_size,
        layer_types=config.layer_types, sliding_window=config.sliding_window,
        sliding_window_non_causal=config.sliding_window_non_causal,
        sample_from_anchor=config.sample_from_anchor)
