"""Hypotheses about the draft layers' internals, for a draft-logits difference.

A candidate's context, masks and targets can all conform while its draft layers compute
something else: a hard-coded RoPE theta or norm eps, another activation, the attention scale,
grouped-query heads tiled instead of interleaved, a norm or a residual left out, the context
normed again per layer, a correct boolean mask misused by the attention (added to the scores
as numbers, not passed, wrong sign, transposed, broadcast over the wrong dimension). Each
hypothesis here is one such slip, expressed as an edit of our own drafter
(:class:`dflash_audit.model.drafter.DFlashDrafter`, whose layers mirror the reference's Qwen3
draft layer, speculators ``models/dflash/model_definitions.py``). The diagnosis replays our
drafter with the edit and names the slip when the replay reproduces the candidate's logits.

A hypothesis is ``(label, kwargs)``; kwargs are those of :func:`dflash_audit.audit.replay.replay.replay`:
``config`` (a changed constant), ``weights`` (a rearranged state dict) or ``edit`` (a function
that changes modules of the built drafter in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter

#: Values implementations hard-code instead of reading the verifier's config: RoPE theta of
#: Llama 2 / SmolLM / Llama 3 / Qwen 3, RMSNorm eps of Llama / Qwen, common activations.
COMMON_ROPE_THETAS = (10_000.0, 100_000.0, 500_000.0, 1_000_000.0)
COMMON_NORM_EPS = (1e-5, 1e-6)
COMMON_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")

Hypothesis = tuple[str, dict[str, Any]]


def constant_hypotheses(c: DFlashConfig) -> Iterator[Hypothesis]:
    """Another RoPE theta, RMSNorm eps or activation than the verifier's; RoPE scaling ignored,
    alone or with another theta (a draft config class's defaults, e.g. ModelOpt's
    ``rope_theta`` 10000 without the verifier's llama3 scaling)."""
    for theta in COMMON_ROPE_THETAS:
        if theta != c.rope_theta:
            yield (f"RoPE theta {theta:g} in the draft layers, not the verifier's rope_theta",
                   {"config": c.replace(rope_theta=theta)})
    rope_type = (c.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        yield (f"RoPE scaling ignored: default rotary frequencies where the verifier uses "
               f"rope_type {rope_type!r}"), {"config": c.replace(rope_parameters=None)}
        for theta in COMMON_ROPE_THETAS:  # a draft config class's own RoPE defaults
            if theta != c.rope_theta:
                yield (f"RoPE theta {theta:g} and no scaling in the draft layers (rope_type "
                       f"'default' where the verifier uses {rope_type!r}): the draft config's "
                       "own defaults, not the verifier's rope_parameters"),\
                    {"config": c.replace(rope_theta=theta, rope_parameters=None)}
    for eps in COMMON_NORM_EPS:
        if eps != c.rms_norm_eps:
            yield (f"RMSNorm eps {eps:g} in the drafter's norms, not the verifier's "
                   "rms_norm_eps"), {"config": c.replace(rms_norm_eps=eps)}
    for act in COMMON_ACTIVATIONS:
        if act != c.hidden_act:
            yield (f"MLP activation {act!r}; the verifier's hidden_act is {c.hidden_act!r}",
                   {"config": c.replace(hidden_act=act)})


def _each_layer(edit: Callable[[nn.Module], nn.Module | None]) -> Callable[[DFlashDrafter], None]:
    """An edit of every decoder layer: ``edit(layer)`` changes it in place or returns a
    replacement."""
    def apply(model: DFlashDrafter) -> None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = edit(layer) or layer
    return apply


def _replace(make: Callable[[nn.Module, nn.Module], nn.Module], *paths: str
             ) -> Callable[[DFlashDrafter], None]:
    """Replace submodules ``paths`` (e.g. "self_attn.k_norm") of every layer by
    ``make(old, layer)``."""
    def edit(layer):
        for path in paths:
            parent, _, name = path.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            setattr(owner, name, make(getattr(owner, name), layer))
    return _each_layer(edit)


def _identity(old: nn.Module, layer: nn.Module) -> nn.Module:
    return nn.Identity()


def _set_scaling(scale: float) -> Callable[[DFlashDrafter], None]:
    return _each_layer(lambda layer: setattr(layer.self_attn, "scaling", scale))


def interleaved_rope_weights(c: DFlashConfig, weights: dict[str, torch.Tensor]
                             ) -> dict[str, torch.Tensor]:
    """The case's weights with each head's query / key features reordered so that our RoPE
    (``rotate_half``: feature i pairs with i + d/2, the reference's Qwen3 layout) computes
    what RoPE on interleaved pairs (x0,x1),(x2,x3)... (GPT-J / Meta layout) computes with the
    original weights: feature j of the new layout is feature P[j] = 2j (j < d/2) or
    2(j - d/2) + 1 of the old. q·k is invariant under one permutation of both, RMSNorm's
    scale under any; q_proj / k_proj rows and the q_norm / k_norm gains move with it."""
    hd = c.head_dim
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    out = dict(weights)
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}.self_attn."
        for proj, heads in (("q_proj", c.num_attention_heads), ("k_proj", c.num_key_value_heads)):
            rows = (torch.arange(heads)[:, None] * hd + perm[None]).reshape(-1)
            for kind in ("weight", "bias"):
                key = f"{p}{proj}.{kind}"
                if key in weights:
                    out[key] = weights[key][rows]
        for norm in ("q_norm", "k_norm"):
            out[f"{p}{norm}.weight"] = weights[f"{p}{norm}.weight"][perm]
    return out


def weight_hypotheses(c: DFlashConfig, weights: dict[str, torch.Tensor]) -> Iterator[Hypothesis]:
    """Weights read in another layout: RoPE on interleaved pairs, tiled grouped-query heads,
    MLP gate / up swapped."""
    yield ("RoPE applied to interleaved pairs (x0,x1),(x2,x3)... (GPT-J / Meta layout) in the "
           "draft layers, where the reference rotates halves (rotate_half: x_i with "
           "x_(i+head_dim/2))"), {"weights": interleaved_rope_weights(c, weights)}
    if 1 < c.num_key_value_heads < c.num_attention_heads:
        yield ("grouped-query attention: key/value heads tiled (query head h reads kv head "
               "h % n_kv, Tensor.repeat) instead of grouped (kv head h // group, "
               "repeat_interleave)"), {"weights": tiled_gqa_weights(c, weights)}
    swapped = dict(weights)
    for i in range(c.num_hidden_layers):
        gate, up = f"layers.{i}.mlp.gate_proj.weight", f"layers.{i}.mlp.up_proj.weight"
        swapped[gate], swapped[up] = weights[up], weights[gate]
    yield "MLP gate_proj and up_proj swapped: act(up(x)) * gate(x)", {"weights": swapped}


def tiled_gqa_weights(c: DFlashConfig, weights: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """The case's weights with query heads reordered so that our grouped layout (query head
    p reads kv head p // g) computes what the tiled layout (query head h reads kv head
    h % n_kv) computes with the original weights: q_proj rows and o_proj columns of head h
    move to a position p with p // g == h % n_kv."""
    n_kv, hd = c.num_key_value_heads, c.head_dim
    g = c.num_attention_heads // n_kv
    order = torch.tensor([kv + j * n_kv for kv in range(n_kv) for j in range(g)])
    rows = (order[:, None] * hd + torch.arange(hd)).reshape(-1)
    out = dict(weights)
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}.self_attn."
        out[p + "q_proj.weight"] = weights[p + "q_proj.weight"][rows]
        if p + "q_proj.bias" in weights:
            out[p + "q_proj.bias"] = weights[p + "q_proj.bias"][rows]
        out[p + "o_proj.weight"] = weights[p + "o_proj.weight"][:, rows]
    return out


class SuffixOnly(nn.Module):
    """Applies a module to positions ``start:`` of axis 1 and passes the rest through."""

    def __init__(self, module: nn.Module, start: int):
        super().__init__()
        self.module, self.start = module, start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :self.start], self.module(x[:, self.start:])], 1)


