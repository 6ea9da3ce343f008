"""The ``targets`` check: verifier target logits [1,Q,V_d] on the reference's supervised slots,
at the dtype's assert_close tolerance (:data:`dflash_audit.audit.tolerance.TOLERANCES`).

Hypotheses (every source x norm count x shift, the reference formula first) name: targets from
a target layer instead of the verifier's last layer N, targets from post-norm states (the
verifier's final norm applied twice) or without it, the other verifier_norm gain convention or
a hard-coded eps, targets not shifted / shifted twice / offset, targets that are the data tokens
``input_ids[a+s]`` (hard labels, SpecForge), and a draft-vocabulary mapping slip (not reduced to
V_d, d2t read as absolute ids instead of offsets). A hard-label trainer's ``target_ids`` [1,Q]
are compared exactly (token ids) with the argmax of the reference's targets
(:mod:`dflash_audit.audit.hard_labels`). Matches are judged at the targets' own scale
(:func:`dflash_audit.audit.replay.evidence.match_tolerance`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.compare_tensors import slot_check
from dflash_audit.audit.hard_labels import (
    DATA_TOKENS_CAUSE,
    compare_hard_labels,
    data_token_slots,
    reference_label_ids,
)
from dflash_audit.audit.replay.architecture import COMMON_NORM_EPS
from dflash_audit.audit.replay.evidence import (
    CONFIRM_SAMPLE,
    Evidence,
    sample,
    search_hypotheses,
    vocab_sample,
)
from dflash_audit.audit.result import FAIL, PASS, CheckResult
from dflash_audit.audit.slots import slot_coordinates
from dflash_audit.model.drafter import block_indices
from dflash_audit.model.layers import RMSNorm


def check_targets(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Verifier target logits [1,Q,V_d] on supervised slots; a hard-label candidate's
    ``target_ids`` [1,Q] against the reference's argmax token there."""
    if "target_ids" in cand.tensors and "targets" in ref.tensors:
        return check_target_ids(case, cand, ref)
    return slot_check("targets", case, cand, ref)


