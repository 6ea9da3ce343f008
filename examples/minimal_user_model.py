"""Worked example: adapting your own DFlash drafter to the dflash-audit candidate protocol.

``TinyDFlash`` stands for a user's implementation: written from scratch, with its own internal
names (``aux_proj`` for ``fc``, ``blocks`` for ``layers``, ``teacher_head`` for
``verifier_lm_head``...), full-attention layers only and a KL loss with exponential decay.
``TinyDFlashCandidate`` (the part between the README markers) is all the audit needs: build
the model from the profile, load the reference-named state dict, run one step on the batch
and the injected anchors, and return the outputs under the reference's names.

Run: ``dflash-audit compare --candidate examples/minimal_user_model.py:TinyDFlashCandidate``
(with a full-attention, kl_div, fixed-exp-decay profile, e.g. the z-lab style one).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn


# ================================================================== the user's own model
class RMS(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(x, cos, sin):  # x [1, heads, L, hd]; cos/sin [L, hd]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Block(nn.Module):
    def __init__(self, d, n_heads, n_kv, hd, d_ff, eps):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, hd
        self.wq = nn.Linear(d, n_heads * hd, bias=False)
        self.wo = nn.Linear(n_heads * hd, d, bias=False)
        self.wk, self.wv = nn.Linear(d, n_kv * hd, bias=False), nn.Linear(d, n_kv * hd, bias=False)
        self.q_ln, self.k_ln = RMS(hd, eps), RMS(hd, eps)
        self.ln1, self.ln2 = RMS(d, eps), RMS(d, eps)
        self.w1, self.w3 = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)

    def attend(self, x, ctx, cos, sin, allowed):
        Q, T = x.shape[1], ctx.shape[1]
        kv = torch.cat([ctx, x], 1)
        q = self.q_ln(self.wq(x).view(1, Q, self.n_heads, self.hd)).transpose(1, 2)
        k = self.k_ln(self.wk(kv).view(1, T + Q, self.n_kv, self.hd)).transpose(1, 2)
        v = self.wv(kv).view(1, T + Q, self.n_kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos[T:], sin[T:]), rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) * self.hd**-0.5
        p = scores.masked_fill(~allowed, float("-inf")).softmax(-1, dtype=torch.float32)
        return self.wo((p.to(v.dtype) @ v).transpose(1, 2).reshape(1, Q, -1))

    def forward(self, x, ctx, cos, sin, allowed):
        x = x + self.attend(self.ln1(x), ctx, cos, sin, allowed)
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyDFlash(nn.Module):
    """A from-scratch DFlash drafter: full-attention layers, bidirectional blocks."""

    def __init__(self, d, n_heads, n_kv, hd, d_ff, n_layers, vocab, draft_vocab, n_aux, block,
                 mask_id, eps=1e-6, theta=1e6):
        super().__init__()
        self.block, self.mask_id, self.hd, self.theta = block, mask_id, hd, theta
        self.aux_proj, self.aux_norm = nn.Linear(n_aux * d, d, bias=False), RMS(d, eps)
        self.blocks = nn.ModuleList(Block(d, n_heads, n_kv, hd, d_ff, eps) for _ in range(n_layers))
        self.out_norm, self.head = RMS(d, eps), nn.Linear(d, draft_vocab, bias=False)
        self.tok_emb = nn.Embedding(vocab, d)
        self.teacher_norm, self.teacher_head = RMS(d, eps), nn.Linear(d, draft_vocab, bias=False)
        for frozen in (self.tok_emb, self.teacher_norm, self.teacher_head, self.head):
            frozen.requires_grad_(False)

    def mask(self, doc, anchors, T):
        """[Q, T+Q] bool: same document and strictly before the anchor; own block."""
        B = self.block
        qa = anchors.repeat_interleave(B)[:, None]
        ctx = (doc[None, :] == doc[qa]) & (doc[qa] != -1) & (torch.arange(T)[None, :] < qa)
        q = torch.arange(qa.shape[0])
        return torch.cat([ctx, (q[None, :] // B) == (q[:, None] // B)], 1)

    def forward(self, feats, tokens, verifier_last, doc, pos, anchors):
        B, T = self.block, feats.shape[1]
        ctx = self.aux_norm(self.aux_proj(feats))
        slots = (anchors[:, None] + torch.arange(B)).reshape(-1)  # a + s
        noise = torch.full((anchors.numel(), B), self.mask_id)
        noise[:, 0] = tokens[0, anchors]
        x = self.tok_emb(noise.reshape(1, -1))
        all_pos = torch.cat([pos[0], (pos[0, anchors][:, None] + torch.arange(B)).reshape(-1)])
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2).float() / self.hd)
        ang = all_pos[:, None].float() * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        allowed = self.mask(doc[0], anchors, T)
        for blk in self.blocks:
            x = blk(x, ctx, cos, sin, allowed)
        logits = self.head(self.out_norm(x))
        with torch.no_grad():  # the verifier's prediction at a+s-1 teaches slot s
            teacher = self.teacher_head(self.teacher_norm(verifier_last[:, (slots - 1) % T]))
        return ctx, allowed, logits, teacher, slots


def kl_decay_loss(logits, teacher, supervised, block, gamma):
    """sum_slots KL(teacher || draft) * exp(-(s-1)/gamma) / number of supervised slots."""
    logq, logp = logits.float().log_softmax(-1), teacher.float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1) * supervised
    s = torch.arange(supervised.shape[-1]) % block
    w = torch.where(s == 0, 0.0, torch.exp(-(s - 1) / gamma))[None]
    return (kl * w).sum() / (supervised.sum() + 1e-5), w


# --- README snippet start ----------------------------------------------------------------
from dflash_audit.audit.case import SideOutputs  # noqa: E402
from dflash_audit.model.metrics import dflash_metrics  # noqa: E402

# reference state-dict name -> TinyDFlash name (regex, replacement)
NAMES = [(r"^fc\.", "aux_proj."), (r"^hidden_norm\.", "aux_norm."), (r"^norm\.", "out_norm."),
         (r"^lm_head\.", "head."), (r"^embed_tokens\.", "tok_emb."),
         (r"^verifier_norm\.", "teacher_norm."), (r"^verifier_lm_head\.", "teacher_head."),
         (r"^layers\.", "blocks."), (r"\.self_attn\.([qkvo])_proj\.", r".w\1."),
         (r"\.self_attn\.([qk])_norm\.", r".\1_ln."), (r"\.mlp\.gate_proj\.", ".w1."),
         (r"\.mlp\.up_proj\.", ".w3."), (r"\.mlp\.down_proj\.", ".w2."),
         (r"\.input_layernorm\.", ".ln1."), (r"\.post_attention_layernorm\.", ".ln2.")]


def to_user(name: str) -> str:
    for pattern, repl in NAMES:
        name = re.sub(pattern, repl, name)
    return name


class TinyDFlashCandidate:
    """dflash-audit candidate protocol: run_case(config, loss, weights, inputs) -> SideOutputs."""

    def run_case(self, config, loss, weights, inputs):
        if set(config.effective_layer_types) != {"full_attention"} or config.sample_from_anchor \
                or loss.loss != "kl_div" or loss.weighting != "fixed-exp-decay":
            raise NotImplementedError("TinyDFlash: full attention, kl_div, fixed-exp-decay only")
        model = TinyDFlash(config.hidden_size, config.num_attention_heads,
                           config.num_key_value_heads, config.head_dim, config.intermediate_size,
                           config.num_hidden_layers, config.vocab_size,
                           config.effective_draft_vocab_size, config.num_target_layers,
                           config.block_size, config.mask_token_id, config.rms_norm_eps,
                           config.rope_theta)
        to_ref = {to_user(k): k for k in weights if k not in ("t2d", "d2t")}
        model.load_state_dict({u: weights[r] for u, r in to_ref.items()}, strict=True)

        anchors, valid = inputs["anchor_positions"], inputs["anchor_valid"]
        ctx, allowed, logits, teacher, slots = model(
            inputs["hidden_states"], inputs["input_ids"], inputs["verifier_last_hidden_states"],
            inputs["document_ids"], inputs["position_ids"], anchors)
        B = config.block_size
        supervised = inputs["loss_mask"][:, slots].float() * valid.float().repeat_interleave(B)
        supervised[:, ::B] = 0.0  # slot 0 is the anchor itself
        total, w = kl_decay_loss(logits, teacher, supervised, B, loss.gamma)
        total.backward()

        params = dict(model.named_parameters())
        tensors = {"context": ctx.detach(), "mask.full_attention": allowed,
                   "targets": teacher, "logits": logits.detach(), "aligned_loss_mask": supervised,
                   "loss": total.detach(), "loss_weights.kl_div": w.expand_as(supervised)}
        tensors.update({f"grad.{to_ref[u]}": p.grad for u, p in params.items()
                        if p.grad is not None})
        structure = {
            "fc_in_features": model.aux_proj.in_features,
            "fc_out_features": model.aux_proj.out_features,
            "target_layer_ids": list(config.target_layer_ids), "block_size": B,
            "mask_token_id": model.mask_id, "layer_types": ["full_attention"] * len(model.blocks),
            "sample_from_anchor": False,
            "state_dict": {to_ref[u]: {"shape": list(t.shape), "dtype": str(t.dtype)[6:],
                                       "trainable": params[u].requires_grad}
                           for u, t in model.state_dict().items()}}
        metrics = dflash_metrics(logits, teacher, supervised, B)  # or your own, same names
        metrics["loss_sum"] = float(total.detach())
        return SideOutputs(
            tensors=tensors, structure=structure, metrics=metrics,
            trainable=[to_ref[u] for u, p in params.items() if p.requires_grad])

    def select_anchors(self, loss_mask, max_anchors, block_size, generator):
        """Optional: the training loop's anchor sampler, audited by distribution."""
        ok = loss_mask[0].bool().clone()
        ok[-block_size:] = False  # a block must fit in the row
        pool = ok.nonzero().squeeze(-1)
        pick = pool[torch.randperm(pool.numel(), generator=generator)[:max_anchors]]
        anchors = torch.zeros(max_anchors, dtype=torch.long)
        anchors[:pick.numel()] = pick
        return anchors, torch.arange(max_anchors) < pick.numel()
# --- README snippet end ------------------------------------------------------------------
