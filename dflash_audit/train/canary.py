"""The gate's canary check: before step 1, ``train`` reruns the candidate on the canary case
an audit recorded after its PASS (:mod:`dflash_audit.audit.sides.canary`) and compares its
outputs with the recorded ones at the audit's tolerance (bool / int tensors exactly, metrics
at relative 1e-5). A difference refuses training with exit code **2**, naming the first
differing output. A report without a canary (``--cases 0``, or one written before canaries)
is accepted on its fingerprints alone; the gate says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash_audit.atomic import file_sha256
from dflash_audit.audit.sides.canary import CANARY_DIR
from dflash_audit.train.gate import GateError


def output_differences(case: Any, now: Any, recorded: Any, tol: dict[str, float]) -> list[str]:
    """How the candidate's outputs ``now`` differ from the ``recorded`` ones (SideOutputs), one
    line per differing output, first difference named; empty when they agree."""
    import torch

    from dflash_audit.audit.tolerance import closeness

    diffs = []
    for key, r in recorded.tensors.items():
        c = now.tensors.get(key)
        if c is None:
            diffs.append(f"{key}: no longer returned")
        elif c.shape != r.shape or c.dtype != r.dtype:
            diffs.append(f"{key}: now {str(c.dtype)[6:]} {list(c.shape)}, audited "
                         f"{str(r.dtype)[6:]} {list(r.shape)}")
        elif r.is_floating_point():
            res = closeness(c, r, **tol)
            if not res.ok:
                non_finite = f", {res.non_finite_text()}" if res.num_non_finite else ""
                diffs.append(f"{key}: {res.num_bad} of {r.numel()} values differ (max abs "
                             f"{res.max_abs:.3g}{non_finite}"
                             f"), first at index {list(res.first_bad)}: now "
                             f"{float(c[res.first_bad]):.6g}, audited "
                             f"{float(r[res.first_bad]):.6g}")
        elif not torch.equal(c, r):
            diffs.append(f"{key}: {int((c != r).sum())} of {r.numel()} values differ")
    for key in sorted(set(now.tensors) - set(recorded.tensors)):
        diffs.append(f"{key}: returned now, not in the audit")
    for key, r in recorded.metrics.items():
        c = now.metrics.get(key)
        if not isinstance(r, (int, float)) or not isinstance(c, (int, float)):
            if c != r:
                diffs.append(f"metric {key}: now {c!r}, audited {r!r}")
        elif not (abs(c - r) <= 1e-5 * max(1.0, abs(r)) or (math.isnan(c) and math.isnan(r))):
            diffs.append(f"metric {key}: now {c}, audited {r}")
    return diffs


def verify_canary(candidate: Any, report_path: Path) -> str:
    """Rerun ``candidate`` (loaded) on the canary of ``report_path``'s folder and compare its
    outputs with the recorded ones; returns a one-line note for the log.

    Raises:
        GateError: the outputs differ (exit code 2; the message names the first outputs that
            differ), the candidate fails on the canary, or the canary files are damaged.
    """
    import json

    from dflash_audit.audit.case import Case, SideOutputs
    from dflash_audit.audit.sides.run_sides import run_candidate

    report_path = Path(report_path)
    info = json.loads(report_path.read_text()).get("candidate", {}).get("canary")
    if not info:
        return (f"the report {report_path} records no canary case (audited with --cases 0 or "
                "by an older dflash-audit): the candidate's behaviour was not re-checked")
    folder = report_path.parent / info.get("folder", CANARY_DIR)
    try:
        if file_sha256(folder / "outputs" / "outputs.safetensors") != info["outputs_sha256"]:
            raise ValueError("outputs.safetensors does not match its sha256 in report.json")
        case, recorded = Case.read(folder / "case"), SideOutputs.read(folder / "outputs")
    except (OSError, ValueError, KeyError) as exc:
        raise GateError(f"the canary of audit report {report_path} is damaged or missing "
                        f"({folder}: {exc}); rerun the audit") from None
    now, failure = run_candidate(candidate, case)
    if failure is not None:
        raise GateError(f"the candidate fails on the audit's canary case {case.name} now: "
                        f"{failure.summary}; it is not the candidate that passed the audit "
                        f"({report_path})")
    diffs = output_differences(case, now, recorded, info.get("tolerance") or {
        "atol": 1e-5, "rtol": 1e-5})
    if diffs:
        listing = "\n".join(f"  - {d}" for d in diffs[:6])
        raise GateError(f"the candidate no longer behaves as audited: on the canary case "
                        f"{case.name} of {report_path} its outputs differ:\n{listing}\n(same "
                        "source, different behaviour: an environment variable, a config file "
                        "or a flag it reads?) Rerun the audit in this environment.")
    if callable(getattr(candidate, "build", None)):  # what train trains: candidate.build()
        trained, failure = run_candidate(_BuiltModel(candidate), case)
        diffs = [failure.summary] if failure is not None else output_differences(
            case, trained, recorded, info.get("tolerance") or {"atol": 1e-5, "rtol": 1e-5})
        if diffs:
            listing = "\n".join(f"  - {d}" for d in diffs[:6])
            raise GateError(f"train trains the model of candidate.build(config), and on the "
                            f"canary case {case.name} of {report_path} it does not give the "
                            f"outputs the audit saw from the candidate's run_case:\n{listing}\n"
                            "Make run_case run the model build() returns (as "
                            "dflash_audit.candidate.DrafterCandidate does) and rerun the audit.")
    return f"canary {case.name}: the candidate's outputs match the audited ones"


class _BuiltModel:
    """The model ``candidate.build(config)`` run the way train runs it: our drafter
    candidate's ``run_case`` around the candidate's ``build``."""

    def __init__(self, candidate: Any) -> None:
        self.candidate = candidate

    def __getattr__(self, name: str) -> Any:  # select_anchors, derive_config: the candidate's
        return getattr(self.candidate, name)

    def run_case(self, config: Any, loss: Any, weights: Any, inputs: Any) -> Any:
        from dflash_audit.candidate import DrafterCandidate

        runner = DrafterCandidate()
        runner.build = self.candidate.build  # type: ignore[method-assign]
        return runner.run_case(config, loss, weights, inputs)
