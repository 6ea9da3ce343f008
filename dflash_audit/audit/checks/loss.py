"""The ``loss`` check: the total loss (scalar, the dtype's assert_close tolerance), the aligned
loss mask (exact: which slots are trained) and each loss term's per-slot weights on supervised
slots, with the decay gamma each side's weights imply (:func:`fit_decay`).

Hypotheses name: per-slot supervision taken from another mask than loss_mask (the attention
mask, all ones, document boundaries: :mod:`dflash_audit.audit.replay.supervision`, with the
slots it trains), slot 0 (the anchor) not masked out, padding anchors not masked out, a
misaligned loss mask, the fixed per-slot weight formula (:mod:`dflash_audit.audit.replay.weight_formulas`:
a wrong decay gamma or decay formula, no position decay, slot 0's weight under
sample_from_anchor, weights normalised per block; on a case that cannot separate two formulas,
both in one cause with the slots a separating case needs), D-PACE vs fixed-exp-decay weighting
(only on a case whose reference weights vary between blocks), D-PACE weights that follow from
an upstream difference or from another loss kind (a consequence, listed after it), D-PACE
confidences computed from cross-entropy against the data tokens (ModelOpt), another loss (e.g.
hard-label CE instead of a soft divergence, soft cross-entropy KL + H(p)) and the loss
normalised by the sum of weights, averaged over all Q slots or per block, divided by the
batch size or by a count of anchors, blocks or tokens (:mod:`dflash_audit.audit.replay.normalisers`;
under any weighting), D-PACE weights that follow from the aligned mask, a loss reduced
under another mask than the aligned_loss_mask the candidate reports, and a loss scaled by a
constant (told from any other difference by the gradients: all scaled by the same factor);
among several loss formulas that reproduce the total, only those with the fewest deviations,
named as one cause (:mod:`dflash_audit.audit.replay.loss_formulas`).

In a low-precision audit (``--dtype bf16``) the loss must also follow from the candidate's own
logits and targets by the reference's formula in float32 (part ``loss_from_logits``, tolerance
from the reference's own noise on the same quantity); a loss that instead follows with its
softmax in bfloat16 is named (speculators PR 788).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.compare_tensors import not_provided
from dflash_audit.audit.hard_labels import data_tokens
from dflash_audit.audit.replay.evidence import (
    Evidence,
    data_token_consequence,
    follows_from,
)
from dflash_audit.audit.replay.loss_formulas import (
    AUDIT_LOSS_NAMES,
    FORMULA_CONFORMS,
    audit_term_loss,
    diagnose_loss_total,
    own_loss,
)
from dflash_audit.audit.replay.supervision import aligned_mask_hypotheses, supervision_counts
from dflash_audit.audit.replay.weight_formulas import (
    fit_decay,
    no_decay_causes,
    weight_formula_causes,
)
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult, is_downstream
from dflash_audit.audit.slots import slot_coordinates, supervised_slots
from dflash_audit.audit.tolerance import closeness, fmt_diff, tolerance, worst
from dflash_audit.model.loss import (
    LOSSES,
    slot_weights,
    softmax_dtype,
)

SOFTMAX_BF16 = "loss softmax computed in bfloat16; the reference computes it in float32"


def _compare_mask(case: Case, cand: SideOutputs, ref: SideOutputs) -> dict[str, Any]:
    if "aligned_loss_mask" not in cand.tensors or "aligned_loss_mask" not in ref.tensors:
        return {"status": WARN, "reason": "aligned_loss_mask not provided"}
    raw = cand.tensors["aligned_loss_mask"].reshape(-1)
    if raw.is_floating_point() and not bool(torch.isfinite(raw).all()):  # NaN.bool() is True
        bad = ~torch.isfinite(raw)
        q = int(bad.nonzero()[0])
        return {"status": FAIL, "num_bad": int(bad.sum()),
                "first_diff": {**slot_coordinates(case, q), "candidate": float(raw[q])},
                "reason": f"candidate aligned_loss_mask holds {int(bad.sum())} non-finite "
                          f"values (NaN / inf), first at slot {q}"}
    c = raw.bool()
    r = ref.tensors["aligned_loss_mask"].reshape(-1).bool()
    if c.shape != r.shape:
        return {"status": FAIL, "reason": f"aligned_loss_mask shape {list(c.shape)} != "
                                          f"reference {list(r.shape)}"}
    if torch.equal(c, r):
        return {"status": PASS, "supervised": int(r.sum())}
    q = int((c != r).nonzero()[0])
    return {"status": FAIL, "num_bad": int((c != r).sum()),
            "first_diff": {**slot_coordinates(case, q), "candidate": bool(c[q]),
                           "reference": bool(r[q])},
            "reason": f"aligned_loss_mask (which slots are trained) differs at "
                      f"{int((c != r).sum())} slots: candidate trains {int(c.sum())}, reference "
                      f"{int(r.sum())}"}


def _compare_weights(case: Case, cand: SideOutputs, ref: SideOutputs, key: str,
                     sup: torch.Tensor) -> dict[str, Any]:
    term = key.split(".", 1)[1]
    B = case.config.block_size
    r = ref.tensors[key].reshape(-1)
    out: dict[str, Any] = {"term": term, "reference_fit": fit_decay(r, sup, B)}
    if key not in cand.tensors:
        return {**out, "status": WARN, "reason": f"loss weights of {term!r} not provided"}
    c = cand.tensors[key].reshape(-1)
    if c.shape != r.shape:
        return {**out, "status": FAIL, "reason": f"loss weights of {term!r} shape "
                                                 f"{list(c.shape)} != reference {list(r.shape)}"}
    out["candidate_fit"] = fit_decay(c, sup, B)
    res = closeness(c[sup], r[sup], **tolerance(case, "loss_weights"))
    out.update(max_abs=res.max_abs, max_rel=res.max_rel)
    if res.ok:
        return {**out, "status": PASS}
    slots = sup.nonzero().squeeze(-1)
    q = int(slots[res.first_bad[0]])
    gc, gr = (out["candidate_fit"] or {}).get("gamma"), (out["reference_fit"] or {}).get("gamma")
    implied = "" if case.loss.weighting == "dpace" else (  # D-PACE weights imply no gamma
        f" (implied gamma: candidate {fmt_diff(gc) if gc else '-'}, reference "
        f"{fmt_diff(gr) if gr else '-'})")
    return {**out, "status": FAIL, "num_bad": res.num_bad,
            "first_diff": {**slot_coordinates(case, q), "term": term,
                           "candidate": float(c[q]), "reference": float(r[q])},
            "reason": f"per-slot weights of {term!r} differ on {res.num_bad} supervised slots"
                      + implied}


def check_loss(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Total loss (scalar, assert_close tolerance), the aligned loss mask (exact: which slots
    are trained) and the per-position weights of every loss term on supervised slots, with the
    decay gamma each side's weights imply (:func:`fit_decay`)."""
    if "loss" not in ref.tensors:
        return not_provided("loss", case, "loss", side="reference")
    tol = tolerance(case, "loss")
    sup = supervised_slots(case, ref)
    parts: dict[str, Any] = {"aligned_loss_mask": _compare_mask(case, cand, ref)}
    for key in sorted(k for k in ref.tensors if k.startswith("loss_weights.")):
        parts[key] = _compare_weights(case, cand, ref, key, sup)
    rl = float(ref.tensors["loss"])
    if "loss" not in cand.tensors:
        parts["total"] = {"status": WARN, "reason": "total loss not provided"}
        cl = max_abs = max_rel = None
    else:
        cl = float(cand.tensors["loss"])
        res = closeness(cand.tensors["loss"].reshape(()), ref.tensors["loss"].reshape(()), **tol)
        max_abs, max_rel = res.max_abs, res.max_rel
        parts["total"] = {"status": PASS if res.ok else FAIL, "candidate": cl, "reference": rl,
                          "reason": f"total loss {cl:.6g} vs reference {rl:.6g}"}
    if case.dtype != "fp32" and cl is not None:
        parts["loss_from_logits"] = _loss_from_logits(case, cand, cl)
        if parts["total"]["status"] == FAIL and _carried_by_passing_logits(case, cand, ref, cl):
            parts["total"] = {**parts["total"], "status": PASS, "carried_by_logits": True}
    status = worst(p["status"] for p in parts.values())
    bad = [p for p in parts.values() if p["status"] == status and status != PASS]
    fits = {k.split(".", 1)[1]: {"candidate": (p.get("candidate_fit") or {}).get("gamma"),
                                 "reference": (p.get("reference_fit") or {}).get("gamma")}
            for k, p in parts.items() if k.startswith("loss_weights.")}
    if status == PASS:
        summary = (f"loss {cl:.6g} matches ({int(sup.sum())} supervised slots, weights of "
                   f"{len(fits)} term(s) equal)")
        if parts["total"].get("carried_by_logits"):
            summary += (f"; its difference from the reference's {rl:.6g} is its logits' "
                        f"{case.dtype} rounding, which passes the logits check, carried "
                        "through the reference's formula")
    else:
        summary = "; ".join(p["reason"] for p in bad)
    first = next((p.get("first_diff") for p in bad if p.get("first_diff")), None)
    return CheckResult("loss", case.name, status, summary, candidate=cl, reference=rl,
                       tolerance=tol, max_abs_diff=max_abs, max_rel_diff=max_rel,
                       first_diff=first, details={"parts": parts, "implied_gamma": fits})


