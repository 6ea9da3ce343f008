"""Loss formula hypotheses of the ``loss`` and ``gradients`` checks: the candidate's own
logits, targets, aligned mask and weights reduced under another loss (every single loss and
the profile's mix) and another denominator (the reference's supervised-token count, the sum of
weights, all Q slots, per block, and every count of :mod:`dflash_audit.audit.replay.normalisers`:
anchors, valid anchors, blocks, predicted slots, the row's tokens), or scaled by a constant;
and, where a loss value cannot tell two formulas apart on a case, our drafter replayed forward
and backward under each.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.hard_labels import DATA_TOKENS_CAUSE, data_tokens
from dflash_audit.audit.replay.evidence import (
    Evidence,
    data_token_consequence,
    follows_from,
)
from dflash_audit.audit.replay.normalisers import (
    COUNTS,
    count_cause,
    count_of_scale,
    merge_count_causes,
    normaliser_counts,
)
from dflash_audit.audit.result import is_downstream
from dflash_audit.audit.tolerance import closeness, grad_tolerance, tolerance
from dflash_audit.model.loss import (
    LABEL_LOSSES,
    LOSS_NAMES,
    LOSS_REDUCTION_EPS,
    LossSpec,
    dpace_weights,
    parse_loss,
    slot_weights,
    term_loss,
)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy ``-sum_v p_v log q_v`` = KL(p || q) + H(p), p = softmax(targets),
    q = softmax(logits): [1,Q,V] x2 -> [1,Q] fp32. KL's gradient, a larger value (ModelOpt
    ``hf_dflash.py`` ``_compute_loss``, the KD term ``-(softmax(teacher) * log_softmax(draft))``);
    not a reference loss, only a hypothesis."""
    log_q = torch.log_softmax(logits.float(), -1)
    return -(torch.softmax(targets.float(), -1) * log_q).sum(-1)


#: The profile's losses plus what frameworks compute instead (hypotheses only).
AUDIT_LOSS_NAMES = (*LOSS_NAMES, "soft_ce")


