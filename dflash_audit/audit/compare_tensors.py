"""The shared body of the float tensor checks (context, targets, logits): presence, shape and
closeness on the selection that can change training, with the first differing element in the
reference's coordinates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.audit.slots import slot_coordinates, supervised_slots
from dflash_audit.audit.tolerance import (
    closeness,
    fmt_diff,
    magnitude_tolerance,
    tolerance,
)


def not_provided(name: str, case: Case, what: str, side: str = "candidate",
                 **kw: Any) -> CheckResult:
    """A ``warn`` "not provided" result: the ``side`` returned no ``what`` (never a crash)."""
    return CheckResult(name=name, case=case.name, status=WARN,
                       summary=f"not provided: the {side} returned no {what}", **kw)


def tensor_result(name: str, case: Case, cand: SideOutputs, ref: SideOutputs,
                  select: Callable[[torch.Tensor], torch.Tensor], where: str,
                  locate: Callable[[tuple[int, ...]], dict[str, Any]]) -> CheckResult:
    """Shared body of the float tensor checks: presence, shape, closeness on a selection."""
    if name not in ref.tensors:
        return not_provided(name, case, name, side="reference")
    if name not in cand.tensors:
        return not_provided(name, case, name)
    c, r = cand.tensors[name], ref.tensors[name]
    tol = tolerance(case, name)
    if c.shape != r.shape:
        return CheckResult(name, case.name, FAIL,
                           f"{name} shape {list(c.shape)} != reference {list(r.shape)}",
                           candidate=list(c.shape), reference=list(r.shape), tolerance=tol)
    cs, rs = select(c), select(r)
    tol = magnitude_tolerance(case, name, rs.detach().float(), tol)
    res = closeness(cs, rs, **tol)
    details = {"compared": where, "num_compared": int(rs.numel()), "num_bad": res.num_bad,
               "num_non_finite": res.num_non_finite}
    if res.ok:
        return CheckResult(name, case.name, PASS,
                           f"{name} match on {where} (max abs {fmt_diff(res.max_abs)}, max rel "
                           f"{fmt_diff(res.max_rel)})", tolerance=tol, max_abs_diff=res.max_abs,
                           max_rel_diff=res.max_rel, details=details)
    first = locate(res.first_bad)
    cv, rv = float(cs[res.first_bad]), float(rs[res.first_bad])
    return CheckResult(name, case.name, FAIL,
                       f"{name} differ on {res.num_bad} of {rs.numel()} values ({where}); "
                       + (f"{res.non_finite_text()}; finite pairs: " if res.num_non_finite
                          else "")
                       + f"max abs {fmt_diff(res.max_abs)}, max rel {fmt_diff(res.max_rel)}; "
                       "first at "
                       + ", ".join(f"{k} {v}" for k, v in first.items()),
                       candidate=cv, reference=rv, tolerance=tol, max_abs_diff=res.max_abs,
                       max_rel_diff=res.max_rel, first_diff=first, details=details)


def slot_check(name: str, case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Targets / logits [1,Q,V_d] on the reference's supervised slots."""
    sup = supervised_slots(case, ref)
    slots = sup.nonzero().squeeze(-1)

    def locate(i):
        return {**slot_coordinates(case, int(slots[i[1]])), "vocab": i[2]}

    result = tensor_result(name, case, cand, ref, lambda t: t[:, sup],
                           f"{int(sup.sum())} supervised slots", locate)
    if name in cand.tensors and name in ref.tensors and \
            cand.tensors[name].shape == ref.tensors[name].shape and sup.any():
        same = cand.tensors[name][0, sup].argmax(-1) == ref.tensors[name][0, sup].argmax(-1)
        result.details["argmax_agreement"] = float(same.float().mean())
    return result
