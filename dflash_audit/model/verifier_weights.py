"""Frozen verifier-owned weights of the drafter, taken from a Hugging Face verifier.

``embed_tokens`` <- the verifier's input embedding [V,H]; ``lm_head`` and
``verifier_lm_head`` <- its output head (the tied embedding when it has none), rows
selected by ``t2d`` for a draft vocabulary [V_d,H]; ``verifier_norm`` <- its final norm
weight [H] (kept raw: the drafter's norm applies ``1 + w`` itself for Gemma-style
families). Semantics as in speculators ``model.py: DraftVocabMixin._load_verifier_weights``.
"""

from __future__ import annotations

import torch
from torch import nn


def final_norm(verifier: nn.Module) -> nn.Module:
    """The verifier's final norm module (``model.norm`` for Llama/Qwen/Gemma-style LMs).

    Raises:
        ValueError: the verifier has no recognisable final norm.
    """
    base = getattr(verifier, "model", verifier)
    for name in ("norm", "final_layernorm", "ln_f"):
        module = getattr(base, name, None)
        if module is not None and hasattr(module, "weight"):
            return module
    raise ValueError(f"{type(verifier).__name__} has no final norm (model.norm); cannot take "
                     "verifier_norm.weight from it")


def verifier_state(verifier: nn.Module, t2d: torch.Tensor | None = None
                   ) -> dict[str, torch.Tensor]:
    """State-dict entries (reference key names) that come from the verifier.

    Args:
        verifier: a transformers causal LM (``get_input_embeddings``/``get_output_embeddings``).
        t2d: bool [V] draft-vocabulary membership, or None for the full vocabulary.

    Returns:
        {"embed_tokens.weight": [V,H], "lm_head.weight": [V_d,H],
         "verifier_lm_head.weight": [V_d,H], "verifier_norm.weight": [H]}, fp32 copies.
    """
    embed = verifier.get_input_embeddings().weight.detach().float()
    head_module = verifier.get_output_embeddings()
    head = head_module.weight.detach().float() if head_module is not None else embed
    if t2d is not None:
        head = head[t2d.bool()]
    norm = final_norm(verifier).weight.detach().float()
    return {"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone(),
            "verifier_lm_head.weight": head.clone(), "verifier_norm.weight": norm.clone()}


def load_verifier_weights(model: nn.Module, verifier: nn.Module) -> None:
    """Copy the verifier-owned weights into a drafter in place (keeps them frozen).

    Raises:
        ValueError: shapes do not match (wrong verifier for this drafter config).
    """
    t2d = getattr(model, "t2d", None)
    state = verifier_state(verifier, t2d)
    own = model.state_dict()
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise ValueError(f"{key}: verifier gives {tuple(value.shape)}, drafter expects "
                             f"{tuple(own[key].shape)} (is this the drafter's verifier?)")
    model.load_state_dict(state, strict=False)
