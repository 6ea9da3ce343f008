"""The ``logits`` check: draft logits [1,Q,V_d] on the reference's supervised slots, at the
dtype's assert_close tolerance (:data:`dflash_audit.audit.tolerance.TOLERANCES`).

Hypotheses replay our drafter (:mod:`dflash_audit.audit.replay.replay`) and name: a context / mask
difference the logits follow from (replayed with the candidate's own context and masks),
hidden_states and input_ids shifted against loss_mask / position_ids (EAGLE-3-style), a
correct mask misused by the attention (a boolean mask added to the scores, ...), mixed
position conventions, the noise block's slot 0 holding mask_token_id or a neighbour
instead of the anchor token, mask_token_id falling back to another token, RoPE
partial_rotary_factor applied or ignored, mask variants (when the candidate returned no
masks), draft-layer slips (:mod:`dflash_audit.audit.replay.architecture`: RoPE on interleaved
pairs among them), and a draft-vocabulary mapping slip. Hypotheses are tried on top of the
candidate's own upstream values and, where none alone reproduces the logits, in greedy pairs
(:mod:`dflash_audit.audit.replay.compound`); a difference nothing reproduces says where it
starts (:mod:`dflash_audit.audit.replay.locate`) and what was tried.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.checks.mask import (
    build_mask,
    describe_mask_hypothesis,
    expected_mask_hypothesis,
)
from dflash_audit.audit.checks.targets import diagnose_vocab
from dflash_audit.audit.compare_tensors import slot_check
from dflash_audit.audit.replay.architecture import (
    architecture_hypotheses,
    mask_misuse_hypotheses,
)
from dflash_audit.audit.replay.compound import compound_search, tried_families
from dflash_audit.audit.replay.evidence import (
    CONFIRM_SAMPLE,
    MAX_HYPOTHESES,
    Evidence,
    and_list,
    follows_from,
    sample,
    shifted,
    unexplained,
)
from dflash_audit.audit.replay.locate import where_it_starts
from dflash_audit.audit.replay.replay import replay
from dflash_audit.audit.result import CheckResult
from dflash_audit.audit.slots import as_bool_mask
from dflash_audit.model.layers import RotaryEmbedding


def check_logits(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Draft logits [1,Q,V_d] on supervised slots."""
    return slot_check("logits", case, cand, ref)


def position_hypotheses(ev: Evidence) -> Iterator[tuple[str, Callable]]:
    """Mixed position conventions (a uniform shift of all positions cannot change RoPE
    attention, so only conventions that differ between context and noise are visible)."""
    T = ev.inputs["position_ids"].shape[-1]
    absolute_noise = ev.block_idx[None]
    context = {"restart per document": None,
               "not restarting per document (0..T-1)": lambda p: torch.arange(T)[None],
               "1-indexed": lambda p: p + 1,
               "not rotated (RoPE applied to the noise block only)": torch.zeros_like}
    noise = {"position_ids[a]+s": None, "a+s (packed position, not restarting per document)":
             lambda p: absolute_noise, "position_ids[a]+s+1 (1-indexed slots)": lambda p: p + 1,
             "position_ids[a]+s-1": lambda p: p - 1}
    for (cl, cf), (nl, nf) in itertools.product(context.items(), noise.items()):
        if cf is None and nf is None:
            continue

        def transform(pos, cf=cf, nf=nf):
            ctx, nz = pos[:, :T], pos[:, T:]
            return torch.cat([cf(ctx) if cf else ctx, nf(nz) if nf else nz], 1)

        yield (f"position ids: context {cl}, noise block {nl} (reference: context restarts at 0 "
               f"per document, slot s of anchor a at position_ids[a]+s)", transform)


