"""What an audit case means in NVIDIA ModelOpt 0.47.0's own terms: its ``DFlashConfig``
settings for ``modelopt.torch.speculative.convert(base, [("dflash", settings)])``, its layer
ids, its offline base model, and its own drafter-config derivation (``HFDFlashModel.modify``).

Everything that ModelOpt cannot express raises :class:`NotSupported` naming the field; nothing
is approximated silently. Citations are to the ``nvidia-modelopt==0.47.0`` wheel
(``modelopt/torch/speculative/...``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION, DFlashConfig
from dflash_audit.model.derivation import SAVED_KEYS, architecture_fields, rope_fields
from dflash_audit.model.layer_ids import from_zlab_ids, to_zlab_ids
from dflash_audit.model.loss import LossSpec, parse_loss

NAME, VERSION = "NVIDIA ModelOpt", "0.47.0"
#: The profile's loss -> ``dflash_self_logit_distillation`` (config.py:100). True: soft
#: cross-entropy against ModelOpt's teacher softmax(base logits at a+s-1) (hf_dflash.py:
#: 846-857), the KL gradient with a value larger by the teacher's entropy; False: hard
#: cross-entropy against the data token input_ids[a+s] (hf_dflash.py:785-792, 859).
LOSS_MODES = {"kl_div": True, "ce": False, "ce-data": False}
#: The profile's weighting -> ``dflash_loss_objective`` (config.py:111).
WEIGHTING_OBJECTIVES = {"fixed-exp-decay": "decay", "dpace": "dpace", "none": "decay"}


class NotSupported(ValueError):
    """A case ModelOpt cannot train as the profile says (the message names the field)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"not supported by {NAME} {VERSION}: {what}")


def modelopt_layer_ids(config: DFlashConfig) -> list[int]:
    """ModelOpt's ``target_layer_ids`` for a case: z-lab convention (ModelOpt id k reads HF
    ``hidden_states[k + 1]``, hf_dflash.py:982-984, = speculators id k + 1), exactly one per
    draft layer, distinct, ascending, non-negative (hf_dflash.py:455-478).

    Raises:
        NotSupported: the case's ids are not one per draft layer, or include speculators id 0
            (the embeddings, ModelOpt id -1).
    """
    ids = to_zlab_ids(config.target_layer_ids)
    if len(ids) != config.num_hidden_layers:
        raise NotSupported(
            f"{len(ids)} target layers {list(config.target_layer_ids)} for "
            f"{config.num_hidden_layers} draft layer(s): ModelOpt requires exactly one target "
            "layer per draft layer (hf_dflash.py:457-462)")
    if min(ids) < 0:
        raise NotSupported("target layer 0 (the embeddings, HF hidden_states[0]) has no "
                           "ModelOpt id: its ids are z-lab ids k >= 0 reading hidden_states[k+1]")
    return ids


def attention_settings(config: DFlashConfig) -> dict[str, Any]:
    """``dflash_swa_window_size`` / ``dflash_draft_attention`` (config.py:152-184) for the
    case's layer layout: ModelOpt builds ONE mask for all layers (hf_dflash.py:1027-1035), so
    every layer full (no window, bidirectional block) or every layer sliding (window W on all
    layers; causal block unless ``sliding_window_non_causal``).

    Raises:
        NotSupported: a mixed layout, or a window smaller than the block (config.py:288-293).
    """
    types = set(config.effective_layer_types)
    if types == {FULL_ATTENTION}:
        return {"dflash_swa_window_size": None, "dflash_draft_attention": "bidirectional"}
    if types != {SLIDING_ATTENTION}:
        raise NotSupported(f"layer layout {list(config.effective_layer_types)}: ModelOpt applies "
                           "one attention mask to every draft layer (window on all layers or none)")
    if config.sliding_window < config.block_size:
        raise NotSupported(f"sliding_window {config.sliding_window} < block_size "
                           f"{config.block_size} (ModelOpt requires dflash_swa_window_size >= "
                           "dflash_block_size, config.py:288-293)")
    return {"dflash_swa_window_size": int(config.sliding_window),
            "dflash_draft_attention": "bidirectional" if config.sliding_window_non_causal
            else "causal"}


def loss_term(loss: LossSpec) -> str:
    """The one loss term of the profile's ``loss`` that ModelOpt trains (a key of
    :data:`LOSS_MODES`), e.g. ``kl_div`` for ``kl_div`` or ``{"kl_div": 1.0}``.

    Raises:
        NotSupported: any other loss (several terms, or a divergence ModelOpt lacks).
    """
    name = loss.loss
    if name not in LOSS_MODES:  # a JSON mix of one term at weight 1 is that term
        try:
            terms = parse_loss(name)
        except ValueError:
            terms = {}
        name = next(iter(terms)) if list(terms.values()) == [1.0] else name
    if name not in LOSS_MODES:
        raise NotSupported(f"loss {loss.loss!r}: ModelOpt trains soft cross-entropy against its "
                           "teacher (profile loss kl_div) or hard cross-entropy against the data "
                           "token (ce / ce-data), one term (hf_dflash.py:764-870)")
    return name