def _carried_by_passing_logits(case: Case, cand: SideOutputs, ref: SideOutputs,
                               cl: float) -> bool:
    """In a low-precision audit: whether a total-loss difference is only the candidate's
    logits' rounding carried through the reference's own formula -- its logits pass the logits
    check (within their tolerance on the supervised slots) and the reference's formula on the
    reference's tensors with the candidate's logits swapped in gives the candidate's loss. A
    forward that rounds where the reference does not (a bf16 lm_head) then moves a near-zero
    loss past the loss's own tolerance, which cannot change training more than the logits
    already passed (a wrong formula, mask or weights is not reproduced this way)."""
    from dflash_audit.audit.checks.logits import check_logits

    if "logits" not in cand.tensors or "logits" not in ref.tensors or \
            cand.tensors["logits"].shape != ref.tensors["logits"].shape or \
            check_logits(case, cand, ref).status != PASS:
        return False
    swapped = own_loss(case, dataclasses.replace(ref, tensors={**ref.tensors,
                                                               "logits": cand.tensors["logits"]}))
    tol = tolerance(case, "loss")
    return swapped is not None and abs(swapped - cl) <= tol["atol"] + tol["rtol"] * abs(cl)


def _loss_from_logits(case: Case, cand: SideOutputs, cl: float) -> dict[str, Any]:
    value = own_loss(case, cand)
    if value is None:
        return {"status": WARN, "reason": "logits / targets not provided: cannot tell whether "
                                          "the loss follows from them in float32"}
    tol = tolerance(case, "loss_from_logits")
    ok = abs(cl - value) <= tol["atol"] + tol["rtol"] * abs(value)
    return {"status": PASS if ok else FAIL, "candidate": cl, "recomputed": value,
            "tolerance": tol,
            "reason": f"the candidate's loss {cl:.6g} does not follow from its own logits and "
                      f"targets by the reference's float32 formula ({value:.6g}; |diff| "
                      f"{fmt_diff(abs(cl - value))} > atol {fmt_diff(tol['atol'])}, the "
                      f"reference's own {case.dtype} noise x k)"}