def logit_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """Counterfactual replays of our drafter: positions, noise-block tokens, mask_token_id, RoPE
    partial factor, (when the candidate returned no masks) mask variants, then the draft
    layers' internals (:func:`dflash_audit.audit.replay.architecture.architecture_hypotheses`)."""
    c, inputs = ev.config, ev.inputs
    yield from shift_hypotheses(ev)
    yield from mask_misuse_hypotheses()
    for label, transform in position_hypotheses(ev):
        yield label, {"positions": transform}
    anchors = inputs["anchor_positions"].long()
    ids = inputs["input_ids"].clone()
    ids[0, anchors] = c.mask_token_id
    yield ("noise block slot 0 holds mask_token_id instead of the anchor token "
           "input_ids[a]"), {"inputs": {"input_ids": ids}}
    for d in (1, -1):
        yield (f"noise block slot 0 holds input_ids[a{d:+d}] instead of input_ids[a]",
               {"inputs": {"input_ids": torch.roll(inputs["input_ids"], -d, 1)}})
    others = {"pad_token_id": c.pad_token_id, **{k: v for k, v in c.extra.items()
                                                 if k in ("eos_token_id", "bos_token_id")},
              "the candidate's reported mask_token_id": ev.cand.structure.get("mask_token_id"),
              "token id 0": 0}
    for label, tok in others.items():
        if isinstance(tok, int) and tok != c.mask_token_id and 0 <= tok < c.vocab_size:
            yield (f"mask_token_id falls back to {label} ({tok}); the profile's is "
                   f"{c.mask_token_id}"), {"config": c.replace(mask_token_id=tok)}
    yield from rope_hypotheses(ev)
    if not any(k.startswith("mask.") for k in ev.cand.tensors):
        yield from mask_replay_hypotheses(ev)
    yield from architecture_hypotheses(c, ev.case.weights, inputs["input_ids"].shape[-1])


#: Inputs an EAGLE-3-style pipeline shifts, never loss_mask / position_ids / document_ids (a
#: shift of verifier_last_hidden_states too cannot change the draft logits: the targets check
#: names it).
SHIFTED_INPUTS = (("hidden_states", "input_ids"),)


def shift_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """Inputs shifted by one position (left: position p holds what the reference has at p+1,
    and right) relative to loss_mask / position_ids / document_ids, zeros shifted in."""
    for d, names in itertools.product((1, -1), SHIFTED_INPUTS):
        side = "left" if d > 0 else "right"
        yield (f"{and_list(names)} shifted {side} by 1 relative to loss_mask / position_ids "
               f"(position p reads the reference's p{d:+d}; loss_mask, position_ids and "
               "document_ids unshifted)",
               {"inputs": {n: shifted(ev.inputs[n], d) for n in names}})


def rotary_inv_freq(config, rotary_dim: int) -> torch.Tensor:
    """Default RoPE inverse frequencies over the first ``rotary_dim`` head dimensions."""
    return 1.0 / (config.rope_theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))


def rope_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """The profile's ``partial_rotary_factor`` honoured where our drafter (like the reference's
    Qwen3 draft layers) does not, or ignored where it is honoured."""
    c = ev.config
    factor = (c.rope_parameters or {}).get("partial_rotary_factor")
    if factor is None or (c.rope_parameters or {}).get("rope_type", "default") != "default":
        return
    ours = RotaryEmbedding(c).inv_freq.numel() * 2
    partial = int(c.head_dim * factor) // 2 * 2
    if ours == c.head_dim and partial < c.head_dim:
        yield (f"RoPE partial_rotary_factor {factor} applied: {partial} of {c.head_dim} head "
               "dimensions rotated, where the reference's draft layers ignore the factor and "
               "rotate all of them"), {"inv_freq": rotary_inv_freq(c, partial)}
    elif ours < c.head_dim:
        yield (f"RoPE partial_rotary_factor {factor} ignored: all {c.head_dim} head dimensions "
               f"rotated, the reference rotates {ours}"),\
            {"inv_freq": rotary_inv_freq(c, c.head_dim)}


def mask_replay_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """Single deviations from each layer type's expected mask (context offset <=, < a-1 or
    < a+B, documents ignored, block rule flipped, noise of earlier blocks visible, window
    none / W-1 / W+1), applied to every layer type at once and, with several layer types, to
    each alone."""
    types = list(dict.fromkeys(ev.config.effective_layer_types))
    W = ev.config.sliding_window
    deviations = [{"offset": 1}, {"offset": -1}, {"documents": False}, {"causal_block": None},
                  {"window": None}] + ([{"window": W - 1}, {"window": W + 1}] if W else []) + [
                  {"offset": ev.config.block_size}, {"blocks": "earlier"}]
    scopes = [types] + ([[t] for t in types] if len(types) > 1 else [])
    for change, scope in itertools.product(deviations, scopes):
        masks, labels = {}, []
        for layer_type in scope:
            exp = expected_mask_hypothesis(ev.case, layer_type)
            kw = {"causal_block": not exp.causal_block} if "causal_block" in change else change
            h = dataclasses.replace(exp, **kw)
            if h == exp:
                continue
            masks[layer_type] = build_mask(ev.case, h)
            labels += describe_mask_hypothesis(ev.case, layer_type, h)
        if masks:
            label = f"{and_list(list(masks))} mask: {'; '.join(dict.fromkeys(labels))}"
            yield label, {"masks": masks}


