"""Bug: RoPE applied to interleaved pairs (x0,x1),(x2,x3)... in the draft layers.

GPT-J / Meta's original Llama code rotate adjacent feature pairs; Hugging Face's Llama / Qwen3
(and the reference's Qwen3 draft layer, speculators ``models/dflash/model_definitions.py``)
rotate halves: feature i pairs with i + head_dim/2 (``rotate_half``). A drafter that takes the
interleaved layout trains another positional code than the one the reference (and vLLM)
apply to its weights.

Expected audit result: ``logits`` fails with "RoPE applied to interleaved pairs (x0,x1),(x2,x3)
... where the reference rotates halves"; context, masks and targets pass.

Run: ``dflash-audit compare --candidate examples/candidates/rope_interleaved.py:candidate``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.layers import DraftAttention


def rope_interleaved(x, cos, sin):
    """x [1, heads, L, d], cos/sin [1, L, d] in the rotate_half layout (frequency i at i and
    i + d/2) -> x with pairs (x_2i, x_2i+1) rotated by frequency i."""
    d = x.shape[-1]
    c = cos[:, None, :, : d // 2].repeat_interleave(2, -1)
    s = sin[:, None, :, : d // 2].repeat_interleave(2, -1)
    pairs = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
    return x * c + pairs * s


class InterleavedRopeAttention(DraftAttention):
    """The draft attention with RoPE on interleaved pairs (everything else unchanged)."""

    def forward(self, x, context, cos, sin, mask):
        Q, T = x.shape[1], context.shape[1]
        kv_in = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(1, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(1, T + Q, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(1, T + Q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = rope_interleaved(q, cos[:, T:], sin[:, T:])
        k = rope_interleaved(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None],
                                             scale=self.scaling,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(1, Q, -1))


class InterleavedRopeDrafter(DFlashDrafter):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn.__class__ = InterleavedRopeAttention


class InterleavedRopeCandidate(DrafterCandidate):
    name = "bug: RoPE on interleaved pairs in the draft layers"

    def build(self, config):
        return InterleavedRopeDrafter(config)


candidate = InterleavedRopeCandidate()