def diagnose_loss_precision(ev: Evidence, part: dict[str, Any]) -> list[str]:
    """A loss that follows from the candidate's own tensors with the softmax in bfloat16 (at
    least 10x closer than in float32): :data:`SOFTMAX_BF16`."""
    with softmax_dtype(torch.bfloat16):
        low = own_loss(ev.case, ev.cand)
    cl, exact = part["candidate"], part["recomputed"]
    if low is not None and abs(cl - low) * 10 <= abs(cl - exact):
        return [SOFTMAX_BF16]
    return []


def diagnose_weights(ev: Evidence, part: dict[str, Any]) -> list[str]:
    """Name a per-slot weight difference: the fixed-decay formula the candidate's weights follow
    (:func:`dflash_audit.audit.replay.weight_formulas.weight_formula_causes`), or for D-PACE whether
    the candidate's own per-slot loss reproduces its weights (then the difference follows from
    upstream). "Fixed per-slot weights where the profile says D-PACE" is named only on a case
    whose reference weights vary between blocks (one supervised block cannot tell them apart)."""
    spec = ev.case.loss
    fit, ref_fit = part.get("candidate_fit"), part.get("reference_fit") or {}
    if not fit:
        return []
    if spec.weighting == "fixed-exp-decay" and not fit["constant_per_slot"]:
        return ["per-slot weights vary between blocks (D-PACE-like) where the profile says "
                "fixed-exp-decay"]
    if spec.weighting == "dpace":
        if own_dpace_weights_match(ev, part["term"]):
            upstream = data_token_consequence(ev) or follows_from("loss", ev) or (
                MASK_CONSEQUENCE if mask_differs(ev) else None)
            own = "targets" if "targets" in ev.cand.tensors else "labels (target_ids)"
            return [f"{upstream}: D-PACE weights depend on the per-slot loss, and the "
                    f"reference's D-PACE formula on the candidate's own logits and {own} "
                    "reproduces its weights"] if upstream else []
        if dpace_match(ev, part["term"], data_token_ce(ev)):
            return [f"D-PACE confidences computed from cross-entropy against the data tokens "
                    f"input_ids[a+s] (exp(-CE)), not from the {part['term']!r} loss term they "
                    "weight (the reference: c_s = (1-alpha) exp(-l_s) + alpha of that term's "
                    "per-token loss; speculators losses/utils.py dpace_loss_decay)"]
        t = ev.cand.tensors
        for kind in AUDIT_LOSS_NAMES:
            if kind != part["term"] and "logits" in t and "targets" in t and \
                    t["logits"].shape == t["targets"].shape and dpace_match(
                        ev, part["term"], audit_term_loss(kind, t["logits"].float(),
                                                          t["targets"].float(),
                                                          data_tokens(ev.case)[None])):
                return [f"follows from the loss kind difference: D-PACE weights depend on the "
                        f"per-token loss, and D-PACE on the candidate's own {kind!r} per-token "
                        "loss reproduces its weights"]
        if fit["constant_per_slot"] and not ref_fit.get("constant_per_slot", True):
            return ["fixed per-slot weights where the profile says D-PACE"]
        return []
    if spec.weighting == "none":
        return no_decay_causes(fit, ev.config.sample_from_anchor)
    causes = weight_formula_causes(fit["per_slot"], fit.get("gamma"), spec.gamma,
                                   ev.config.sample_from_anchor, ev.config.block_size)
    if causes:
        return causes
    s0_ref, g, s0 = (0.0 if ev.config.sample_from_anchor else 1.0), fit.get("gamma"), fit.get(
        "offset")
    if g is None or s0 is None or abs(s0 - s0_ref) <= 1e-3:
        return []
    return [f"per-slot weights scaled by {math.exp((s0 - s0_ref) / g):.4g} (e.g. normalised per "
            "block)"]


