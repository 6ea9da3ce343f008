"""The ``gradients`` check: the gradient of every trainable parameter of the reference after
one backward, at a tolerance of ``atol * max(1, max|g_ref|)`` and the dtype's ``rtol``.

Hypotheses name: frozen weights being trained (gradients where the reference freezes),
parameters no gradient reaches (detached or frozen on the candidate side; a consequence, not
a cause, when the candidate's masks hide all context), gradients of every parameter scaled by
one constant while the reported loss is not (the backward ran on k x the loss:
:func:`gradient_scale`; named as the loss normalised by a count of the case where k is the
supervised tokens over that count), another loss formula whose value equals the reference's within the
loss tolerance on this case (replayed forward and backward:
:func:`dflash_audit.audit.replay.loss_formulas.gradient_formula_causes`; D-PACE weights not detached
among them), and differences that follow from an upstream check's difference.
"""

from __future__ import annotations

from typing import Any

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.compare_tensors import not_provided
from dflash_audit.audit.replay.evidence import Evidence, comma_list, follows_from
from dflash_audit.audit.replay.loss_formulas import gradient_scale, nonzero_grad
from dflash_audit.audit.replay.normalisers import count_cause, count_of_scale, normaliser_counts
from dflash_audit.audit.result import FAIL, PASS, CheckResult
from dflash_audit.audit.slots import as_bool_mask
from dflash_audit.audit.tolerance import closeness, fmt_diff, grad_tolerance, tolerance
from dflash_audit.model.drafter import FROZEN_PARAMETERS


def _frozen_on_reference(ref: SideOutputs) -> set[str]:
    sd = ref.structure.get("state_dict", {})
    frozen = {k for k, v in sd.items() if not v.get("trainable")}
    return frozen | (set(FROZEN_PARAMETERS) - set(ref.trainable))


