"""The ``protocol`` check: both sides' outputs against the output protocol and for non-finite
values (:func:`dflash_audit.audit.protocol.output_findings`), BEFORE any comparison.

One result per case: ``pass`` when both sides follow :data:`~dflash_audit.audit.protocol.
OUTPUT_SPEC` and every value is finite, else the worst finding's status with every finding in
``details["findings"]`` (the summary names the first ones). The policy (fail on any non-finite
value that feeds training, and on a NaN metric) is stated in :mod:`dflash_audit.audit.protocol`.
Exact: dtypes and shapes must match the protocol, no tolerance; any NaN / inf is a finding.
Hypotheses name: a protocol violation (what was returned vs what is expected) and non-finite
values (an overflow, a log of 0, a division by an empty count; or fully masked query rows whose
logits are NaN, as an eager softmax over them gives: :mod:`dflash_audit.audit.masked_rows`).

:func:`conforming_sides` drops the keys a comparison would misread (a wrong dtype, a
value that is not a tensor) from each side, so the checks that follow do not compare a misread
output (an int 0/1 mask read as additive) and do not report the same fault twice; their
results then say "not compared" and point here. Non-finite values are kept: the comparisons
name them too (NaN never compares as equal).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.masked_rows import fully_masked_rows
from dflash_audit.audit.protocol import Finding, label, misread_keys, output_findings
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult

#: Output keys (prefixes) each comparison reads: a check all of whose keys broke the protocol
#: on a side is reported as not compared.
CHECK_KEYS: dict[str, tuple[str, ...]] = {
    "mask": ("mask.",), "context": ("context",), "targets": ("targets", "target_ids"),
    "logits": ("logits",), "loss": ("loss", "aligned_loss_mask", "loss_weights."),
    "gradients": ("grad.",), "metrics": ("metrics",), "anchors": ("anchor_draws",)}
MAX_NAMED = 3


def findings_of(case: Case, cand: SideOutputs, ref: SideOutputs) -> list[Finding]:
    """Protocol and non-finite findings of the reference, then of the candidate, then no
    gradient at all where the reference trains parameters (whatever the candidate's own
    ``trainable`` list claims: an empty list must not excuse a missing backward; a gradient
    missing beside others is the gradients check's to name)."""
    ref_grads = [k for k in ref.tensors if k.startswith("grad.")]
    grads = [] if any(k.startswith("grad.") for k in cand.tensors) or not ref_grads else [
        Finding("protocol", "candidate", "grad.*", f"candidate returned no gradients; the "
                f"reference trains {len(ref_grads)} parameters (e.g. {label(ref_grads[0])})")]
    return (output_findings(ref, case, "reference") + output_findings(cand, case, "candidate")
            + grads)


def check_protocol(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """One ``protocol`` result for the case (see the module docstring)."""
    findings = findings_of(case, cand, ref)
    if not findings:
        return CheckResult("protocol", case.name, PASS, "both sides follow the output "
                           "protocol; every value is finite")
    status = FAIL if any(f.status == FAIL for f in findings) else WARN
    worst = sorted(findings, key=lambda f: f.status != FAIL)
    summary = "; ".join(f.message for f in worst[:MAX_NAMED])
    if len(findings) > MAX_NAMED:
        summary += f"; and {len(findings) - MAX_NAMED} more"
    return CheckResult("protocol", case.name, status, summary, first_diff=worst[0].first,
                       details={"findings": [dataclasses.asdict(f) for f in findings]})


def diagnose_protocol(evidence: Any, result: CheckResult) -> list[str]:
    """What to change: return what the protocol asks (its findings say what was returned)."""
    kinds = {f["kind"] for f in result.details.get("findings", []) if f["status"] == FAIL}
    causes = []
    if "protocol" in kinds:
        causes.append("the outputs do not follow the protocol of dflash_audit.candidate "
                      "(OUTPUT_SPEC in dflash_audit.audit.protocol): masks bool with True = "
                      "attend, float outputs in the case dtype, shapes as listed")
    hollow = fully_masked_rows(evidence.case, evidence.cand, evidence.ref)
    if "non_finite" in kinds and hollow is not None and hollow.reaches:
        causes.append(f"{hollow.describe()} (the cause of the candidate's non-finite values)")
    elif "non_finite" in kinds:
        causes.append("non-finite values (NaN / inf) in outputs that feed training: an "
                      "overflow, a log of 0, a division by an empty count, or uninitialised "
                      "memory; the training signal of such a step is broken")
    return causes


def conforming_sides(case: Case, cand: SideOutputs, ref: SideOutputs
                     ) -> tuple[SideOutputs, SideOutputs, dict[str, set[str]]]:
    """Copies of both sides without the keys a comparison would misread
    (:func:`~dflash_audit.audit.protocol.misread_keys`: a wrong dtype, not a tensor; metrics
    that are not numbers), and ``{side: dropped keys}``. Wrong shapes stay: the checks
    compare and diagnose them."""
    sides = {"candidate": cand, "reference": ref}
    dropped = {side: misread_keys(out, case) for side, out in sides.items()}
    for side, out in sides.items():
        if any(isinstance(v, bool) or not isinstance(v, (int, float))
               for v in out.metrics.values()):
            dropped[side].add("metrics")
    out = []
    for side, outputs in sides.items():
        keys = dropped[side]
        metrics = outputs.metrics
        if "metrics" in keys:
            metrics = {k: v for k, v in metrics.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out.append(dataclasses.replace(
            outputs, tensors={k: v for k, v in outputs.tensors.items() if k not in keys},
            metrics=metrics) if keys else outputs)
    return out[0], out[1], dropped


def not_compared(name: str, case: Case, dropped: dict[str, set[str]]) -> CheckResult | None:
    """A ``warn`` "not compared" result for check ``name`` when a key it reads broke the
    protocol on a side (the protocol result carries the failure), else None."""
    prefixes = CHECK_KEYS.get(name, ())
    hit = sorted(k for keys in dropped.values() for k in keys
                 if k != "metrics" and k.startswith(prefixes))
    if name == "metrics":
        hit = []  # the numeric metrics are still compared
    if not hit:
        return None
    return CheckResult(name, case.name, WARN, f"not compared: {', '.join(map(label, hit))} "
                       "broke the output protocol (see the protocol check)",
                       details={"skipped_keys": hit})