class ContextNormedPerLayer(nn.Module):
    """A draft attention whose context goes through its layer's input_layernorm first."""

    def __init__(self, attention: nn.Module, norm: nn.Module):
        super().__init__()
        self.attention, self.norm = attention, norm

    def forward(self, x, context, cos, sin, mask):
        return self.attention(x, self.norm(context), cos, sin, mask)


class Residuals(nn.Module):
    """A pre-norm decoder layer with either residual connection optionally left out."""

    def __init__(self, layer: nn.Module, attention: bool, mlp: bool):
        super().__init__()
        self.layer, self.attention, self.mlp = layer, attention, mlp

    def forward(self, x, context, cos, sin, mask):
        la = self.layer
        a = la.self_attn(la.input_layernorm(x), context, cos, sin, mask)
        x = x + a if self.attention else a
        m = la.mlp(la.post_attention_layernorm(x))
        return x + m if self.mlp else m


def attention_hypotheses(c: DFlashConfig, context_len: int) -> Iterator[Hypothesis]:
    """Attention scale; q_norm / k_norm left out or k_norm on the noise-block keys only."""
    H, hd = c.hidden_size, c.head_dim
    for scale, label in ((H**-0.5, "1/sqrt(hidden_size)"), (1.0, "1 (no scaling)"),
                         (1.0 / hd, "1/head_dim")):
        yield (f"attention scale {label} instead of 1/sqrt(head_dim)",
               {"edit": _set_scaling(scale)})
    for names in (("q_norm", "k_norm"), ("q_norm",), ("k_norm",)):
        yield f"{' and '.join(names)} missing in the draft attention", {
            "edit": _replace(_identity, *(f"self_attn.{n}" for n in names))}
    yield ("k_norm applied to the noise-block keys only, not to the context keys", {
        "edit": _replace(lambda old, layer: SuffixOnly(old, context_len), "self_attn.k_norm")})


