"""The ``metrics`` check: per-slot accuracy sums / totals, full accuracy, EAL and loss-valued
metrics of both sides (tolerance: relative 1e-5).

Fails only on a non-finite candidate metric (a NaN acceptance metric means the training signal
is broken, :mod:`dflash_audit.audit.protocol`); differing values warn: metrics are logged, not
trained on. Hypotheses name: acceptance-length
definitions that differ (leading-run vs product-of-marginals, as the reference changed between
versions), accuracy over the other slot range (slot 0 counted or skipped against
``sample_from_anchor``), accuracy measured against the data tokens (SpecForge / ModelOpt),
a metric the candidate computes differently from the reference's definition on its own
logits, an acceptance length off by one (the bonus token counted twice or left out; only where
the case tells the readings apart), an acceptance length whose run an unsupervised slot does
not end (NeMo Automodel's; only where a block holds a hit past one), and metric values that
follow from an upstream difference.
"""

from __future__ import annotations

import math

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.compare_tensors import not_provided
from dflash_audit.audit.replay.evidence import Evidence, comma_list, follows_from
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.audit.slots import supervised_slots
from dflash_audit.audit.tolerance import closeness, tolerance
from dflash_audit.model.metrics import (
    EAL_DEFINITIONS,
    REFERENCE_EAL_DEFINITIONS,
    dflash_metrics,
    eal_by_definition,
)


#: One accuracy definition, in neutral words (SpecForge's and ModelOpt's ``train_acc``; said
#: only when one of them is the candidate: :mod:`dflash_audit.audit.frameworks.rules`).
DATA_TOKEN_ACCURACY = ("accuracy measured against the data tokens input_ids[a+s] instead of "
                       "argmax of the verifier's targets")


def eal_value(metrics: dict[str, float]) -> float | None:
    """A side's reported expected acceptance length: ``eal_sum / eal_total`` or ``eal``."""
    if "eal_sum" in metrics and metrics.get("eal_total"):
        return metrics["eal_sum"] / metrics["eal_total"]
    return metrics.get("eal")


#: What a candidate's EAL definition does where the reference's differs, in the audit's words
#: (said with the definitions' numbers; the leading-run / product pair is the reference's own
#: change between versions).
RUN_PAST_UNSUPERVISED = "an unsupervised slot does not end the accepted run"
EAL_DIFFERENCES = {
    "run-past-unsupervised": f"{RUN_PAST_UNSUPERVISED}: the candidate counts hits past it; the "
                             "reference stops at the first slot that is not a supervised hit"}


def own_eals(side: SideOutputs, case: Case) -> dict[str, float | None]:
    """A side's EAL under every definition (:func:`eal_by_definition`) on its own logits,
    labels (``targets``' argmax, else its ``target_ids``) and aligned loss mask (empty when
    one of them is missing)."""
    t = side.tensors
    labels = t.get("targets", t.get("target_ids"))
    if labels is None or not {"logits", "aligned_loss_mask"} <= set(t):
        return {}
    return eal_by_definition(t["logits"], labels, t["aligned_loss_mask"],
                             case.config.block_size, case.config.sample_from_anchor)


def eal_definitions(side: SideOutputs, case: Case, value: float | None = None) -> list[str]:
    """Which EAL definitions (:data:`EAL_DEFINITIONS`) reproduce a side's reported EAL from
    its own logits, labels and aligned loss mask (empty when none does or data is missing)."""
    value = eal_value(side.metrics) if value is None else value
    if value is None:
        return []
    return [name for name, v in own_eals(side, case).items()
            if v is not None and abs(v - value) <= 1e-5 * max(1.0, abs(value))]


def _count_keys(metrics: dict[str, float]) -> list[str]:
    return [k for k in metrics if (k.startswith("position_") or k.startswith("full_acc"))]


