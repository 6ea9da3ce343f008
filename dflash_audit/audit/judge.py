"""The judging stage of a compare: every check and its diagnosis on every case, plus the
attention-mask pictures of the report.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from dflash_audit.audit.options import MAX_MASK_PICTURES
from dflash_audit.audit.progress import Stages
from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.audit.sides.run_sides import failed_run


def mask_pictures(name: str, case: Any, cand: Any, ref: Any) -> list[Any]:
    """A MaskPicture per layer-type mask of a case (``differs`` set)."""
    import torch

    from dflash_audit.report import MaskPicture

    keys = sorted({k for side in (cand, ref) if side is not None for k in side.tensors
                   if k.startswith("mask.")})
    pictures = []
    for key in keys:
        a = cand.tensors.get(key) if cand is not None else None
        b = ref.tensors.get(key) if ref is not None else None
        differs = a is None or b is None or tuple(a.shape) != tuple(b.shape) or not bool(
            torch.equal(a.bool(), b.bool()))
        pictures.append(MaskPicture(case=name, layer_type=key[5:], candidate=a, reference=b,
                                    seq_len=int(case.inputs["input_ids"].shape[-1]),
                                    block_size=case.config.block_size, differs=differs))
    return pictures


def check_case(case: Any, cand: Any, ref: Any, memo: Any = None) -> list[Any]:
    """run_checks + diagnose (in place) on one case (``memo``: the audit's SearchMemo); a
    crash of the engine on this case's outputs is a failing "checks" result (the outputs
    could not be compared)."""
    from dflash_audit.audit.checks import run_checks
    from dflash_audit.audit.diagnose import diagnose

    try:
        results = list(run_checks(case, cand, ref))
        diagnose(case, cand, ref, results, memo)
    except Exception as exc:  # noqa: BLE001 - reported with the traceback in the report
        return [failed_run("checks", case.name,
                           f"the outputs could not be compared: {type(exc).__name__}: {exc}",
                           traceback.format_exc(),
                           ["the candidate's outputs do not have the shapes / keys of the "
                            "reference's (see the protocol in dflash_audit.candidate)"])]
    return results


def check_without_step(case: Any, cand: Any, ref: Any) -> list[Any]:
    """A case outside the framework's capabilities (``case.unsupported``): its WARN
    ``supported`` result, then only the checks that need no training step (anchors,
    derivation); a check that raises is a failing result naming the error."""
    from dflash_audit.audit.checks import REGISTRY
    from dflash_audit.audit.frameworks.provenance import (
        WITHOUT_STEP,
        unsupported_result,
    )
    from dflash_audit.audit.result import FAIL, CheckResult

    results = [unsupported_result(case)]
    for entry in REGISTRY:
        if entry.name not in WITHOUT_STEP:
            continue
        try:
            out = entry.check(case, cand, ref)
        except Exception as err:  # noqa: BLE001 - reported, not swallowed
            out = CheckResult(entry.name, case.name, FAIL,
                              f"check could not run: {type(err).__name__}: {err}")
        results.extend(out if isinstance(out, list) else [out])
    return results


def check_all(planned: list[Any], outputs: dict[str, Any], cases_dir: Path, st: Stages,
              framework: dict[str, Any] | None = None) -> tuple[list[Any], list[Any]]:
    """Checks + diagnosis of every case; returns the case records and the mask pictures
    (differing masks first, else one example per layer type from a real case).
    ``framework`` (``{"key", "label", "provenance"}`` of an audited framework): results on
    values its adapter computed are marked (:mod:`dflash_audit.audit.frameworks.provenance`)
    and the framework's own rules are named as its (:mod:`dflash_audit.audit.frameworks.rules`).

    Raises:
        CompareSetupError: the reference wrote no outputs for a case the candidate ran on (a
            case the candidate failed fails without them).
    """
    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.audit.replay.evidence import SearchMemo
    from dflash_audit.report import CaseRecord

    records, differing, examples, memo = [], [], [], SearchMemo()
    with st.stage("checks", "checks + diagnosis", total=len(planned)) as advance:
        for p in planned:
            name = p.case.name
            cand, failure = outputs.pop(name)
            try:
                ref = SideOutputs.read(cases_dir / name)
            except (OSError, KeyError, ValueError) as exc:
                if failure is None:
                    raise CompareSetupError(f"the reference wrote no usable outputs for case "
                                            f"{name}: {exc}") from None
                ref = None
            if failure is not None:
                results = [failure]
            elif p.case.unsupported:
                results = check_without_step(p.case, cand, ref)
            else:
                results = check_case(p.case, cand, ref, memo)
            if framework is not None and failure is None:
                from dflash_audit.audit.frameworks.provenance import (
                    case_provenance,
                    mark_provenance,
                )
                from dflash_audit.audit.frameworks.rules import attribute_rules

                mark_provenance(results, case_provenance(framework.get("provenance"), cand),
                                framework.get("label", "the framework"), cand)
                attribute_rules(results, framework)
            records.append(CaseRecord(name=name, kind=p.kind, description=p.case.description,
                                      layout=p.layout, results=results))
            for pic in [] if p.case.unsupported else mask_pictures(name, p.case, cand, ref):
                if pic.differs and len(differing) < MAX_MASK_PICTURES:
                    differing.append(pic)
                elif (not pic.differs and p.kind == "real"
                      and all(e.layer_type != pic.layer_type for e in examples)):
                    examples.append(pic)
            advance(1)
    return records, differing or examples