#: A weight difference that follows from the candidate's own aligned mask.
MASK_CONSEQUENCE = "follows from the aligned loss mask difference"


def mask_differs(ev: Evidence) -> bool:
    """Whether the candidate's aligned mask trains other slots than the reference's."""
    c = ev.cand.tensors.get("aligned_loss_mask")
    return c is not None and c.numel() == ev.sup.numel() and not torch.equal(
        c.reshape(-1).bool(), ev.sup)


def data_token_ce(ev: Evidence) -> torch.Tensor | None:
    """[1,Q] cross-entropy of the candidate's logits against the data tokens input_ids[a+s]
    (0 where the token is outside the draft vocabulary), or None without logits."""
    logits = ev.cand.tensors.get("logits")
    if logits is None:
        return None
    labels = ev.data_labels
    ce = torch.nn.functional.cross_entropy(logits[0].float(), labels.clamp_min(0),
                                           reduction="none")
    return (ce * (labels >= 0)).reshape(1, -1)


def dpace_match(ev: Evidence, term: str, elementwise: torch.Tensor | None) -> bool:
    """Whether the reference's D-PACE formula on a per-token loss [1,Q] (masked by the
    candidate's aligned mask) reproduces the candidate's weights of ``term``."""
    key = f"loss_weights.{term}"
    t = ev.cand.tensors
    if elementwise is None or key not in t:
        return False
    m = t.get("aligned_loss_mask", ev.ref.tensors.get("aligned_loss_mask")).reshape(1, -1).float()
    w = slot_weights(ev.case.loss, elementwise.reshape(1, -1) * m, m, ev.config.block_size,
                     ev.config.sample_from_anchor)
    sup = ev.sup
    return bool(closeness(t[key].reshape(-1)[sup].float(), w.reshape(-1)[sup], **ev.tol).ok)


