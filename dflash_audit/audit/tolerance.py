"""Tolerances and closeness: how two float tensors are compared.

``|c - r| <= atol + rtol * |r|`` (``torch.testing.assert_close``-style) with ``atol`` / ``rtol``
from :data:`TOLERANCES`, keyed by the dtype the case runs in, or, when the case carries them,
per quantity from the reference's measured noise (:mod:`dflash_audit.audit.precision`);
plus the severity order of statuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_audit.audit.case import Case
from dflash_audit.audit.result import FAIL, PASS, WARN

#: assert_close-style tolerances per dtype the case runs in. fp32 on CPU is bit-reproducible
#: up to reduction order across two implementations of the same math (DESIGN.md sec. 3).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-7, "rtol": 1e-7},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}
STATUS_ORDER = {PASS: 0, WARN: 1, FAIL: 2}
#: fp32 reduction noise grows with the magnitude of what is reduced: a K-term dot product's
#: rounding error is ~ sqrt(K) * eps32 * its scale (statistically; the bound is K * u), and
#: the drafter's longest reductions have K <= 4096 (T + Q keys, the MLP width, H), so two fp32
#: implementations of the same math may differ by up to ~ sqrt(4096) = 64 eps32 x max|value|.
#: An fp32 case's context / targets / logits get ``atol = max(atol, FP32_SCALE * eps32 *
#: max|ref|)``: unchanged below |ref| ~ 1.3, and ~ 7.6e-6 relative above (no bug class the
#: examples ship comes near it; rtol 1e-5 already hides less per element).
FP32_SCALE = 64.0
SCALED_QUANTITIES = ("context", "targets", "logits")


def magnitude_tolerance(case: Case, quantity: str, ref: torch.Tensor,
                        tol: dict[str, float]) -> dict[str, float]:
    """``tol`` with atol raised to FP32_SCALE * eps32 * max|ref| for an fp32 case's context /
    targets / logits (:data:`FP32_SCALE`); any other quantity, dtype or a measured-noise
    tolerance unchanged."""
    if quantity not in SCALED_QUANTITIES or run_dtype(case) != torch.float32 or (
            case.tolerances or {}).get(quantity) is not None or not ref.numel():
        return tol
    scale = float(ref.abs().max())
    if not math.isfinite(scale):  # rare: leave the non-finite values out
        finite = ref[torch.isfinite(ref)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
    eps = torch.finfo(torch.float32).eps
    return {**tol, "atol": max(tol["atol"], FP32_SCALE * eps * scale)}


def worst(statuses) -> str:
    """The most severe of some statuses (fail > warn > pass); pass when empty."""
    return max(statuses, key=STATUS_ORDER.__getitem__, default=PASS)


_CASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_dtype(case: Case) -> torch.dtype:
    """The dtype the case computes in: its ``dtype`` (bf16 = fp32 weights under bf16
    autocast); for an fp32 case with lower-precision weights, that of ``fc.weight``."""
    if case.dtype != "fp32":
        return _CASE_DTYPES.get(case.dtype, torch.float32)
    t = case.weights.get("fc.weight", case.inputs.get("hidden_states"))
    return t.dtype if t is not None else torch.float32


def tolerance(case: Case, quantity: str | None = None) -> dict[str, float]:
    """``{"atol", "rtol"}`` for a quantity of the case (``context``, ``targets``, ``logits``,
    ``loss``, ``loss_weights``, ``grad``, ``metrics``, ``loss_from_logits``): the one derived
    from measured noise when the case carries it, else the table's for the case's dtype (fp32's
    when the dtype is not in the table)."""
    derived = (case.tolerances or {}).get(quantity) if quantity else None
    if derived is not None:
        return {"atol": float(derived["atol"]), "rtol": float(derived["rtol"])}
    return dict(TOLERANCES.get(run_dtype(case), TOLERANCES[torch.float32]))


@dataclass
class Closeness:
    """Elementwise comparison ``|c - r| <= atol + rtol * |r|`` (non-finite values never close).

    ``max_abs`` / ``max_rel`` are over the pairs where both values are finite (0 when there
    is none); ``num_non_finite`` counts pairs where either side is NaN or +-inf (all bad),
    ``non_finite`` says which side holds them (:meth:`non_finite_text`)."""

    ok: bool
    max_abs: float
    max_rel: float
    num_bad: int
    first_bad: tuple[int, ...] | None  # index into the compared tensors
    num_non_finite: int = 0
    non_finite: dict[str, int] | None = None  # {"candidate NaN": n, "reference inf": m, ...}

    def non_finite_text(self) -> str:
        """``12 non-finite (candidate NaN 12)`` or ``""``."""
        if not self.num_non_finite:
            return ""
        parts = ", ".join(f"{k} {v}" for k, v in (self.non_finite or {}).items() if v)
        return f"{self.num_non_finite} non-finite ({parts})"


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (NaN and +-inf are not): one sum, finite only
    when every term is (a NaN or an inf makes it NaN or inf), ten times faster than
    ``torch.isfinite(t).all()`` on large tensors; a sum that overflowed on finite values
    falls back to that elementwise test. Non-float tensors are finite."""
    if not t.is_floating_point():
        return bool(torch.isfinite(t).all()) if t.is_complex() else True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def closeness(cand: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> Closeness:
    """Compare two same-shape tensors (any float dtype; computed in fp32 or fp64)."""
    dtype = torch.float64 if torch.float64 in (cand.dtype, ref.dtype) else torch.float32
    c, r = cand.detach().to(dtype), ref.detach().to(dtype)
    if c.numel() == 0:
        return Closeness(True, 0.0, 0.0, 0, None)
    diff = (c - r).abs()
    r_abs = r.abs()
    bad = ~(diff <= atol + rtol * r_abs)  # NaN -> bad
    num_non_finite, counts, fd, fr = 0, None, diff, r_abs
    if not all_finite(diff):  # rare: count and leave the non-finite pairs out of the maxima
        finite = torch.isfinite(diff)  # False where either side is NaN or +-inf
        bad |= ~finite
        num_non_finite = int((~finite).sum())
        fd, fr = diff[finite], r_abs[finite]
        counts = {f"{side} {kind}": int(fn(t).sum()) for side, t in (("candidate", c),
                                                                      ("reference", r))
                  for kind, fn in (("NaN", torch.isnan), ("inf", torch.isinf))}
    max_abs = float(fd.max()) if fd.numel() else 0.0
    max_rel = float((fd / fr.clamp_min(torch.finfo(dtype).tiny)).max()) if fd.numel() else 0.0
    num_bad = int(bad.sum())
    first = None
    if num_bad:
        flat = int(bad.reshape(-1).to(torch.uint8).argmax())  # first True
        first = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), bad.shape))
    return Closeness(num_bad == 0, max_abs, max_rel, num_bad, first, num_non_finite, counts)


def fmt_diff(x: float) -> str:
    """A difference or tolerance for a summary: 3 significant digits."""
    return f"{x:.3g}"


def grad_tolerance(ref_grad: torch.Tensor, tol: dict[str, float]) -> dict[str, float]:
    """atol scaled by the gradient's magnitude: ``atol * max(1, max|g_ref|)`` over the
    reference's finite values (a NaN / inf there must not widen the tolerance)."""
    finite = ref_grad if all_finite(ref_grad) else ref_grad[
        torch.isfinite(ref_grad)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return {"atol": tol["atol"] * max(1.0, scale), "rtol": tol["rtol"]}