def diagnose_logits(ev: Evidence, result: CheckResult) -> list[str]:
    """Replay our drafter with the candidate's own context / masks (what the upstream checks
    established), then the logit hypotheses (:func:`logit_hypotheses`) on top of them, alone
    and in pairs (:func:`dflash_audit.audit.replay.compound.compound_search`): the fewest
    causes that together reproduce the logits. Where nothing does, where the difference
    starts (:func:`dflash_audit.audit.replay.locate.where_it_starts`) and what was tried."""
    c = ev.cand.tensors["logits"]
    if c.shape != ev.ref.tensors["logits"].shape:
        return diagnose_vocab(ev, "logits")
    sup = ev.sup
    upstream = [u for u in ("context", "mask") if u in ev.failing]
    given = {}
    if "context" in upstream and "context" in ev.cand.tensors:
        given["context"] = ev.cand.tensors["context"]
    if "mask" in upstream:
        masks = {k.split(".", 1)[1]: as_bool_mask(v) for k, v in ev.cand.tensors.items()
                 if k.startswith("mask.")}
        if masks:
            given["masks"] = masks
    slots = sup.nonzero().squeeze(-1)
    stages = [sample(slots), sample(slots, CONFIRM_SAMPLE)]

    def predict(kw: dict, s: torch.Tensor) -> torch.Tensor:
        if ev.memo:
            ev.memo.spend()
        return replay(ev.case, slots=s, **kw)

    def probe(kw: dict) -> tuple[bool, float]:
        observed, predicted = c[:, stages[0]], predict(kw, stages[0])
        if observed.shape != predicted.shape:
            return False, float("inf")
        err = float((observed.float() - predicted.float()).abs().mean())
        return ev.close(observed, predicted), err

    def confirm(kw: dict) -> bool:
        return ev.close(c[:, stages[1]], predict(kw, stages[1]))

    parts = " and ".join(given)
    matched, baseline = probe(given)
    if given and matched and confirm(given):
        return [f"follows from the {and_list(upstream)} difference: our drafter fed the "
                f"candidate's own {parts} reproduces the candidate's logits"]
    # budgeted: a cap, greedy pairs, what reproduced on earlier cases first
    hypotheses = list(itertools.islice(logit_hypotheses(ev), MAX_HYPOTHESES))
    key = ("logits",)
    skipped = ev.memo.exhausted(key) if ev.memo else []
    if ev.memo:
        hypotheses = ev.memo.order(key, hypotheses)
    outcome = compound_search(hypotheses, given, ev.config, probe, confirm, baseline=baseline,
                              known=ev.memo.known(key) if ev.memo else ())
    if ev.memo:
        ev.memo.record(key, ev.case.name, outcome.labels or None, full=not skipped)
    if outcome.labels:
        causes = list(outcome.labels)
        change = "this change" if len(causes) == 1 else f"these {len(causes)} changes"
        if given:
            causes.append(f"follows from the {and_list(upstream)} difference together with "
                          f"{change}: our drafter fed the candidate's own {parts} and "
                          f"{change} reproduces the candidate's logits")
        elif len(causes) > 1:
            causes.append(f"the {len(causes)} causes above together: our drafter with all of "
                          "them reproduces the candidate's logits (no one of them alone does)")
        return causes
    if skipped:
        return [unexplained(result), "the full hypothesis search was not repeated on this case: "
                f"the audit's replay budget is spent (it reproduced nothing on "
                f"{and_list(skipped)}); only causes found on other cases were tried"]
    if not given and (up := follows_from("logits", ev)):
        return [up]
    lines = [unexplained(result)]
    if given:  # the upstream difference is real but does not account for the logits
        lines.append(f"not only the {and_list(upstream)} difference: our drafter fed the "
                     f"candidate's own {parts} does not reproduce the candidate's logits, alone "
                     f"or together with any of the {len(outcome.tried)} hypotheses tried (and "
                     "pairs of the closest), so its draft layers differ as well")
    conforming = [name for check, name in (("mask", "masks"), ("context", "context"),
                                           ("targets", "targets")) if check not in ev.failing]
    cg = {k[5:]: v for k, v in ev.cand.tensors.items() if k.startswith("grad.")}
    rg = {k[5:]: v for k, v in ev.ref.tensors.items() if k.startswith("grad.")}
    if "gradients" not in ev.failing:
        lines.append("where it starts: not in what is trained: every gradient conforms, so the "
                     "difference is in the logits the candidate reports, not in the ones its "
                     "loss backpropagates")
    elif where := where_it_starts(cg, rg, conforming):
        lines.append(where)
    lines.append(f"tried and ruled out: {tried_families(outcome.tried)} (each alone and, for "
                 "the closest, in pairs)")
    return lines
