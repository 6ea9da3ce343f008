"""Weights of a real audit case: a seeded random trainable part + the verifier's real frozen
weights (embedding, LM head, final norm), under the reference's state-dict keys.

The frozen part is what the reference itself loads from the verifier
(speculators ``model.py: _load_verifier_weights``): ``embed_tokens.weight`` = the input
embedding [V,H]; ``lm_head.weight`` and ``verifier_lm_head.weight`` = the output embedding
[V,H] (rows ``t2d`` only, [V_d,H], with a draft vocabulary); ``verifier_norm.weight`` = the
final norm's weight [H]. The trainable part (fc, hidden_norm, layers, norm) is drawn from a
seeded generator, with norm gains spread around their identity so a norm applied twice or
not at all changes the numbers (same recipe as :mod:`dflash_audit.audit.synthetic`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_audit.audit.synthetic import synthetic_weights
from dflash_audit.model.config import DFlashConfig

FROZEN_KEYS = ("embed_tokens.weight", "lm_head.weight", "norm.weight")


class VerifierWeightsError(ValueError):
    """The verifier does not expose an input embedding, output embedding or final norm."""


def verifier_frozen_weights(model: Any) -> dict[str, torch.Tensor]:
    """The verifier's ``embed_tokens.weight`` [V,H], ``lm_head.weight`` [V,H] (the input
    embedding when tied or absent) and final ``norm.weight`` [H], fp32, detached.

    Args:
        model: a loaded Hugging Face causal LM.

    Raises:
        VerifierWeightsError: no input embedding, or no final norm on the decoder.
    """
    embed = model.get_input_embeddings()
    if embed is None:
        raise VerifierWeightsError(f"{type(model).__name__} has no input embedding")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    norm = getattr(decoder, "norm", None) or getattr(decoder, "final_layernorm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise VerifierWeightsError(
            f"{type(model).__name__}: cannot find the final norm (expected "
            "model.get_decoder().norm.weight); DFlash targets need the verifier's final norm")
    e = embed.weight.detach().float()
    h = head.weight.detach().float() if head is not None else e
    return {"embed_tokens.weight": e, "lm_head.weight": h,
            "norm.weight": norm.weight.detach().float()}


def save_frozen(weights: dict[str, torch.Tensor], path: Path) -> Path:
    """Save :func:`verifier_frozen_weights` output; a tied LM head is stored once."""
    tied = weights["lm_head.weight"].data_ptr() == weights["embed_tokens.weight"].data_ptr() or (
        torch.equal(weights["lm_head.weight"], weights["embed_tokens.weight"]))
    tensors = {k: v.contiguous() for k, v in weights.items()
               if not (tied and k == "lm_head.weight")}
    save_file(tensors, path, metadata={"tied_lm_head": str(tied)})
    return path


def load_frozen(path: Path) -> dict[str, torch.Tensor]:
    """Inverse of :func:`save_frozen`."""
    tensors = load_file(path)
    tensors.setdefault("lm_head.weight", tensors["embed_tokens.weight"])
    return tensors


def draft_vocab_mapping(token_ids: list[torch.Tensor], vocab_size: int, draft_vocab_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocabulary of the ``draft_vocab_size`` most frequent tokens in the data (ties
    and unseen ids by ascending id), in the reference's convention.

    Returns:
        ``t2d`` bool [V] (True for verifier ids in the draft vocab) and ``d2t`` int64 [V_d]
        offsets (verifier id = i + d2t[i]).
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_ids:
        flat = ids.flatten().long()
        counts += torch.bincount(flat[(flat >= 0) & (flat < vocab_size)], minlength=vocab_size)
    # stable sort by descending count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    ids = order.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return t2d, ids - torch.arange(draft_vocab_size)


def real_case_weights(config: DFlashConfig, frozen: dict[str, torch.Tensor], seed: int,
                      token_ids: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A full drafter state dict (reference keys): trainable part from ``seed``, frozen part
    from the verifier (see module docstring).

    Args:
        config: the drafter config (dimensions must match the verifier's).
        frozen: :func:`verifier_frozen_weights` of the verifier.
        seed: seeds the trainable part.
        token_ids: the data's ``input_ids``; picks the draft vocabulary when
            ``config.uses_draft_vocab``.

    Raises:
        VerifierWeightsError: the frozen weights do not have the config's shapes.
    """
    V, H = config.vocab_size, config.hidden_size
    embed, head, norm = (frozen[k] for k in FROZEN_KEYS)
    if tuple(embed.shape) != (V, H) or tuple(head.shape) != (V, H) or tuple(norm.shape) != (H,):
        raise VerifierWeightsError(
            f"verifier weights embed {tuple(embed.shape)}, lm_head {tuple(head.shape)}, norm "
            f"{tuple(norm.shape)} do not match the drafter config (V={V}, H={H})")
    weights = synthetic_weights(config, torch.Generator().manual_seed(seed))
    weights["embed_tokens.weight"] = embed
    if config.uses_draft_vocab:
        t2d, d2t = draft_vocab_mapping(token_ids or [], V, config.effective_draft_vocab_size)
        weights["t2d"], weights["d2t"] = t2d, d2t
        head = head[t2d]
    # distinct storage per key: safetensors refuses to save tensors that share memory
    weights["lm_head.weight"] = head.clone()
    weights["verifier_lm_head.weight"] = head.clone()
    weights["verifier_norm.weight"] = norm.clone()
    return weights