def own_term_loss(ev: Evidence, term: str) -> torch.Tensor | None:
    """[1,Q] fp32: the per-token loss the candidate trains ``term`` on, from its own tensors:
    the divergence ``term`` of its logits from its ``targets``, or for a hard-label candidate
    (``target_ids``, no targets) the cross-entropy against its own labels, the only loss labels
    give; None when its outputs cannot give it."""
    t = ev.cand.tensors
    logits = t.get("logits")
    if logits is None:
        return None
    if "targets" in t:
        if term not in LOSSES or logits.shape != t["targets"].shape:
            return None
        return LOSSES[term](logits.float(), t["targets"].float())
    ids = t.get("target_ids")
    if ids is None or ids.numel() != logits.shape[1] or int(ids.min()) < 0 or \
            int(ids.max()) >= logits.shape[-1]:
        return None
    return audit_term_loss("ce-data", logits.float(), None, ids.reshape(1, -1))


def own_dpace_weights_match(ev: Evidence, term: str) -> bool:
    """Whether D-PACE on the candidate's own per-token loss (:func:`own_term_loss`) and
    aligned mask reproduces its weights of ``term`` (then a weight difference follows from
    those inputs: its logits, targets or labels)."""
    t = ev.cand.tensors
    key = f"loss_weights.{term}"
    el = own_term_loss(ev, term)
    if key not in t or el is None:
        return False
    m = t.get("aligned_loss_mask", ev.ref.tensors.get("aligned_loss_mask")).reshape(1, -1).float()
    el = el * m
    w = slot_weights(ev.case.loss, el, m, ev.config.block_size, ev.config.sample_from_anchor)
    sup = ev.sup
    return bool(closeness(t[key].reshape(-1)[sup].float(), w.reshape(-1)[sup], **ev.tol).ok)


def diagnose_loss(ev: Evidence, result: CheckResult) -> list[str]:
    """Causes of the failing loss parts: aligned mask, per-slot weights, total."""
    parts = result.details.get("parts", {})
    causes: list[str] = []
    if parts.get("aligned_loss_mask", {}).get("status") == FAIL and mask_differs(ev):
        c = ev.cand.tensors["aligned_loss_mask"].reshape(-1).bool()
        named = [label for label, m in aligned_mask_hypotheses(ev) if torch.equal(m, c)][:1]
        causes += [label + supervision_counts(ev, c) for label in named] or [
            "unexplained difference in the aligned loss mask: no tested supervision rule "
            "(loss_mask, the attention mask, all ones, document boundaries, each with slot 0, "
            "anchor_valid and a shift of one) reproduces the slots the candidate trains"
            + supervision_counts(ev, c)]
    consequences: list[str] = []  # weights that follow from a cause named below come last
    for key, part in parts.items():
        if key.startswith("loss_weights.") and part.get("status") == FAIL:
            named = diagnose_weights(ev, part)
            if not named and part.get("candidate_fit"):
                cw = {s: round(w, 4) for s, w in part["candidate_fit"]["per_slot"].items()}
                rw = {s: round(w, 4) for s, w in
                      (part.get("reference_fit") or {}).get("per_slot", {}).items()}
                named = [f"per-slot weights of {part['term']!r} differ and no tested weight "
                         f"formula reproduces them: candidate {cw}, reference {rw} (slot: weight)"]
            causes += [n for n in named if not is_downstream(n)]
            consequences += [n for n in named if is_downstream(n)]
    if parts.get("loss_from_logits", {}).get("status") == FAIL:
        causes += diagnose_loss_precision(ev, parts["loss_from_logits"])
    if parts.get("total", {}).get("status") == FAIL:
        total = diagnose_loss_total(ev, aligned_mask_hypotheses(ev))
        if (causes or consequences) and total and FORMULA_CONFORMS in total[0]:
            total = []  # the named weight / mask cause already explains the total
        causes += [c for c in total if not is_downstream(c)]
        consequences += [c for c in total if is_downstream(c)]
    return list(dict.fromkeys(causes + consequences))