def check_metrics(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Per-slot accuracy sums/totals, full accuracy, EAL and loss-valued metrics of both sides.

    Metrics are logged, not trained on, so this fails only on a non-finite candidate metric
    (NaN never "agrees"); it warns where values differ
    (other than argmax near-ties of logits that agree within tolerance) and where the two
    sides' EAL follows different definitions — which one each side's number matches is
    detected from its own tensors and named (version-dependent: speculators 0.9.0 reports
    "leading-run", main@c05b95b "product-of-marginals")."""
    if not cand.metrics:
        return not_provided("metrics", case, "metrics")
    diffs, missing = {}, []
    for k in sorted(set(_count_keys(ref.metrics)) | {"loss_sum"} |
                    {k for k in ref.metrics if k.endswith("_loss_sum")}):
        if k not in ref.metrics:
            continue
        c, r = cand.metrics.get(k), ref.metrics[k]
        if c is None:
            missing.append(k)
        elif not abs(c - r) <= 1e-5 * max(1.0, abs(r)):  # NaN: differs
            diffs[k] = {"candidate": c, "reference": r}
    ce, re_ = eal_value(cand.metrics), eal_value(ref.metrics)
    c_defs = eal_definitions(cand, case, ce)
    r_defs = [d for d in eal_definitions(ref, case, re_) if d in REFERENCE_EAL_DEFINITIONS]
    details = {"eal": {"candidate": ce, "reference": re_, "candidate_definition": c_defs,
                       "reference_definition": r_defs, "definitions": EAL_DEFINITIONS},
               "differences": diffs}
    reasons = []
    if ce is not None and re_ is not None and c_defs and r_defs and not set(c_defs) & set(r_defs):
        reasons.append(f"EAL definitions differ: candidate {c_defs[0]!r} "
                       f"({EAL_DEFINITIONS[c_defs[0]]}) = {ce:.4g}, reference {r_defs[0]!r} "
                       f"({EAL_DEFINITIONS[r_defs[0]]}) = {re_:.4g}")
    elif ce is not None and re_ is not None and not abs(ce - re_) <= 1e-5 * max(1.0,
                                                                                abs(re_)):
        diffs["eal"] = {"candidate": ce, "reference": re_}
    elif re_ is not None and ce is None:
        missing.append("eal")
    details["not_provided"] = missing
    value_diffs = {k: v for k, v in diffs.items() if k == "eal" or k in _count_keys(ref.metrics)}
    if value_diffs and _near_ties_only(case, cand, ref):
        details["near_ties"] = sorted(value_diffs)
        for k in value_diffs:
            diffs.pop(k)
    if diffs:
        shown = ", ".join(f"{k}: {v['candidate']} vs {v['reference']}"
                          for k, v in list(diffs.items())[:4])
        reasons.append(f"{len(diffs)} metric(s) differ ({shown})")
    if missing:
        reasons.append(f"not provided by the candidate: {', '.join(missing[:6])}"
                       + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else ""))
    if not reasons:
        note = (f"; differences only from argmax near-ties of logits equal within tolerance "
                f"({', '.join(details['near_ties'])})") if details.get("near_ties") else ""
        defs = f" (EAL definition: {r_defs[0]})" if r_defs else ""
        return CheckResult("metrics", case.name, PASS, f"metrics agree{defs}{note}",
                           candidate=ce, reference=re_, details=details)
    first_key = next(iter(diffs), "eal" if c_defs != r_defs else None)
    non_finite = sorted(k for k, v in cand.metrics.items() if isinstance(v, (int, float))
                        and not math.isfinite(v))
    if non_finite:  # policy of dflash_audit.audit.protocol: the training signal is broken
        details["non_finite"] = non_finite
        return CheckResult("metrics", case.name, FAIL, f"candidate metrics not finite: "
                           f"{', '.join(f'{k} = {cand.metrics[k]}' for k in non_finite[:4])}"
                           + (f" (+{len(non_finite) - 4} more)" if len(non_finite) > 4 else "")
                           + " (a NaN acceptance metric means the training signal is broken)",
                           candidate=ce, reference=re_, first_diff={"metric": non_finite[0]},
                           details=details)
    return CheckResult("metrics", case.name, WARN,
                       "; ".join(reasons) + " (metrics do not change training)",
                       candidate=ce, reference=re_,
                       first_diff=({"metric": first_key, **diffs.get(first_key, {})}
                                   if first_key else None),
                       details=details)


def _near_ties_only(case: Case, cand: SideOutputs, ref: SideOutputs) -> bool:
    """Whether both sides' logits and targets agree within tolerance on supervised slots and
    the candidate's metrics (counts, and its EAL under one of the definitions) follow the
    reference's definitions on its own tensors — then any remaining count difference comes
    from argmax near-ties."""
    keys = ("logits", "targets", "aligned_loss_mask")
    if not all(k in cand.tensors and k in ref.tensors for k in keys):
        return False
    sup = supervised_slots(case, ref)
    for k in ("logits", "targets"):
        c, r = cand.tensors[k], ref.tensors[k]
        if c.shape != r.shape or not closeness(c[:, sup], r[:, sup], **tolerance(case, k)).ok:
            return False
    own = dflash_metrics(cand.tensors["logits"], cand.tensors["targets"],
                         cand.tensors["aligned_loss_mask"], case.config.block_size,
                         case.config.sample_from_anchor)
    return all(abs(own[k] - cand.metrics[k]) <= 1e-6 for k in _count_keys(cand.metrics)
               if k in own) and (eal_value(cand.metrics) is None or bool(
                   eal_definitions(cand, case)))


def eal_offset_causes(ev: Evidence, result: CheckResult) -> list[str]:
    """An EAL that is one of the definitions of :data:`EAL_DEFINITIONS` on the candidate's own
    tensors plus or minus 1: the bonus token counted twice, or left out. Named only where the
    case tells the readings apart: never when the candidate's number equals a definition on its
    own tensors (the reference's among them), and only when exactly one definition +-1 fits."""
    diff = result.details.get("differences", {}).get("eal")
    if not diff or "targets" not in ev.cand.tensors:
        return []
    ce = diff["candidate"]

    def same(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-5 * max(1.0, abs(a))

    own: dict[str, float] = {}
    for name, value in own_eals(ev.cand, ev.case).items():  # equal readings: the first name
        if value is not None and not any(same(value, v) for v in own.values()):
            own[name] = value
    if any(v is not None and same(ce, v) for v in own.values()):
        return []  # the number is a definition itself: no offset to name
    fits = [(name, value, d, why) for name, value in own.items() if value is not None
            for d, why in ((1, "the bonus token counted twice"), (-1, "the bonus token left out"))
            if same(ce, value + d)]
    if len(fits) != 1:
        return []
    name, value, d, why = fits[0]
    return [f"acceptance length off by {d:+d}: the candidate's EAL {ce:.4g} is the "
            f"{name!r} definition on its own logits ({value:.4g}) {d:+d} ({why})"]


def data_token_accuracy(ev: Evidence, keys: list[str]) -> bool:
    """Whether the candidate's differing metrics ``keys`` are the reference's definitions with
    the data tokens input_ids[a+s] as labels instead of argmax of its targets."""
    t = ev.cand.tensors
    labels = ev.data_labels
    if bool((labels < 0).any()):
        return False
    V = t["logits"].shape[-1]
    hard = torch.nn.functional.one_hot(labels, V).float()[None]
    other = dflash_metrics(t["logits"], hard, t["aligned_loss_mask"], ev.config.block_size,
                           ev.config.sample_from_anchor)
    return all(k in other and abs(other[k] - ev.cand.metrics[k]) <= 1e-6 for k in keys)


def diagnose_metrics(ev: Evidence, result: CheckResult) -> list[str]:
    """EAL definitions that differ, metrics computed differently, upstream differences."""
    eal = result.details.get("eal", {})
    out = []
    cd, rd = eal.get("candidate_definition") or [], eal.get("reference_definition") or []
    if cd and rd and not set(cd) & set(rd):
        own = own_eals(ev.cand, ev.case)
        if cd[0] in EAL_DIFFERENCES:
            also = f"; also equal to {comma_list([repr(d) for d in cd[1:]])}" if cd[1:] else ""
            out.append(f"acceptance length: {EAL_DIFFERENCES[cd[0]]} (on the candidate's own "
                       f"logits: {cd[0]!r} {own[cd[0]]:.4g}, the reference's {rd[0]!r} "
                       f"{own[rd[0]]:.4g}{also})")
        else:
            out.append(f"acceptance-length definitions differ: the candidate's EAL is {cd[0]!r} "
                       f"({EAL_DEFINITIONS[cd[0]]}), the reference's {rd[0]!r} "
                       f"({EAL_DEFINITIONS[rd[0]]}); the reference changed definitions between "
                       "versions (0.9.0: leading-run, main@c05b95b: product-of-marginals)")
    t = ev.cand.tensors
    if {"logits", "targets", "aligned_loss_mask"} <= set(t):
        own = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"],
                             ev.config.block_size, ev.config.sample_from_anchor)
        odd = [k for k in result.details.get("differences", {})
               if k in own and k in ev.cand.metrics and abs(own[k] - ev.cand.metrics[k]) > 1e-6]
        if odd and data_token_accuracy(ev, odd):
            out.append(f"{DATA_TOKEN_ACCURACY}: {comma_list(odd[:4])} follow that definition "
                       "on the candidate's own logits")
        elif odd and _slot_range_flipped(ev, odd):
            sfa = ev.config.sample_from_anchor
            out.append(f"accuracy and acceptance metrics computed over slots "
                       f"{'1' if sfa else '0'}..B-1 where the reference counts slots "
                       f"{'0' if sfa else '1'}..B-1 (sample_from_anchor={sfa}: the anchor slot "
                       f"is {'' if sfa else 'not '}a draft prediction; speculators PR 760)")
        elif odd:
            out.append(f"the candidate computes {comma_list(odd)} differently: the reference's "
                       f"definition on its own logits gives "
                       + ", ".join(f"{k}={own[k]:g} (reported {ev.cand.metrics[k]:g})"
                                   for k in odd[:3]))
    out += eal_offset_causes(ev, result)
    upstream = follows_from("metrics", ev)
    if upstream and result.details.get("differences"):
        out.append(f"metric values {upstream.replace('follows', 'follow')}")
    return out


def _slot_range_flipped(ev: Evidence, keys: list[str]) -> bool:
    """Whether the candidate's differing metrics ``keys`` are the reference's definition on its
    own tensors with the other ``sample_from_anchor`` slot range (slot 0 counted or skipped)."""
    t = ev.cand.tensors
    other = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"],
                           ev.config.block_size, not ev.config.sample_from_anchor)
    return all(k in other and abs(other[k] - ev.cand.metrics[k]) <= 1e-6 for k in keys)