def loss_settings(loss: LossSpec) -> dict[str, Any]:
    """``dflash_self_logit_distillation`` / ``dflash_loss_objective`` /
    ``dflash_loss_decay_factor`` / ``dflash_dpace_alpha`` for the profile's loss.

    Raises:
        NotSupported: a loss other than one term of :data:`LOSS_MODES`, or a weighting ModelOpt
            lacks.
    """
    name = loss_term(loss)
    if loss.weighting not in WEIGHTING_OBJECTIVES:
        raise NotSupported(f"weighting {loss.weighting!r} (ModelOpt: decay or dpace, "
                           "config.py:111)")
    return {"dflash_self_logit_distillation": LOSS_MODES[name],
            "dflash_loss_objective": WEIGHTING_OBJECTIVES[loss.weighting],
            "dflash_loss_decay_factor": 0.0 if loss.weighting == "none" else float(loss.gamma),
            "dflash_dpace_alpha": float(loss.dpace_alpha)}


def dflash_settings(config: DFlashConfig, loss: LossSpec, num_anchors: int) -> dict[str, Any]:
    """The ``("dflash", settings)`` of ``mtsp.convert`` for a case: offline training, the
    case's block size, mask token and anchor count, its layout and loss, and a
    ``dflash_architecture_config`` holding the draft depth, the ModelOpt layer ids and the
    head geometry the case's weights have (what a user must write for them to load: ModelOpt
    inherits none of it under transformers 5.19, research 3.9). RoPE, eps, activation and
    positions are left to ModelOpt's own ``modify`` (hf_dflash.py:387-446).

    Raises:
        NotSupported: see :func:`modelopt_layer_ids`, :func:`attention_settings`,
            :func:`loss_settings`; a draft vocabulary; ``sample_from_anchor``.
    """
    if config.uses_draft_vocab:
        raise NotSupported(f"draft vocabulary of {config.effective_draft_vocab_size} tokens "
                           "(ModelOpt's DFlash drafts over the base vocabulary: no t2d / d2t)")
    if config.sample_from_anchor:
        raise NotSupported("sample_from_anchor (ModelOpt teaches slot s by the teacher at "
                           "a+s-1 and never trains slot 0, hf_dflash.py:795-853)")
    architecture = {"num_hidden_layers": config.num_hidden_layers,
                    "target_layer_ids": modelopt_layer_ids(config),
                    "num_attention_heads": config.num_attention_heads,
                    "num_key_value_heads": config.num_key_value_heads,
                    "head_dim": config.head_dim, "intermediate_size": config.intermediate_size,
                    "attention_bias": config.attention_bias}
    return {"dflash_offline": True, "dflash_block_size": config.block_size,
            "dflash_num_anchors": num_anchors, "dflash_mask_token_id": config.mask_token_id,
            "dflash_use_torch_compile": False, "dflash_architecture_config": architecture,
            **attention_settings(config), **loss_settings(loss)}


def final_norm_type(model_type: str) -> str | None:
    """ModelOpt's own final-norm choice for a verifier ``model_type`` (``rmsnorm``,
    ``gemma_rmsnorm`` or None: unknown, no norm; modeling_final_norm.py:81-116)."""
    from modelopt.torch.speculative.plugins.modeling_final_norm import (
        _select_final_norm_type,
    )

    return _select_final_norm_type(model_type)


def fake_base(config: DFlashConfig, dtype: Any = None) -> Any:
    """ModelOpt's offline base model (``FakeBaseModel``, modeling_fakebase.py:75-170) for a
    case: the verifier's depth, width, vocabulary and final norm (chosen by ModelOpt from the
    verifier's model type), in ``dtype`` (torch dtype; default fp32). A bf16 case's base is
    bf16, as ModelOpt's trainer loads it: ``FakeBaseModel.from_source`` takes the checkpoint's
    dtype, bf16 when it names none (modeling_fakebase.py:200, FakeBaseConfig's default :86).

    Raises:
        NotSupported: ModelOpt knows no final norm for the verifier's model type (with a
            pre-norm last hidden state it raises, modeling_final_norm.py:119-145).
    """
    import torch
    from modelopt.torch.speculative.plugins.modeling_fakebase import (
        FakeBaseConfig,
        FakeBaseModel,
    )

    norm = final_norm_type(config.verifier_model_type)
    if norm is None:
        raise NotSupported(f"verifier model type {config.verifier_model_type!r}: ModelOpt has no "
                           "final norm for it (_FINAL_NORM_TYPE_BY_MODEL_TYPE, "
                           "modeling_final_norm.py:84-100), so it cannot rebuild the teacher "
                           "from a pre-norm last hidden state")
    return FakeBaseModel(FakeBaseConfig(
        num_hidden_layers=config.num_verifier_layers, hidden_size=config.hidden_size,
        vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
        dtype=dtype or torch.float32, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, final_norm_type=norm))