def check_target_ids(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """``target_ids`` [1,Q] long vs the argmax of the reference's targets (verifier ids)
    on the reference's supervised slots, exact."""
    try:
        c = compare_hard_labels(case, cand, ref)
    except ValueError as exc:
        return CheckResult("targets", case.name, FAIL, f"target_ids: {exc}")
    details = {"compared": f"{c.compared} supervised slots (hard labels)",
               "num_bad": int(c.differ.sum()), "data_token_slots": c.data_token}
    if c.ok:
        return CheckResult("targets", case.name, PASS, f"target_ids equal the reference's "
                           f"argmax target on {c.compared} supervised slots (hard labels)",
                           details=details)
    q = int(c.differ.nonzero()[0])
    first = slot_coordinates(case, q)
    return CheckResult(
        "targets", case.name, FAIL,
        f"target_ids differ from the reference's argmax target on {int(c.differ.sum())} of "
        f"{c.compared} supervised slots (hard labels); first at "
        + ", ".join(f"{k} {v}" for k, v in first.items()),
        candidate=int(cand.tensors["target_ids"].reshape(-1)[q]),
        reference=int(reference_label_ids(case, ref)[q]), first_diff=first, details=details)


@dataclass(frozen=True)
class TargetHypothesis:
    """targets = verifier_lm_head(norm^k(source[a + s - shift])).

    source: None = verifier_last_hidden_states (layer N), i = target-layer slice i of
    hidden_states. norms: 0, 1, 2 applications of verifier_norm; flipped: the other gain
    convention (x*(1+w) vs x*w); eps: the norm's eps when not the verifier's."""

    source: int | None
    norms: int
    shift: int
    flipped: bool = False
    eps: float | None = None


def reference_shift(case: Case) -> int:
    """Slot s is taught by the verifier's prediction at a+s-1 (a+s with sample_from_anchor)."""
    return 0 if case.config.sample_from_anchor else 1


def target_hypotheses(case: Case) -> Iterator[TargetHypothesis]:
    """Every source (layer N, each target layer) x norm (once, none, twice, flipped gain)
    x shift (reference shift -2..+2), the reference formula first; then the reference
    formula with a commonly hard-coded norm eps."""
    k = reference_shift(case)
    sources = [None, *range(case.config.num_target_layers)]
    norms = [(1, False), (2, False), (0, False), (1, True)]
    for src, (n, flip), d in itertools.product(sources, norms, (0, -1, 1, -2, 2)):
        yield TargetHypothesis(src, n, k + d, flip)
    for eps in COMMON_NORM_EPS:
        if eps != case.config.rms_norm_eps:
            yield TargetHypothesis(None, 1, k, eps=eps)


def predict_targets(case: Case, h: TargetHypothesis, slots: torch.Tensor,
                    vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[1, len(slots), V_d] targets of hypothesis h on the given query slots (only the
    ``vocab`` columns when given)."""
    c, H = case.config, case.config.hidden_size
    if h.source is None:
        states = case.inputs["verifier_last_hidden_states"]
    else:
        states = case.inputs["hidden_states"][..., h.source * H:(h.source + 1) * H]
    T = states.shape[1]
    idx = block_indices(case.inputs["anchor_positions"].long(), c.block_size)[slots]
    x = states[:, (idx - h.shift) % T].float()
    norm = RMSNorm(H, c.rms_norm_eps if h.eps is None else h.eps,
                   one_plus_weight=c.verifier_norm_one_plus_weight ^ h.flipped)
    with torch.no_grad():
        norm.weight.copy_(case.weights["verifier_norm.weight"])
        for _ in range(h.norms):
            x = norm(x)
        head = case.weights["verifier_lm_head.weight"].float()
        return x @ (head if vocab is None else head[vocab]).T


def describe_target_hypothesis(case: Case, h: TargetHypothesis) -> list[str]:
    """The named deviations of h from the reference formula (empty for the reference)."""
    c = case.config
    N, out = c.num_verifier_layers, []
    if h.source is not None:
        L = c.target_layer_ids[h.source]
        out.append(f"targets from target layer {L} (hidden_states slice {h.source}), not the "
                   f"verifier's last layer N={N}: L = N-{N - L}, a proxy distribution "
                   f"{N - L} layer(s) short")
    if h.norms == 2:
        out.append("targets from post-norm states: the verifier's final norm is applied twice "
                   "(Hugging Face output_hidden_states[-1] is already normed)")
    elif h.norms == 0:
        out.append("targets without the verifier's final norm (pre-norm states fed to the "
                   "lm_head directly)")
    if h.flipped:
        conv = "x*w" if c.verifier_norm_one_plus_weight else "x*(1+w)"
        ref_conv = "x*(1+w)" if c.verifier_norm_one_plus_weight else "x*w"
        out.append(f"verifier_norm gain convention {conv} (reference {ref_conv} for "
                   f"{c.verifier_model_type!r})")
    if h.eps is not None:
        out.append(f"verifier_norm eps {h.eps:g}, not the verifier's rms_norm_eps")
    delta = h.shift - reference_shift(case)
    ref_pos = "a+s" if reference_shift(case) == 0 else "a+s-1"
    pos = f"a+s{-h.shift:+d}" if h.shift else "a+s"
    if delta == -1 and not c.sample_from_anchor:
        out.append(f"targets not shifted: slot s is taught by the verifier's prediction at {pos} "
                   f"instead of {ref_pos}")
    elif delta == 1 and not c.sample_from_anchor:
        out.append(f"targets shifted twice: slot s is taught by the prediction at {pos} instead "
                   f"of {ref_pos}")
    elif delta:
        out.append(f"targets offset by {-delta:+d} position(s): slot s taught by the prediction "
                   f"at {pos} instead of {ref_pos}" + (" (sample_from_anchor)" if
                                                        c.sample_from_anchor else ""))
    return out


def diagnose_vocab(ev: Evidence, key: str) -> list[str]:
    """A targets / logits tensor over the full vocabulary where the reference has V_d: which
    d2t reading restricts it to the reference's (offsets i + d2t[i], or absolute ids)."""
    c, r = ev.cand.tensors[key], ev.ref.tensors[key]
    V, Vd = ev.config.vocab_size, ev.config.effective_draft_vocab_size
    if c.shape[-1] != V or r.shape[-1] != Vd or "d2t" not in ev.case.weights:
        return [f"{key} over {c.shape[-1]} vocabulary entries, reference {r.shape[-1]} "
                f"(verifier vocab V={V}, draft vocab V_d={Vd})"]
    d2t = ev.case.weights["d2t"].long()
    readings = {"offsets (target id = i + d2t[i], the reference convention)":
                torch.arange(Vd) + d2t, "absolute ids (target id = d2t[i])": d2t.clamp(0, V - 1)}
    sup = ev.sup
    for label, ids in readings.items():
        if ev.close(c[:, sup][..., ids], r[:, sup]):
            if label.startswith("offsets"):
                return [f"{key} not reduced to the draft vocabulary: over all V={V} verifier ids; "
                        f"restricted with d2t as {label} they equal the reference's"]
            return [f"draft-vocab mapping: d2t read as {label}; the reference stores offsets "
                    "(target id = i + d2t[i])"]
    return [f"{key} over the full vocabulary V={V} where the reference uses the draft vocabulary "
            f"V_d={Vd}; no d2t reading reproduces the reference's values"]


def diagnose_targets(ev: Evidence, result: CheckResult) -> list[str]:
    """Search every (source, norm, shift) formula for the candidate's targets; hard labels:
    whether they are the data tokens."""
    if "target_ids" in ev.cand.tensors:
        if data_token_slots(ev.case, ev.cand, ev.ref):
            return [DATA_TOKENS_CAUSE]
        return ["hard labels (target_ids) that are neither the verifier's argmax prediction "
                "nor the data tokens input_ids[a+s]"]
    c = ev.cand.tensors["targets"]
    if c.shape != ev.ref.tensors["targets"].shape:
        return diagnose_vocab(ev, "targets")
    slots = ev.sup.nonzero().squeeze(-1)
    hard = data_token_targets(ev, slots, hard=True)
    if hard:
        return hard
    stages = [(sample(slots), vocab_sample(c.shape[-1])), (sample(slots, CONFIRM_SAMPLE), None)]
    found = search_hypotheses(ev, target_hypotheses(ev.case),
                              lambda h, sel: predict_targets(ev.case, h, *sel),
                              lambda sel: (c[:, sel[0]] if sel[1] is None
                                           else c[:, sel[0]][..., sel[1]]),
                              stages, cap=256)  # cheap: an lm_head on sampled columns
    causes = [d for h in found for d in describe_target_hypothesis(ev.case, h)]
    return list(dict.fromkeys(causes)) or data_token_targets(ev, slots, hard=False)


def data_token_targets(ev: Evidence, slots: torch.Tensor, hard: bool) -> list[str]:
    """:data:`DATA_TOKENS_CAUSE` when the argmax of the candidate's targets
    is the data token on every supervised slot where the reference's is not everywhere (and,
    with ``hard``, the candidate's distributions are one-hot: probability > 0.99)."""
    c, r = ev.cand.tensors["targets"][0, slots], ev.ref.tensors["targets"][0, slots]
    labels = ev.data_labels[slots]
    if not slots.numel() or bool((labels < 0).any()) or not torch.equal(c.argmax(-1), labels) \
            or torch.equal(r.argmax(-1), labels):
        return []
    one_hot = bool((c.float().softmax(-1).max(-1).values > 0.99).all())
    if hard != one_hot:
        return []
    kind = "hard labels: one-hot targets" if one_hot else "their argmax"
    ref_pos = "a+s" if ev.config.sample_from_anchor else "a+s-1"
    return [f"{DATA_TOKENS_CAUSE} at {ref_pos}, verifier_lm_head(verifier_norm("
            f"verifier_last_hidden_states[{ref_pos}])) ({kind}): the "
            "reference distils the verifier"]
