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

Each check's hypotheses live in its module (:mod:`dflash_audit.audit.checks`); this module runs
them on the failing and warning results of one case.
"""

from __future__ import annotations

from collections.abc import Callable

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.checks import REGISTRY
from dflash_audit.audit.hard_labels import DATA_TOKENS_CAUSE
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
    for result in results:
        if result.status == PASS or result.summary.startswith(("not provided", "not compared")):
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