def init_rotary(model: Any) -> None:
    """The declared transformers-5.19 work-around: ``DFlashModule._maybe_init_rotary_emb``
    calls ``Qwen3RotaryEmbedding(config=..., device=...)`` (modeling_dflash.py:380-388), whose
    5.19 signature has no ``device``; it builds the module only when ``rotary_emb`` is missing,
    so the adapter builds the same module from the same config first."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    module = model.dflash_module
    if not hasattr(module, "rotary_emb"):
        module.rotary_emb = Qwen3RotaryEmbedding(config=module._rotary_config)


def convert(base: Any, settings: dict[str, Any]) -> Any:
    """``modelopt.torch.speculative.convert(base, [("dflash", settings)])`` with the rotary
    work-around applied (:func:`init_rotary`)."""
    import modelopt.torch.speculative as mtsp

    model = mtsp.convert(base, [("dflash", settings)])
    init_rotary(model)
    return model


def _fake_base_from_verifier(verifier_config: Any) -> Any:
    """ModelOpt's own ``FakeBaseModel.from_source`` on the verifier's config (saved into a
    temporary folder); its weight loading is skipped: the derivation reads only configs."""
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel

    if not hasattr(verifier_config, "save_pretrained"):
        raise NotSupported("a verifier config that transformers cannot load (ModelOpt reads "
                           "the verifier with AutoConfig.from_pretrained)")
    with tempfile.TemporaryDirectory() as tmp:
        verifier_config.save_pretrained(tmp)
        with mock.patch.object(FakeBaseModel, "_load_weights", lambda self, source: None):
            return FakeBaseModel.from_source(str(Path(tmp)))


def derive(verifier_config: Any, config: DFlashConfig, device: str = "meta") -> dict[str, Any]:
    """ModelOpt's own drafter-config derivation for ``verifier_config``: its ``modify``
    (hf_dflash.py:387-446) on the recipe's architecture config (only ``num_hidden_layers``,
    dflash.yaml:60-61) plus the case's block size, mask token and layout, read back from the
    built draft (its Qwen3Config, its rotary embedding, its base's final norm) and from its
    exporter's ``config.json`` (``DFlashExporter._export_config``, hf_spec_export.py:351-449),
    flattened like :func:`dflash_audit.model.derivation.derivation_fields`.

    The base and the draft are built on ``device``, the meta device by default: the
    derivation reads their configs and the rotary module's shape and scaling, never a weight,
    and ModelOpt's default draft (32 heads of 128, MLP width 22016) costs ~0.4 s of random
    initialisation a case on the CPU; the fields are those of a CPU build
    (tests/test_framework_modelopt.py).

    Raises:
        NotSupported: a mixed layout, or a verifier config transformers cannot load.
    """
    import torch

    settings = {"dflash_offline": True, "dflash_block_size": config.block_size,
                "dflash_mask_token_id": config.mask_token_id, "dflash_use_torch_compile": False,
                "dflash_architecture_config": {"num_hidden_layers": config.num_hidden_layers},
                **attention_settings(config)}
    with torch.device(device):
        base = _fake_base_from_verifier(verifier_config)
        model = convert(base, settings)
    draft, rotary = model.dflash_config, model.dflash_module.rotary_emb
    rope = dict(draft.rope_parameters or {})
    saved = model.get_exporter()._export_config()
    saved_rope = {"rope_type": "default", **(saved.get("rope_scaling") or {}),
                  "rope_theta": saved.get("rope_theta")}
    saved = {**saved, "rope_parameters": saved_rope}
    norm = getattr(base, "norm", None)
    window = model.dflash_swa_window_size
    layer_types = [SLIDING_ATTENTION if window else FULL_ATTENTION] * draft.num_hidden_layers
    return {
        **architecture_fields(draft),
        "tie_word_embeddings": bool(draft.tie_word_embeddings),
        "vocab_size": draft.vocab_size, "target_vocab_size": base.config.vocab_size,
        "layer_types": layer_types, "sliding_window": window,
        **rope_fields(rope, rotary),
        "verifier_norm": None if norm is None else (
            "x*(1+w)" if type(norm).__name__ == "_FinalGemmaRMSNorm" else "x*w"),
        "default_target_layer_ids": from_zlab_ids(model.target_layer_ids),
        "mask_token_id": model.mask_token_id,
        **{f"saved.{k}": saved.get(k) for k in SAVED_KEYS},
    }