def audit_term_loss(name: str, logits: torch.Tensor, targets: torch.Tensor | None,
                    target_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[1,Q] fp32 elementwise values of a loss hypothesis: ``soft_ce``
    (:func:`soft_cross_entropy`) or any profile loss (:func:`dflash_audit.model.loss.term_loss`).

    Raises:
        ValueError: an unknown name, or a label loss without ``target_ids``.
    """
    if name == "soft_ce":
        return soft_cross_entropy(logits, targets)
    return term_loss(name, logits, targets, target_ids)


#: Denominators of a loss hypothesis: supervised tokens (the reference), sum of weights, all
#: Q slots, per block, the batch size (one packed row: the plain weighted sum), and the counts
#: of :data:`dflash_audit.audit.replay.normalisers.COUNTS`.
DENOMINATORS = ("tokens", "weights", "slots", "blocks", "batch", *COUNTS)


def loss_formula_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict[str, float], str]]:
    """(label, loss mix, denominator) for every single loss (the reference's and soft
    cross-entropy) and the profile's mix, under every :data:`DENOMINATORS`; the reference
    first."""
    profile = parse_loss(ev.case.loss.loss)
    mixes = [("profile", profile)] + [(n, {n: 1.0}) for n in AUDIT_LOSS_NAMES
                                      if {n: 1.0} != profile]
    for (name, mix), denom in itertools.product(mixes, DENOMINATORS):
        yield name, mix, denom


def recompute_loss(ev: Evidence, mix: dict[str, float], denom: str,
                   cache: dict[str, torch.Tensor] | None = None,
                   mask: torch.Tensor | None = None) -> float | None:
    """The loss of the candidate's own logits / targets / aligned mask / weights under a mix
    and a denominator (tokens: sum(m) + 1e-5; weights: sum(m*w); slots: Q; blocks: each
    block's sum over its own sum(m), averaged over blocks with a supervised slot). ``cache`` keeps
    each divergence's elementwise values [1,Q] between calls; ``mask`` ([Q] bool) replaces the
    candidate's aligned mask (then the cache is not used)."""
    t = ev.cand.tensors
    targets = t.get("targets")
    if "logits" not in t or (targets is None and "target_ids" not in t) or (
            targets is not None and t["logits"].shape != targets.shape):
        return None
    if targets is None and any(name not in LABEL_LOSSES for name in mix):
        return None  # a hard-label candidate: only losses against its labels can be replayed
    cache = {} if cache is None or mask is not None else cache
    m = (mask if mask is not None else t.get("aligned_loss_mask", ev.ref.tensors.get(
        "aligned_loss_mask"))).reshape(1, -1).float()
    B, spec = ev.config.block_size, ev.case.loss
    if "counts:" not in cache:
        cache["counts:"] = normaliser_counts(ev.inputs, m, B)
    counts = cache["counts:"]
    total = 0.0
    own_weights = [v for k, v in t.items() if k.startswith("loss_weights.")]
    # the candidate's own labels where it returns them (hard labels), else the data tokens
    labels = t["target_ids"].reshape(1, -1) if "target_ids" in t else data_tokens(ev.case)[None]
    for name, coef in mix.items():
        if name not in cache:
            cache[name] = audit_term_loss(name, t["logits"], targets, labels) * m
        el = cache[name]
        if f"loss_weights.{name}" in t:
            w = t[f"loss_weights.{name}"].reshape(1, -1)
        elif own_weights and (spec.weighting in ("fixed-exp-decay", "none")
                              or len(own_weights) == 1 and len(mix) == 1):  # its own weights
            w = own_weights[0].reshape(1, -1)
        else:
            w = slot_weights(spec, el, m, B, ev.config.sample_from_anchor)
        total += coef * float(reduce_term(el, w, m, B, denom, counts))
    return total


def reduce_term(el: torch.Tensor, w: torch.Tensor, m: torch.Tensor, block_size: int,
                denom: str, counts: dict[str, float] | None = None) -> torch.Tensor:
    """One term's weighted, masked reduction [1,Q] x3 -> [] under a denominator (see
    :func:`recompute_loss`; a :data:`COUNTS` member divides by ``counts[denom]``, from
    :func:`~dflash_audit.audit.replay.normalisers.normaliser_counts`); differentiable.

    Raises:
        KeyError: a count denominator without its count in ``counts``.
    """
    if denom in COUNTS:
        return (el * w).sum() / max((counts or {})[denom], LOSS_REDUCTION_EPS)
    if denom == "blocks":  # each block's mean over its supervised tokens, then over blocks
        num, cnt = (el * w).reshape(-1, block_size).sum(-1), m.reshape(-1, block_size).sum(-1)
        return (num[cnt > 0] / cnt[cnt > 0]).mean() if bool((cnt > 0).any()) else num.sum() * 0
    d = {"tokens": m.sum() + LOSS_REDUCTION_EPS, "weights": (m * w).sum() + LOSS_REDUCTION_EPS,
         "slots": torch.tensor(float(m.numel())), "batch": torch.tensor(1.0)}[denom]
    return (el * w).sum() / d


def formula_causes(ev: Evidence, name: str, denom: str) -> list[str]:
    """How a loss formula hypothesis deviates from the profile's, in words (training on the
    data tokens is a consequence of the targets difference when the candidate's own labels are
    the data tokens, :func:`~dflash_audit.audit.replay.evidence.data_token_consequence`)."""
    causes = []
    if name == "ce-data":
        labels = data_token_consequence(ev)  # the targets check names these labels already
        causes.append(f"{labels}: the loss is cross-entropy against those labels ('ce-data' "
                      f"where the profile says {ev.case.loss.loss!r})" if labels else
                      f"{DATA_TOKENS_CAUSE} (loss 'ce-data' where the profile says "
                      f"{ev.case.loss.loss!r})")
    elif name == "soft_ce":
        causes.append(f"soft cross-entropy -sum p log q (= KL + the teacher's entropy H(p): "
                      f"KL's gradient, a larger value) where the profile says "
                      f"{ev.case.loss.loss!r}")
    elif name != "profile":
        hard = name == "ce" and "ce" not in parse_loss(ev.case.loss.loss)
        causes.append(f"loss computed as {name!r} where the profile says {ev.case.loss.loss!r}"
                      + (" (hard-label CE instead of soft divergence)" if hard else ""))
    if denom == "weights":
        causes.append("loss normalised by the sum of weights instead of the number of "
                      "supervised tokens")
    elif denom == "slots":
        causes.append("loss averaged over all Q slots instead of the supervised tokens")
    elif denom == "blocks":
        causes.append("loss averaged per block (over its supervised tokens), then over "
                      "blocks, instead of over all supervised tokens of the row")
    elif denom == "batch":
        causes.append("loss divided by the batch size (1 row: the weighted sum of per-token "
                      "losses) instead of the number of supervised tokens")
    elif denom in COUNTS:
        m = ev.cand.tensors.get("aligned_loss_mask", ev.ref.tensors.get("aligned_loss_mask"))
        counts = normaliser_counts(ev.inputs, m, ev.config.block_size)
        causes.append(count_cause([denom], counts, float(m.float().sum())))
    return causes


#: Pseudo-denominator of :func:`gradient_formula_causes`: the profile's D-PACE loss with the
#: gradient flowing through its weights (same value, other gradients).
WEIGHTS_WITH_GRAD = "tokens, D-PACE weights with gradient"


def gradient_formula_causes(ev: Evidence, max_replays: int = 5) -> list[str]:
    """For gradients that differ where the loss value matched: under D-PACE, the profile's loss
    with its weights not detached; then the loss formulas whose value on the candidate's own
    tensors equals its loss within the loss tolerance (so the loss check cannot tell them apart
    on this case, e.g. rkl ~ kl_div near the verifier). Each is replayed with our drafter
    forward and backward on the case; the first whose gradients reproduce every candidate
    gradient is named."""
    from dflash_audit.audit.precision import autocast
    from dflash_audit.audit.replay.replay import drafter_with_weights

    t = ev.cand.tensors
    if "loss" not in t:
        return []
    cl, tol, cache = float(t["loss"]), tolerance(ev.case, "loss"), {}
    close = []
    for name, mix, denom in loss_formula_hypotheses(ev):
        value = None if (name, denom) == ("profile", "tokens") else recompute_loss(
            ev, mix, denom, cache)
        if value is not None and abs(value - cl) <= tol["atol"] + tol["rtol"] * abs(cl):
            close.append((name, mix, denom))
    if ev.case.loss.weighting == "dpace":  # the profile's loss, gradient through w
        close.insert(0, ("profile", parse_loss(ev.case.loss.loss), WEIGHTS_WITH_GRAD))
    cg = {k[5:]: v for k, v in t.items() if k.startswith("grad.")}
    rg = {k[5:]: v for k, v in ev.ref.tensors.items() if k.startswith("grad.") and k[5:] in cg}
    if not close or not rg:
        return []
    model = drafter_with_weights(ev.config, ev.case.weights)
    named = dict(model.named_parameters())
    rg = {n: g for n, g in rg.items() if n in named}
    params = [named[n] for n in rg]  # in rg's order: the zip below pairs them by position
    with autocast(ev.case):
        out = model(**ev.case.inputs)
    m, B, spec = out.aligned_loss_mask.float(), ev.config.block_size, ev.case.loss
    counts = normaliser_counts(ev.inputs, m, B)
    gtol = tolerance(ev.case, "grad")
    for name, mix, denom in close[:max_replays]:
        total = 0.0
        for term, coef in mix.items():
            el = audit_term_loss(term, out.logits, out.targets, out.target_ids) * m
            if denom == WEIGHTS_WITH_GRAD:
                w = dpace_weights.__wrapped__(el, m, B, spec.dpace_alpha)  # without no_grad
            else:
                w = slot_weights(LossSpec(spec.loss, spec.weighting, spec.gamma, spec.dpace_alpha),
                                 el.detach(), m, B, ev.config.sample_from_anchor)
            total = total + coef * reduce_term(el, w, m, B, "tokens" if denom ==
                                               WEIGHTS_WITH_GRAD else denom, counts)
        grads = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
        if not all(g is not None and closeness(cg[n], g, **grad_tolerance(rg[n], gtol)).ok
                   for n, g in zip(rg, grads)):
            continue
        if denom == WEIGHTS_WITH_GRAD:
            return ["D-PACE weights not detached: the gradient also flows through the per-slot "
                    "weights w (the reference computes them without gradient; our drafter's "
                    "gradients with w attached reproduce the candidate's)"]
        causes = formula_causes(ev, name, denom)
        root = [c for c in causes if not is_downstream(c)]
        return (["; ".join(root) + " (the loss values agree within tolerance on this case, the "
                 "gradients do not: our drafter's gradients under that loss reproduce the "
                 "candidate's)"] if root else []) + [c for c in causes if is_downstream(c)]
    return []


#: The candidate's loss follows from its own tensors by the reference's formula.
FORMULA_CONFORMS = ("the candidate's loss formula conforms (the reference's formula on the "
                    "candidate's own logits, targets, mask and weights reproduces its loss)")


def loss_inputs_cause(ev: Evidence) -> str:
    """The cause of a loss difference whose formula conforms while every check upstream of the
    loss passes: which of the candidate's logits / targets, each within its own tolerance,
    carry it (the reference's formula on the reference's tensors with the candidate's logits,
    else its targets, swapped in reproduces the candidate's loss; else both together). Small
    differences of one sign add up in a loss of near-equal distributions (a KL near 0): a
    forward that rounds what the reference keeps (weights, norm gains or activations held in a
    lower precision) does this."""
    cl, tol = float(ev.cand.tensors["loss"]), ev.tol
    carried = "the candidate's logits and targets together"
    for key in ("logits", "targets"):
        if key not in ev.cand.tensors or key not in ev.ref.tensors or \
                ev.cand.tensors[key].shape != ev.ref.tensors[key].shape:
            continue
        mixed = dataclasses.replace(ev.ref, tensors={**ev.ref.tensors, key: ev.cand.tensors[key]})
        value = own_loss(ev.case, mixed)
        if value is not None and abs(value - cl) <= tol["atol"] + tol["rtol"] * abs(cl):
            carried = (f"the candidate's {key} (the reference's formula on the reference's "
                       f"tensors with the candidate's {key} reproduces its loss)")
            break
    return (f"the loss difference comes from {carried}: each value within its tolerance, "
            "their differences add up in the loss, as when a forward rounds what the reference "
            "keeps (weights, norm gains or activations in a lower precision); not the loss "
            f"formula: {FORMULA_CONFORMS}")


def diagnose_loss_total(ev: Evidence, masks: Iterable[tuple[str, torch.Tensor]] = ()
                        ) -> list[str]:
    """The loss formulas (:func:`loss_formula_hypotheses`) that reproduce the candidate's total
    on its own tensors, the fewest deviations only; else the profile's formula under another
    mask of ``masks`` ((label, [Q] bool), e.g. slot 0 kept: a loss that uses another mask than
    the aligned_loss_mask it reports); else a constant factor."""
    cl = float(ev.cand.tensors["loss"])
    tol = ev.tol
    found, cache = [], {}
    for name, mix, denom in loss_formula_hypotheses(ev):
        value = recompute_loss(ev, mix, denom, cache)
        if value is None:  # not computable from what the candidate returned
            continue
        if abs(value - cl) <= tol["atol"] + tol["rtol"] * abs(cl):
            if name == "profile" and denom == "tokens":
                if data_targets_substituted(ev):
                    return [f"{DATA_TOKENS_CAUSE}: the profile's loss {ev.case.loss.loss!r} "
                            "trains on the data tokens and the reference, which has no such "
                            "loss, ran "
                            "'ce' against the argmax of the verifier's logits instead (the "
                            "candidate's loss follows from its logits and the data tokens)"]
                upstream = follows_from("loss", ev)
                if not upstream:  # conforming is no cause: say what the difference comes from
                    return [loss_inputs_cause(ev)]
                return [f"{FORMULA_CONFORMS}; the difference {upstream}"]
            found.append((formula_causes(ev, name, denom), denom))
    if not found:
        for label, mask in masks:
            value = recompute_loss(ev, parse_loss(ev.case.loss.loss), "tokens", mask=mask)
            if value is not None and abs(value - cl) <= tol["atol"] + tol["rtol"] * abs(cl):
                return [f"the loss is reduced under another mask than the aligned_loss_mask the "
                        f"candidate reports: {label}"]
        return loss_scale_cause(ev, cl)
    # counts equal on this case (sampled = valid anchors) are one normaliser cause, not a tie
    m = ev.cand.tensors.get("aligned_loss_mask", ev.ref.tensors.get("aligned_loss_mask"))
    found = merge_count_causes([f[0] for f in found], [f[1] for f in found],
                               normaliser_counts(ev.inputs, m, ev.config.block_size),
                               float(m.float().sum()))
    # the fewest deviations that reproduce the loss: two losses can agree numerically on a
    # case (rkl ~ kl_div near uniform targets), a second deviation is then not evidence
    fewest = min(map(len, found), default=0)
    tied = [causes for causes in found if len(causes) == fewest]
    if len(tied) == 1:  # one formula: each of its deviations is a cause of its own
        return tied[0]
    # a consequence every tied formula shares (the data-token labels) stays one consequence
    shared = [c for c in tied[0] if is_downstream(c) and all(c in t for t in tied)]
    best = list(dict.fromkeys("; ".join(c for c in t if c not in shared) for t in tied))
    best = [b for b in best if b]
    if len(best) <= 1:
        return best + shared
    return [f"{' or '.join(best)}: these give the same total on this case and cannot be told "
            "apart here (one cause, not several); a case where the drafter's and the verifier's "
            "distributions differ more (fitted weights, real data) separates them", *shared]


def loss_scale_cause(ev: Evidence, cl: float) -> list[str]:
    """"loss scaled by k" when the candidate's loss is k x the reference's formula on its own
    tensors AND every gradient is k x the reference's (a ratio of two scalars alone is no
    evidence; the gradients make it one)."""
    own = recompute_loss(ev, parse_loss(ev.case.loss.loss), "tokens")
    k = gradient_scale(ev) if own else None
    if k is None or abs(cl / own - k) > ev.tol["rtol"] * 10 * abs(k):
        return []
    return [f"loss scaled by {k:.4g}: the candidate's loss and every gradient are {k:.4g} x the "
            "reference's formula on its own logits, targets, mask and weights (a constant "
            "factor, e.g. a sum where the reference averages, or a loss multiplied before "
            "backward)"]


def nonzero_grad(grad: torch.Tensor) -> bool:
    """Whether a gradient carries anything: a nonzero value, or a non-finite one (NaN is
    never "no gradient")."""
    return bool(grad.numel()) and bool((grad != 0).any() or not torch.isfinite(grad).all())


def gradient_scale(ev: Evidence) -> float | None:
    """The one factor k with ``g_cand = k * g_ref`` for every parameter both sides give a
    gradient of (least squares over all of them, then each parameter within its tolerance),
    or None when no single factor reproduces them, k is 1, or a gradient is not finite.

    A uniform factor is what a backward on ``k * loss`` gives (a loss multiplied by a
    constant, or summed where the reference averages): Adam-style optimisers undo part of it,
    but SGD, gradient clipping and weight decay see it."""
    cg = {k[5:]: v for k, v in ev.cand.tensors.items() if k.startswith("grad.")}
    rg = {k[5:]: v for k, v in ev.ref.tensors.items() if k.startswith("grad.")}
    pairs = [(cg[n].double(), rg[n].double()) for n in rg if n in cg
             and cg[n].shape == rg[n].shape and nonzero_grad(rg[n])]
    if not pairs or not all(bool(torch.isfinite(c).all() and torch.isfinite(r).all())
                            for c, r in pairs):
        return None
    num = sum(float((c * r).sum()) for c, r in pairs)
    den = sum(float((r * r).sum()) for _, r in pairs)
    k = num / den if den else 0.0
    tol = tolerance(ev.case, "grad")
    if k == 0.0 or abs(k - 1.0) <= tol["rtol"] or not all(
            closeness(c, k * r, **grad_tolerance(r.float(), tol)).ok for c, r in pairs):
        return None
    return k


def own_loss(case: Case, side: SideOutputs) -> float | None:
    """The reference's loss formula (profile mix, fp32 softmax, supervised-token denominator) on
    one side's own logits, targets, aligned mask and weights; None without logits/targets."""
    return recompute_loss(Evidence(case, side, side), parse_loss(case.loss.loss), "tokens")


def data_targets_substituted(ev: Evidence) -> bool:
    """The profile trains on the data tokens (``ce-data``) and the reference ran its ``ce``
    instead (it reports so in its defaults' ``runs_instead``)."""
    return "ce-data" in parse_loss(ev.case.loss.loss) and "loss" in (
        ev.ref.defaults.get("runs_instead") or {})
