"""Naming the cause of a failing check (DESIGN.md sec. 5 bug classes).

:func:`diagnose` fills ``CheckResult.diagnosis`` of every non-passing result with named causes,
most likely first. Causes are found by testing hypotheses with our own primitives on the
case's inputs and weights: a hypothesis is a family member (all target sources x norm counts
x shifts, all subsets of target layers, all context-rule offsets x windows x document rules,
position conventions, draft-layer slips (:mod:`dflash_audit.audit.replay.architecture`), loss names
x normalisations, a gamma fitted from the weights) whose prediction is compared with what the
candidate returned, within the check's tolerance. Where several hypotheses reproduce a loss,
only those with the fewest deviations are named.
A hypothesis that reproduces the candidate names the cause; a difference no hypothesis
reproduces is reported as "unexplained difference" with its numbers.

Downstream checks name the upstream difference they follow from ("follows from the mask
difference"), verified where possible by replaying our drafter with the candidate's own
context / masks.

Non-finite logits, loss, gradients and metrics of a candidate with fully masked query rows
(where an eager softmax gives NaN: :mod:`dflash_audit.audit.masked_rows`) are named as
following from them; NaN matches no numeric hypothesis.

Each check's hypotheses live in its module (:mod:`dflash_audit.audit.checks`); this module runs
them on the failing and warning results of one case.
"""

from __future__ import annotations

from collections.abc import Callable

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.checks import REGISTRY
from dflash_audit.audit.hard_labels import DATA_TOKENS_CAUSE
from dflash_audit.audit.masked_rows import MaskedRows, fully_masked_rows
from dflash_audit.audit.replay.evidence import (
    Evidence,
    SearchMemo,
    data_token_consequence,
    unexplained,
)
from dflash_audit.audit.result import FAIL, PASS, CheckResult

#: Check name -> its diagnosis.
DIAGNOSERS: dict[str, Callable[[Evidence, CheckResult], list[str]]] = {
    c.name: c.diagnose for c in REGISTRY}


def diagnose(case: Case, cand: SideOutputs, ref: SideOutputs,
             results: list[CheckResult], memo: SearchMemo | None = None) -> None:
    """Fill ``diagnosis`` of every failing or warning result of one case (in place).

    Results marked "not provided" get none. A diagnoser that raises records that it could not
    run instead of hiding the result. ``memo`` (one per audit, shared by its cases) budgets the
    costly replay searches across cases (:class:`dflash_audit.audit.replay.evidence.SearchMemo`)."""
    ev = Evidence(case, cand, ref, {r.name for r in results if r.status == FAIL}, memo)
    hollow = masked_nan(case, cand, ref)
    for result in results:
        if result.status == PASS or result.summary.startswith(("not provided", "not compared")):
            continue
        if hollow is not None and result.name in NAN_DOWNSTREAM:
            result.diagnosis = [hollow.consequence()]
            continue
        try:
            causes = DIAGNOSERS.get(result.name, lambda e, r: [])(ev, result)
        except Exception as err:  # noqa: BLE001 - a diagnosis must not hide the finding
            causes = [f"diagnosis could not run: {type(err).__name__}: {err}"]
        labels = data_token_consequence(ev) if result.name in ("loss", "metrics") else None
        if labels and not any(DATA_TOKENS_CAUSE in c for c in causes):
            causes = [labels, *causes]
        if not causes and result.status == FAIL:
            causes = [unexplained(result)]
        result.diagnosis = causes


#: Checks whose values carry the NaN of fully masked query rows (:func:`masked_nan`).
NAN_DOWNSTREAM = ("logits", "loss", "gradients", "metrics")


def masked_nan(case: Case, cand: SideOutputs, ref: SideOutputs) -> MaskedRows | None:
    """The candidate's fully masked query rows when non-finite values reach training (what
    its logits, loss, gradients and metrics then follow from: NaN matches no numeric
    hypothesis), else None."""
    try:
        hollow = fully_masked_rows(case, cand, ref)
    except Exception:  # noqa: BLE001 - malformed masks: the mask / protocol checks name them
        return None
    return hollow if hollow is not None and hollow.reaches else None
