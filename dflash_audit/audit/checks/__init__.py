"""The audit's checks: one module per quantity that defines DFlash training.

Each module holds its comparison ``check_<name>(case, cand, ref) -> CheckResult`` (``mask``
returns one result per layer type), the hypotheses that explain its differences
(``diagnose_<name>(evidence, result) -> list[str]``, run by
:func:`dflash_audit.audit.diagnose.diagnose`) and their wording; its docstring says what it
compares, at which tolerance and which bug classes its hypotheses name. :data:`REGISTRY` lists
them in report order; adding a check is adding a module and one line there. :func:`run_checks`
runs them all:

``protocol``   each side's outputs against the output protocol (dtype, shape, meaning) and
               for non-finite values, before any comparison (keys that break the protocol
               are then not compared: "not compared", see :mod:`.output_protocol`)
``structure``  deepdiff of the two structure summaries, plus the candidate against the profile
``derivation`` the drafter config each side derives from the case's verifier, field by field
``defaults``   each side's default gamma / loss / weighting / block_size / max_anchors
               (never fails)
``mask``       exact boolean equality, one result per layer type
``context``    hidden_norm(fc(hidden_states)) [1,T,H] on the positions a supervised block sees
``targets``    verifier logits [1,Q,V_d] on supervised slots
``logits``     draft logits [1,Q,V_d] on supervised slots
``loss``       total loss, aligned loss mask, per-slot weights per term (+ the gamma they imply)
``gradients``  every trainable parameter of the reference, tolerance relative to its scale
``metrics``    per-slot accuracy, full accuracy, acceptance length (fails only on a NaN / inf
               candidate metric; otherwise never fails: metrics do
               not change training; a differing EAL definition is a warning naming both)
``anchors``    anchor selection by distribution: support, counts, repeats, per-position z-test

Rules every check follows:

* Only differences that can change training fail. Targets and logits are compared on the
  slots the reference trains on (its ``aligned_loss_mask``), masks on the rows of blocks with
  a supervised slot, the context on the positions those rows can attend.
* An output a candidate does not provide gives ``warn`` "not provided", never a crash.
* Tolerances are ``torch.testing.assert_close``-style, ``|c - r| <= atol + rtol * |r|``, from
  :data:`dflash_audit.audit.tolerance.TOLERANCES` keyed by the dtype the case runs in.
* ``first_diff`` names the first differing element in the reference's coordinates: anchor j,
  slot s, packed position a_j + s, document, and the vocabulary / feature / kv index.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.checks import (
    anchors,
    context,
    defaults,
    derivation,
    gradients,
    logits,
    loss,
    mask,
    metrics,
    output_protocol,
    structure,
    targets,
)
from dflash_audit.audit.result import FAIL, CheckResult


class RegisteredCheck(NamedTuple):
    """One check: its name in the report, its module, its comparison and its diagnosis."""

    name: str
    module: ModuleType
    check: Callable[..., CheckResult | list[CheckResult]]
    diagnose: Callable[..., list[str]]


#: Every check, in report order.
REGISTRY: tuple[RegisteredCheck, ...] = (
    RegisteredCheck("protocol", output_protocol, output_protocol.check_protocol,
                    output_protocol.diagnose_protocol),
    RegisteredCheck("structure", structure, structure.check_structure,
                    structure.diagnose_structure),
    RegisteredCheck("derivation", derivation, derivation.check_derivation,
                    derivation.diagnose_derivation),
    RegisteredCheck("defaults", defaults, defaults.check_defaults, defaults.diagnose_defaults),
    RegisteredCheck("mask", mask, mask.check_masks, mask.diagnose_mask),
    RegisteredCheck("context", context, context.check_context, context.diagnose_context),
    RegisteredCheck("targets", targets, targets.check_targets, targets.diagnose_targets),
    RegisteredCheck("logits", logits, logits.check_logits, logits.diagnose_logits),
    RegisteredCheck("loss", loss, loss.check_loss, loss.diagnose_loss),
    RegisteredCheck("gradients", gradients, gradients.check_gradients,
                    gradients.diagnose_gradients),
    RegisteredCheck("metrics", metrics, metrics.check_metrics, metrics.diagnose_metrics),
    RegisteredCheck("anchors", anchors, anchors.check_anchor_draws, anchors.diagnose_anchors),
)
#: (name, comparison) in report order, what :func:`run_checks` runs.
CHECKS: tuple[tuple[str, Callable[..., CheckResult | list[CheckResult]]], ...] = tuple(
    (c.name, c.check) for c in REGISTRY)


def run_checks(case: Case, cand: SideOutputs, ref: SideOutputs) -> list[CheckResult]:
    """All checks on one case, in report order. ``protocol`` sees both sides as returned; the
    comparisons see them without the keys that broke the protocol (a check reading such a
    key is "not compared"). A check that raises becomes a ``fail`` result naming the error
    (a malformed output must not hide the other checks)."""
    results: list[CheckResult] = []
    try:
        c_ok, r_ok, dropped = output_protocol.conforming_sides(case, cand, ref)
    except Exception:  # noqa: BLE001 - the protocol check itself reports the error
        c_ok, r_ok, dropped = cand, ref, {}
    for name, check in CHECKS:
        skipped = None if name == "protocol" else output_protocol.not_compared(
            name, case, dropped)
        if skipped is not None:
            results.append(skipped)
            continue
        try:
            out = check(case, cand, ref) if name == "protocol" else check(case, c_ok, r_ok)
        except Exception as err:  # noqa: BLE001 - reported, not swallowed
            out = CheckResult(name, case.name, FAIL,
                              f"check could not run: {type(err).__name__}: {err}",
                              details={"error": repr(err)})
        results.extend(out if isinstance(out, list) else [out])
    return results
