"""Worked example: adapting your own DFlash drafter to the dflash-audit candidate protocol.

``TinyDFlash`` stands for a user's implementation: written from scratch, with its own internal
names (``aux_proj`` for ``fc``, ``blocks`` for ``layers``, ``teacher_head`` for
``verifier_lm_head``...). It honours the drafter config the audit hands it: full-attention
layers (bidirectional block) and sliding layers (window, causal block unless
``sliding_window_non_causal``) in any mix, ``head_dim``, eps, ``hidden_act``, the RoPE theta
and scaling type (llama3, yarn, linear... through transformers' ``ROPE_INIT_FUNCTIONS``), the
verifier's final-norm convention (``x*w`` or Gemma-style ``x*(1+w)``),
``sample_from_anchor`` and a draft vocabulary. Its loss is ``kl_div`` or ``ce`` (hard
labels) with fixed-exp-decay weighting; D-PACE weighting, other losses and loss mixes raise
NotImplementedError. ``TinyDFlashCandidate`` (the part between the README markers) is all
the audit needs: build the model from the profile, load the reference-named state dict, run
one step on the batch and the injected anchors, and return the outputs under the
reference's names.

Run (exit 0, PASS on the 14 default cases; the derivation check warns, as the example has no
``derive_config``)::

    dflash-audit compare --candidate examples/minimal_user_model.py:TinyDFlashCandidate \
        --profile zlab
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


# ================================================================== the user's own model
class RMS(nn.Module):
    """RMSNorm in fp32; ``one_plus`` uses the gain ``1 + w`` (Gemma / Qwen3.5 final norms)."""

    def __init__(self, d: int, eps: float, one_plus: bool = False):
        super().__init__()
        self.eps, self.one_plus = eps, one_plus
        self.weight = nn.Parameter(torch.zeros(d) if one_plus else torch.ones(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def rope_tables(cfg, positions):
    """cos, sin [L, head_dim] for int positions [L]. The draft layers rotate the whole head
    (a verifier's partial_rotary_factor is not theirs); scaled RoPE types (llama3, yarn,
    linear...) come from transformers, with their cos/sin scale."""
    params = {"rope_theta": cfg.rope_theta, **(cfg.rope_parameters or {})}
    kind = params.setdefault("rope_type", "default")
    if kind == "default":
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        scale = 1.0
    else:
        hf = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, rope_parameters=params,
                         max_position_embeddings=cfg.max_position_embeddings)
        inv, scale = ROPE_INIT_FUNCTIONS[kind](hf, None)
    ang = positions[:, None].float() * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos() * scale, ang.sin() * scale


def rope(x, cos, sin):  # x [1, heads, L, hd]; cos/sin [L, hd]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Block(nn.Module):
    """Pre-norm layer: queries from the noise block, keys/values from [context ; noise]."""

    def __init__(self, cfg, sliding: bool):
        super().__init__()
        d, hd, eps, bias = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps, cfg.attention_bias
        self.n_heads, self.n_kv, self.hd, self.sliding = (
            cfg.num_attention_heads, cfg.num_key_value_heads, hd, sliding)
        self.wq = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.wo = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.wk = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.wv = nn.Linear(d, self.n_kv * hd, bias=bias)
        self.q_ln, self.k_ln = RMS(hd, eps), RMS(hd, eps)
        self.ln1, self.ln2 = RMS(d, eps), RMS(d, eps)
        d_ff = cfg.intermediate_size
        self.w1, self.w3 = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.w2, self.act = nn.Linear(d_ff, d, bias=False), ACT2FN[cfg.hidden_act]

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

    def forward(self, x, ctx, cos, sin, masks):
        x = x + self.attend(self.ln1(x), ctx, cos, sin, masks[self.sliding])
        h = self.ln2(x)
        return x + self.w2(self.act(self.w1(h)) * self.w3(h))


class TinyDFlash(nn.Module):
    """A from-scratch DFlash drafter, sized and configured from a ``DFlashConfig``-like ``cfg``:
    full-attention layers with a bidirectional block, sliding layers (window W before the
    anchor, causal block unless ``sliding_window_non_causal``), any ``hidden_act``, scaled
    RoPE, a Llama or Gemma-style verifier norm. ``start`` is the first trained slot (1, or 0
    with ``sample_from_anchor``)."""

    def __init__(self, cfg):
        super().__init__()
        d, eps, vd = cfg.hidden_size, cfg.rms_norm_eps, cfg.effective_draft_vocab_size
        self.cfg, self.block, self.mask_id = cfg, cfg.block_size, cfg.mask_token_id
        self.start = 0 if cfg.sample_from_anchor else 1
        self.aux_proj = nn.Linear(cfg.num_target_layers * d, d, bias=False)
        self.aux_norm = RMS(d, eps)
        self.blocks = nn.ModuleList(Block(cfg, t == "sliding_attention")
                                    for t in cfg.effective_layer_types)
        self.out_norm, self.head = RMS(d, eps), nn.Linear(d, vd, bias=False)
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.teacher_norm = RMS(d, eps, one_plus=cfg.verifier_norm_one_plus_weight)
        self.teacher_head = nn.Linear(d, vd, bias=False)
        for frozen in (self.tok_emb, self.teacher_norm, self.teacher_head, self.head):
            frozen.requires_grad_(False)
        if cfg.uses_draft_vocab:  # draft <-> verifier vocabulary maps, used only at inference
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))

    def mask(self, doc, anchors, T, sliding):
        """[Q, T+Q] bool: context of the anchor's document strictly before it (at most W
        before on a sliding layer); its own block (only earlier slots when causal)."""
        B, kv = self.block, torch.arange(T)[None, :]
        qa = anchors.repeat_interleave(B)[:, None]
        ctx = (doc[None, :] == doc[qa]) & (doc[qa] != -1) & (kv < qa)
        q = torch.arange(qa.shape[0])
        own = (q[None, :] // B) == (q[:, None] // B)
        if sliding:
            ctx &= kv >= qa - self.cfg.sliding_window
            if not self.cfg.sliding_window_non_causal:
                own &= q[None, :] <= q[:, None]
        return torch.cat([ctx, own], 1)

    def forward(self, feats, tokens, verifier_last, doc, pos, anchors):
        B, T = self.block, feats.shape[1]
        ctx = self.aux_norm(self.aux_proj(feats))
        slots = (anchors[:, None] + torch.arange(B)).reshape(-1)  # a + s
        noise = torch.full((anchors.numel(), B), self.mask_id)
        noise[:, 0] = tokens[0, anchors]
        x = self.tok_emb(noise.reshape(1, -1))
        all_pos = torch.cat([pos[0], (pos[0, anchors][:, None] + torch.arange(B)).reshape(-1)])
        cos, sin = rope_tables(self.cfg, all_pos)
        masks = {s: self.mask(doc[0], anchors, T, s) for s in {b.sliding for b in self.blocks}}
        for blk in self.blocks:
            x = blk(x, ctx, cos, sin, masks)
        logits = self.head(self.out_norm(x))
        # slot s learns the verifier's prediction at a+s-1 (at a+s with sample_from_anchor)
        with torch.no_grad():
            src = (slots - self.start) % T
            teacher = self.teacher_head(self.teacher_norm(verifier_last[:, src]))
        return ctx, masks, logits, teacher, slots


def decay_loss(logits, teacher, supervised, block, loss, start):
    """sum_q l(q) * w(q) / (number of supervised slots + 1e-5), where l is KL(teacher || draft)
    (``kl_div``) or cross-entropy against argmax(teacher) (``ce``, hard labels), and
    w = exp(-(s - start)/gamma) for slot s >= start, 0 before it (DFlash paper, sec. 3.3)."""
    if loss.loss == "kl_div":
        logq, logp = logits.float().log_softmax(-1), teacher.float().log_softmax(-1)
        per_slot = (logp.exp() * (logp - logq)).sum(-1)
    else:
        per_slot = F.cross_entropy(logits.float().transpose(1, 2), teacher.argmax(-1),
                                   reduction="none")
    s = torch.arange(supervised.shape[-1]) % block
    w = torch.where(s < start, 0.0, torch.exp(-(s - start) / loss.gamma))[None]
    return (per_slot * supervised * w).sum() / (supervised.sum() + 1e-5), w


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
        if loss.weighting != "fixed-exp-decay" or loss.loss not in ("kl_div", "ce"):
            raise NotImplementedError(f"TinyDFlash: loss {loss.loss!r} with {loss.weighting!r} "
                                      "weighting; it implements kl_div or ce with fixed-exp-decay")
        model = TinyDFlash(config)
        to_ref = {to_user(k): k for k in weights}
        model.load_state_dict({u: weights[r] for u, r in to_ref.items()}, strict=True)

        anchors, valid, B = inputs["anchor_positions"], inputs["anchor_valid"], config.block_size
        ctx, masks, logits, teacher, slots = model(
            inputs["hidden_states"], inputs["input_ids"], inputs["verifier_last_hidden_states"],
            inputs["document_ids"], inputs["position_ids"], anchors)
        supervised = inputs["loss_mask"][:, slots].float() * valid.float().repeat_interleave(B)
        if model.start == 1:  # slot 0 is the anchor itself (trained only with sample_from_anchor)
            supervised[:, ::B] = 0.0
        total, w = decay_loss(logits, teacher, supervised, B, loss, model.start)
        total.backward()

        params = dict(model.named_parameters())
        tensors = {"context": ctx.detach(), "targets": teacher, "logits": logits.detach(),
                   "aligned_loss_mask": supervised, "loss": total.detach(),
                   f"loss_weights.{loss.loss}": w.expand_as(supervised)}
        tensors.update({f"mask.{'sliding' if s else 'full'}_attention": m
                        for s, m in masks.items()})
        tensors.update({f"grad.{to_ref[u]}": p.grad for u, p in params.items()
                        if p.grad is not None})
        sliding = any(masks)
        structure = {
            "fc_in_features": model.aux_proj.in_features,
            "fc_out_features": model.aux_proj.out_features,
            "target_layer_ids": list(config.target_layer_ids), "block_size": B,
            "mask_token_id": model.mask_id,
            "layer_types": [f"{'sliding' if b.sliding else 'full'}_attention"
                            for b in model.blocks],
            "sliding_window": config.sliding_window if sliding else None,
            "sliding_window_non_causal": config.sliding_window_non_causal,
            "sample_from_anchor": model.start == 0,
            "state_dict": {to_ref[u]: {"shape": list(t.shape), "dtype": str(t.dtype)[6:],
                                       "trainable": u in params and params[u].requires_grad}
                           for u, t in model.state_dict().items()}}
        metrics = dflash_metrics(logits, teacher, supervised, B, model.start == 0)  # or your own
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