def _scale_embeddings(model: DFlashDrafter) -> None:
    scale = model.config.hidden_size ** 0.5
    model.embed_tokens.register_forward_hook(lambda module, args, out: out * scale)


def layer_hypotheses() -> Iterator[Hypothesis]:
    """Norms and residuals of the decoder layers, the final norm, and the noise embedding."""
    yield ("final norm missing: logits = lm_head(x) without the drafter's norm",
           {"edit": lambda model: setattr(model, "norm", nn.Identity())})
    yield ("noise-block embeddings multiplied by sqrt(hidden_size) (Gemma's embedding "
           "normalizer); the reference's drafter uses the verifier's embedding unscaled",
           {"edit": _scale_embeddings})
    for name in ("input_layernorm", "post_attention_layernorm"):
        yield f"{name} missing in the draft layers", {"edit": _replace(_identity, name)}
    yield ("the context normed again in each draft layer (by its input_layernorm); the "
           "reference computes hidden_norm(fc(hidden_states)) once and shares it", {
               "edit": _replace(lambda old, layer: ContextNormedPerLayer(
                   old, layer.input_layernorm), "self_attn")})
    for attention, mlp, label in ((False, True, "attention"), (True, False, "MLP")):
        yield (f"residual connection around the {label} missing in the draft layers",
               {"edit": _each_layer(lambda la, a=attention, m=mlp: Residuals(la, a, m))})


class MaskMisuse(nn.Module):
    """A draft attention given the correct boolean mask [Q, T+Q] but passing ``use(mask)`` to
    its scaled-dot-product attention (a float mask there is added to the scores)."""

    def __init__(self, attention: nn.Module, use: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.attention, self.use = attention, use

    def forward(self, x, context, cos, sin, mask):
        return self.attention(x, context, cos, sin, self.use(mask))


def _noise_transposed(mask: torch.Tensor) -> torch.Tensor:
    T = mask.shape[1] - mask.shape[0]
    return torch.cat([mask[:, :T], mask[:, T:].T], 1)


#: (label, what the attention is given instead of the boolean mask): a boolean mask used as
#: numbers, no mask, an additive mask of the wrong sign, the noise block's part transposed,
#: the first query's row broadcast to every query.
MASK_MISUSES: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...] = (
    ("attention ignores the mask: the boolean mask is added to the scores (True becomes +1, "
     "nothing is masked)", lambda m: m.float()),
    ("attention ignores the mask: no mask is passed to the draft attention",
     lambda m: torch.ones_like(m)),
    ("attention mask with the wrong sign: the allowed positions get the large negative bias, "
     "the masked ones 0", lambda m: m.float() * -1e9),
    ("attention mask transposed: the noise-block part read as [kv, q] instead of [q, kv]",
     _noise_transposed),
    ("attention mask broadcast over the wrong dimension: every query uses the first query's "
     "mask row", lambda m: m[:1].expand_as(m)),
)


def mask_misuse_hypotheses() -> Iterator[Hypothesis]:
    """The draft attention misusing a correct mask (:data:`MASK_MISUSES`)."""
    for label, use in MASK_MISUSES:
        yield label, {"edit": _replace(lambda old, layer, use=use: MaskMisuse(old, use),
                                       "self_attn")}


def architecture_hypotheses(c: DFlashConfig, weights: dict[str, torch.Tensor],
                            context_len: int) -> Iterator[Hypothesis]:
    """Every draft-layer slip above, constants first.

    Args:
        c: the case's drafter config.
        weights: the case's state dict (reference keys).
        context_len: T, the packed length (keys ``:T`` are the context, ``T:`` the noise block).
    """
    yield from constant_hypotheses(c)
    yield from weight_hypotheses(c, weights)
    yield from attention_hypotheses(c, context_len)
    yield from layer_hypotheses()