def check_gradients(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Gradient of every trainable parameter of the reference after one backward; a gradient
    on one side only fails (unless it is all zeros); a candidate gradient for a parameter the
    reference freezes fails (frozen weights being trained). Tolerance per parameter:
    ``atol * max(1, max|g_ref|)``, ``rtol`` from :data:`TOLERANCES`."""
    cg = {k[5:]: v for k, v in cand.tensors.items() if k.startswith("grad.")}
    rg = {k[5:]: v for k, v in ref.tensors.items() if k.startswith("grad.")}
    if not cg and not cand.trainable:
        return not_provided("gradients", case, "gradients")
    tol = tolerance(case, "grad")
    names = list(dict.fromkeys([*ref.trainable, *rg]))
    per_param: dict[str, dict[str, Any]] = {}
    problems: list[tuple[str, str, dict | None]] = []  # (parameter, reason, first_diff)
    for n in names:
        c, r = cg.get(n), rg.get(n)
        if c is None or r is None:
            present = c if c is not None else r
            if present is None or not nonzero_grad(present):
                note = "either side" if present is None else "one side, zero on the other"
                per_param[n] = {"status": PASS, "note": f"no gradient on {note}"}
                continue
            side = "candidate" if c is None else "reference"
            per_param[n] = {"status": FAIL, "reason": f"no gradient on the {side} side"}
            problems.append((n, f"{n}: no gradient on the {side} side", None))
            continue
        if c.shape != r.shape:
            per_param[n] = {"status": FAIL, "reason": f"shape {list(c.shape)} != {list(r.shape)}"}
            problems.append((n, f"{n}: gradient shape {list(c.shape)} != reference "
                                f"{list(r.shape)}", None))
            continue
        ptol = grad_tolerance(r, tol)
        res = closeness(c, r, **ptol)
        per_param[n] = {"status": PASS if res.ok else FAIL, "max_abs": res.max_abs,
                        "max_rel": res.max_rel, "atol": ptol["atol"], "num_bad": res.num_bad}
        if not res.ok:
            problems.append((n, f"{n}: max abs {fmt_diff(res.max_abs)} "
                                f"(atol {fmt_diff(ptol['atol'])}), max rel {fmt_diff(res.max_rel)}",
                             {"parameter": n, "index": list(res.first_bad),
                              "candidate": float(c[res.first_bad]),
                              "reference": float(r[res.first_bad])}))
    frozen = _frozen_on_reference(ref)
    for n in sorted(set(cg) - set(names)):
        if n in cand.trainable or nonzero_grad(cg[n]):
            why = "frozen in the reference" if n in frozen else "not a reference parameter"
            per_param[n] = {"status": FAIL, "reason": why}
            problems.append((n, f"{n}: {why} but trained by the candidate", {"parameter": n}))
    for n in sorted(set(cand.trainable) & frozen - set(per_param)):
        per_param[n] = {"status": FAIL, "reason": "frozen in the reference"}
        problems.append((n, f"{n}: frozen in the reference but trainable on the candidate "
                            "side", {"parameter": n}))
    if not problems:
        worst_abs = max((p.get("max_abs", 0.0) for p in per_param.values()), default=0.0)
        return CheckResult("gradients", case.name, PASS,
                           f"gradients of all {len(names)} trainable parameters match (max abs "
                           f"{fmt_diff(worst_abs)})", tolerance=tol, max_abs_diff=worst_abs,
                           details={"parameters": per_param})
    first_name, _, first = problems[0]
    max_abs = max((p.get("max_abs", 0.0) for p in per_param.values()), default=None)
    max_rel = max((p.get("max_rel", 0.0) for p in per_param.values()), default=None)
    return CheckResult(
        "gradients", case.name, FAIL,
        f"{len(problems)} of {len(per_param)} parameters differ; first: {problems[0][1]}",
        candidate=(first or {}).get("candidate"), reference=(first or {}).get("reference"),
        tolerance=tol, max_abs_diff=max_abs, max_rel_diff=max_rel,
        first_diff=first or {"parameter": first_name},
        details={"parameters": per_param, "failing": [p[0] for p in problems]})


def masks_hide_context(ev: Evidence) -> bool:
    """Whether every mask the candidate returned lets no supervised row attend any context
    position (then fc and hidden_norm get no gradient through attention)."""
    masks = [as_bool_mask(v) for k, v in ev.cand.tensors.items() if k.startswith("mask.")]
    T = ev.inputs["input_ids"].shape[-1]
    return bool(masks) and all(m.shape[-1] > T and not m[ev.rows][:, :T].any() for m in masks)


def diagnose_gradients(ev: Evidence, result: CheckResult) -> list[str]:
    """Frozen weights trained, parameters no gradient reaches, an upstream difference, a loss
    formula whose value the loss check could not tell apart here, or a constant factor."""
    # loss_formulas imports this module: imported here
    from dflash_audit.audit.replay.loss_formulas import gradient_formula_causes

    params = result.details.get("parameters", {})
    frozen = [n for n, p in params.items() if p.get("reason") == "frozen in the reference"]
    causes = []
    if frozen:
        causes.append(f"frozen weights being trained: {comma_list(frozen)} receive gradients on "
                      f"the candidate side (the reference freezes {comma_list(FROZEN_PARAMETERS)})")
    cg = {k[5:]: v for k, v in ev.cand.tensors.items() if k.startswith("grad.")}
    # a tensor shared with another entry has its gradient under that entry's name: the
    # structure check names the sharing (no "detached or frozen" cause for it)
    shared = {k for k, e in ((ev.cand.structure or {}).get("state_dict") or {}).items()
              if isinstance(e, dict) and e.get("shares")}
    no_grad = [n for n, p in params.items() if n not in frozen and p["status"] == FAIL and (
        n not in cg or not nonzero_grad(cg[n])) and n not in shared]
    upstream = follows_from("gradients", ev)
    if no_grad and upstream and masks_hide_context(ev):
        causes.append(f"{upstream}: the candidate's masks hide all context, so no gradient "
                      f"reaches {comma_list(no_grad)} (a consequence, not a detached or frozen "
                      "parameter)")
        no_grad = []
        upstream = None
    elif no_grad:
        causes.append(f"no gradient reaches {comma_list(no_grad)} on the candidate side (detached "
                      "or frozen; the reference trains them)")
    rest = [n for n in result.details.get("failing", []) if n not in frozen + no_grad]
    if rest and upstream:
        causes.append(upstream)
    elif rest and "loss" not in ev.failing and (named := gradient_formula_causes(ev)):
        causes += named
    elif rest and (k := gradient_scale(ev)) is not None:
        causes.append(f"gradients scaled by {k:.4g}: every parameter's gradient is {k:.4g} x "
                      "the reference's while the reported loss matches, so the backward ran on "
                      f"{k:.4g} x the loss (" + (backward_normaliser(ev, k) or
                                                 "a loss multiplied by a constant, or summed "
                                                 "where the reference averages") +
                      ", before backward)")
    return causes


def backward_normaliser(ev: Evidence, k: float) -> str | None:
    """"the loss normalised by <count> (N=..) instead of ..." when ``k`` is the ratio of the
    supervised tokens to a count of the case (:mod:`dflash_audit.audit.replay.normalisers`),
    else None."""
    m = ev.cand.tensors.get("aligned_loss_mask", ev.ref.tensors.get("aligned_loss_mask"))
    if m is None:
        return None
    supervised = float(m.float().sum())
    counts = normaliser_counts(ev.inputs, m, ev.config.block_size)
    names = count_of_scale(counts, supervised, k, tolerance(ev.case, "grad")["rtol"] * 10)
    return f"the {count_cause(names, counts, supervised)}" if names else None
