"""Real speculative decoding with a DFlash drafter: propose, verify, accept (greedy, lossless).

One verify step (greedy, lossless):

1. The verified prefix x_0..x_{p-1} has the verifier's target-layer states captured; the
   drafter's context is ``drafter.context`` of them, ``[1, p, H]``. The last token x_p (the
   verifier's own choice from the previous step) is known but not yet run through the
   verifier.
2. :func:`propose`: the block ``[x_p, mask, ..., mask]`` at positions p..p+B-1 attends to
   the whole context (every kv < p, same document) exactly as an anchor at p does in
   training; the greedy argmax of the draft logits of slots 1..B-1 (0..B-1 with
   ``sample_from_anchor``) are the K drafts for positions p+1..p+K. Draft-vocabulary ids map
   to verifier ids as ``i + d2t[i]``.
3. The verifier runs once over ``[x_p, d_1..d_K]`` (KV cache of the prefix) and predicts
   position p+k+1 at block index k. The longest prefix of drafts equal to those argmaxes
   is accepted, then one bonus token (the verifier's prediction after the last accepted
   one). The step emits ``accepted + 1`` tokens: its *acceptance length*. Captured states
   of x_p and the accepted drafts extend the context; the rest is cropped from the cache.

The mean acceptance length is pooled over all verify steps of all prompts (the prefill's
first token is not a verify step). Output is identical to the verifier's greedy decoding.

On CPU, :func:`dflash_audit.train.evaluate.evaluate_acceptance` flushes subnormal floats to zero while it runs: the
verifier's masked attention produces them, and x86 arithmetic on subnormals made evaluation
up to 30x slower (SmolLM2-135M, 2 cores) without changing a single greedy token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_audit.model.drafter import DFlashDrafter


@dataclass
class Generation:
    """Tokens generated for one prompt and the acceptance length of each verify step."""

    tokens: list[int]
    acceptance: list[int]


def num_drafts(drafter: DFlashDrafter) -> int:
    """K, drafts per verify step: B-1 (B with ``sample_from_anchor``)."""
    c = drafter.config
    return c.block_size if c.sample_from_anchor else c.block_size - 1


@torch.no_grad()
def propose_logits(drafter: DFlashDrafter, context: torch.Tensor, last_token: int
                   ) -> torch.Tensor:
    """Draft logits of the block anchored right after the context.

    Args:
        drafter: the drafter (eval mode).
        context: ``[1, p, H]`` = ``drafter.context(hidden_states[:, :p])``, positions 0..p-1
            of one document (p >= 1).
        last_token: x_p, verifier-vocab id at position p (the block's slot 0).

    Returns:
        ``[B, V_d]`` draft logits of slots 0..B-1 (positions p..p+B-1).
    """
    c = drafter.config
    B, p, device = c.block_size, context.shape[1], context.device
    # A packed row of p+1 positions: the context, then the anchor p itself, whose state is
    # unknown and never attended (the mask admits kv < anchor only).
    row = torch.cat([context, context.new_zeros(1, 1, context.shape[-1])], dim=1)
    anchor = torch.tensor([p], device=device)
    document_ids = torch.zeros(1, p + 1, dtype=torch.long, device=device)
    noise_ids = torch.full((1, B), c.mask_token_id, dtype=torch.long, device=device)
    noise_ids[0, 0] = int(last_token)
    x = drafter.embed_tokens(noise_ids)  # [1,B,H]
    positions = torch.cat([torch.arange(p + 1, device=device),
                           torch.arange(p, p + B, device=device)])[None]  # [1,p+1+B]
    cos, sin = drafter.rotary_emb(positions, x.dtype)
    masks = drafter.attention_masks(document_ids, anchor)
    for i, layer in enumerate(drafter.layers):
        x = layer(x, row, cos, sin, masks[SLIDING_ATTENTION if c.is_sliding(i) else FULL_ATTENTION])
    return drafter.lm_head(drafter.norm(x))[0]


@torch.no_grad()
def propose(drafter: DFlashDrafter, context: torch.Tensor, last_token: int) -> list[int]:
    """K greedy drafts (verifier-vocab ids) for positions p+1..p+K; see :func:`propose_logits`."""
    logits = propose_logits(drafter, context, last_token)
    start = 0 if drafter.config.sample_from_anchor else 1
    ids = logits[start:].argmax(-1)
    if drafter.config.uses_draft_vocab:
        ids = ids + drafter.d2t[ids]
    return [int(i) for i in ids]


def _features(captured: dict, layer_ids: Sequence[int]) -> torch.Tensor:
    """Captured target layers -> ``[1, t, n*H]`` fp32 (ascending id, as in training)."""
    return torch.cat([captured[i] for i in layer_ids], dim=-1).float()


def accept(drafts: Sequence[int], predictions: Sequence[int], generated: int,
           max_new_tokens: int, eos: set[int]) -> tuple[list[int], int]:
    """Greedy verification of one block.

    Args:
        drafts: the K drafts d_1..d_K.
        predictions: the verifier's argmax after each block token ``[x_p, d_1..d_K]`` (K+1).
        generated: tokens generated before this step.

    Returns:
        (emitted tokens: the accepted drafts then the bonus token, cut after an eos or at the
        token budget; n = number of accepted drafts).
    """
    n = 0
    while n < len(drafts) and drafts[n] == predictions[n]:
        n += 1
    emitted = list(drafts[:n]) + [int(predictions[n])]
    for j, t in enumerate(emitted):
        if t in eos or generated + j + 1 >= max_new_tokens:
            return emitted[: j + 1], n
    return emitted, n


@torch.no_grad()
def speculative_generate(drafter: DFlashDrafter, verifier_model: Any, prompt: Sequence[int],
                         max_new_tokens: int, eos_ids: Iterable[int] = ()) -> Generation:
    """Greedy speculative decoding of one prompt (see the module docstring).

    Args:
        drafter: eval-mode drafter whose ``target_layer_ids`` the verifier is captured at.
        verifier_model: HF causal LM (eval).
        prompt: token ids (>= 1).
        max_new_tokens: stop after this many generated tokens (the last step is cut).
        eos_ids: stop after emitting one of these.

    Returns:
        :class:`Generation` (tokens after the prompt; acceptance length per verify step).

    Raises:
        ValueError: empty prompt; RuntimeError: the KV cache could not be cropped.
    """
    from transformers import DynamicCache

    from dflash_audit.data.capture import LayerCapture

    if not prompt:
        raise ValueError("speculative_generate needs a non-empty prompt")
    eos = set(int(e) for e in eos_ids)
    layer_ids = list(drafter.config.target_layer_ids)
    device = next(drafter.parameters()).device
    cache = DynamicCache()
    tokens: list[int] = []
    acceptance: list[int] = []
    with LayerCapture(verifier_model, layer_ids) as cap:
        ids = torch.tensor([list(prompt)], device=device)
        out = verifier_model(input_ids=ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        context = drafter.context(_features(cap.captured, layer_ids))  # [1,p,H]
        last = int(out.logits[0, -1].argmax())
        tokens.append(last)
        while len(tokens) < max_new_tokens and last not in eos:
            drafts = propose(drafter, context, last)
            block = torch.tensor([[last, *drafts]], device=device)
            out = verifier_model(input_ids=block, past_key_values=cache, use_cache=True)
            emitted, n = accept(drafts, out.logits[0].argmax(-1).tolist(), len(tokens),
                                max_new_tokens, eos)
            acceptance.append(len(emitted))
            tokens.extend(emitted)
            last = emitted[-1]
            if last in eos or len(tokens) >= max_new_tokens:
                break
            # states of x_p and the n accepted drafts join the context; drop the rest
            context = torch.cat([context, drafter.context(
                _features(cap.captured, layer_ids)[:, : n + 1])], dim=1)
            expected = cache.get_seq_length() - (len(drafts) - n)
            if len(drafts) > n:
                cache.crop(-(len(drafts) - n))
            if cache.get_seq_length() != expected:
                raise RuntimeError(f"KV cache crop failed: length {cache.get_seq_length()}, "
                                   f"expected {expected}")
    return Generation(tokens=tokens, acceptance=acceptance)


@torch.no_grad()
def speculative_generate_batch(drafter: DFlashDrafter, verifier_model: Any,
                               prompts: Sequence[Sequence[int]], max_new_tokens: int,
                               eos_ids: Iterable[int] = (),
                               on_step: Callable[[list[Generation]], None] | None = None
                               ) -> list[Generation]:
    """:func:`speculative_generate` for several prompts at once: one verifier forward per
    verify step for all of them (on CPU the verifier's weight reads dominate, so this is
    several times faster). Same result per prompt.

    The prompts are left-padded into one KV cache; every step appends K+1 slots per row,
    and slots of rejected drafts (and of finished rows) are masked out of the 2-D attention
    mask instead of cropped, with explicit position ids. Drafts are proposed per row.

    Raises:
        ValueError: no prompt or an empty prompt.
    """
    from transformers import DynamicCache

    from dflash_audit.data.capture import LayerCapture

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("speculative_generate_batch needs non-empty prompts")
    eos = set(int(e) for e in eos_ids)
    layer_ids = list(drafter.config.target_layer_ids)
    device = next(drafter.parameters()).device
    rows, width, k = len(prompts), max(len(p) for p in prompts), num_drafts(drafter)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    mask = torch.zeros(rows, width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), device=device)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    gens = [Generation(tokens=[], acceptance=[]) for _ in prompts]
    with LayerCapture(verifier_model, layer_ids) as cap:
        out = verifier_model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        feats = _features(cap.captured, layer_ids)
        contexts = [drafter.context(feats[i:i + 1, width - len(p):]) for i, p in enumerate(prompts)]
        last = out.logits[:, -1].argmax(-1).tolist()
        next_pos = [len(p) for p in prompts]  # position of each row's last (unverified) token
        active = []
        for i, g in enumerate(gens):
            g.tokens.append(last[i])
            active.append(last[i] not in eos and len(g.tokens) < max_new_tokens)
        if on_step is not None:
            on_step(gens)
        while any(active):
            block = torch.zeros(rows, k + 1, dtype=torch.long, device=device)
            drafts: list[list[int]] = [[] for _ in prompts]
            for i in range(rows):
                if active[i]:
                    drafts[i] = propose(drafter, contexts[i], last[i])
                    block[i] = torch.tensor([last[i], *drafts[i]], device=device)
            step_mask = torch.tensor(active, dtype=torch.long, device=device)[:, None]
            mask = torch.cat([mask, step_mask.expand(rows, k + 1)], dim=1)
            pos = torch.tensor(next_pos, device=device)[:, None] + torch.arange(k + 1,
                                                                                  device=device)
            out = verifier_model(input_ids=block, attention_mask=mask, position_ids=pos,
                                 past_key_values=cache, use_cache=True)
            preds = out.logits.argmax(-1).tolist()
            feats = _features(cap.captured, layer_ids)  # [rows, K+1, n*H]
            for i in range(rows):
                if not active[i]:
                    continue
                g = gens[i]
                emitted, n = accept(drafts[i], preds[i], len(g.tokens), max_new_tokens, eos)
                g.acceptance.append(len(emitted))
                g.tokens.extend(emitted)
                last[i] = emitted[-1]
                mask[i, mask.shape[1] - k + n:] = 0  # rejected drafts leave the cache
                if last[i] in eos or len(g.tokens) >= max_new_tokens:
                    active[i] = False
                    continue
                contexts[i] = torch.cat([contexts[i], drafter.context(feats[i:i + 1, : n + 1])],
                                        dim=1)
                next_pos[i] += n + 1
            if on_step is not None:
                on_step(gens)
    return gens


@torch.no_grad()
def greedy_generate(verifier_model: Any, prompt: Sequence[int], max_new_tokens: int,
                    eos_ids: Iterable[int] = ()) -> list[int]:
    """Plain greedy decoding, one token per verifier forward (KV cache); the reference
    output speculative decoding must reproduce."""
    from transformers import DynamicCache

    eos = set(int(e) for e in eos_ids)
    device = next(verifier_model.parameters()).device
    cache = DynamicCache()
    ids = torch.tensor([list(prompt)], device=device)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        out = verifier_model(input_ids=ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        t = int(out.logits[0, -1].argmax())
        tokens.append(t)
        if t in eos:
            break
        ids = torch.tensor([[t]], device=device)
    return tokens
