"""Building blocks of the draft decoder: RMSNorm, rotary embedding, attention, MLP.

Plain Qwen3-style blocks (the reference's draft layer is a Qwen3 decoder layer whose keys
and values also cover the verifier context; speculators ``models/dflash/model_definitions.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from dflash_audit.model.config import DFlashConfig


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in fp32: ``x / rms(x) * g``.

    ``one_plus_weight=True`` uses the gain ``1 + w`` (Gemma / Qwen3.5 final norms), so a
    verifier's raw norm weight loads unchanged. Parameter name: ``weight`` [dim].
    """

    def __init__(self, dim: int, eps: float = 1e-6, one_plus_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.one_plus_weight = one_plus_weight
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus_weight else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus_weight:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] fp32 and the attention scaling of the configured RoPE.

    ``default`` RoPE: ``theta^(-2i/d)`` with d = head_dim (RoFormer, Su et al. 2021). The
    draft layer rotates the whole head, like the reference's Qwen3 draft layer, which ignores
    a verifier's ``partial_rotary_factor`` (transformers 5 ``Qwen3RotaryEmbedding``). Other
    rope types (linear, dynamic, yarn, llama3, ...) are delegated to transformers'
    ``ROPE_INIT_FUNCTIONS`` so scaling variants match the library the reference uses.
    """
    params = dict(config.rope_parameters or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        d = config.head_dim
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return inv, 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_theta": config.rope_theta, **params, "rope_type": rope_type},
    )
    return ROPE_INIT_FUNCTIONS[rope_type](hf, None)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for integer positions. Buffer ``inv_freq`` is not persistent."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        # on the meta device (a replay's drafter) computed on the CPU: meta tensors hold no
        # values, and meta arithmetic runs torch's Python reference ops (and imports dynamo)
        meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if meta else contextlib.nullcontext():
            inv_freq, self.attention_scaling = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq.to("meta") if meta else inv_freq,
                             persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids [1, L] int64 -> (cos, sin), each [1, L, head_dim] in ``dtype``."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [1, L, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, heads, L, head_dim], cos/sin [1, L, r] -> x with its first r features rotated by
    their positions (r = head_dim for our drafter; a smaller r models partial rotary)."""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


class DraftAttention(nn.Module):
    """Attention whose queries come from the noise block and whose keys/values come from
    ``[context ; noise]``. Parameters: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.scaling = hd**-0.5  # softmax(q.k * head_dim^-0.5), DESIGN.md sec. 3

    def forward(self, x, context, cos, sin, mask):
        """x [1,Q,H] noise (normed), context [1,T,H], cos/sin [1,T+Q,head_dim],
        mask: bool [Q,T+Q] (SDPA) or a flex BlockMask. Returns [1,Q,H]."""
        Q, T = x.shape[1], context.shape[1]
        kv_in = torch.cat([context, x], dim=1)  # [1, T+Q, H]
        q = self.q_norm(self.q_proj(x).view(1, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(1, T + Q, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(1, T + Q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, T:], sin[:, T:])
        k = apply_rope(k, cos, sin)
        if isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[None, None], scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads)
        else:  # flex attention BlockMask (CUDA)
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, block_mask=mask, scale=self.scaling,
                                 enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(1, Q, -1))


def activation(name: str) -> nn.Module:
    """The activation ``hidden_act`` names, as transformers' ``ACT2FN`` builds it; ``silu`` /
    ``swish`` (every Llama, Qwen and Mistral verifier) as ``nn.SiLU``, the same
    ``F.silu`` without importing ``transformers.activations`` (~2 s: it pulls in
    ``torch._dynamo``), which a diagnosis's replays would otherwise pay for."""
    if name in ("silu", "swish"):
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; the context is read by attention, never modified."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
