"""Which fixed per-slot weight formula a candidate's loss weights follow (the ``loss`` check's
weight hypotheses).

The reference's fixed-exp-decay weights (speculators ``models/dflash`` loss, our
:func:`dflash_audit.model.loss.exp_decay_weights`) are ``w_s = exp(-(s - s0) / gamma)`` with
``s0 = 1`` and ``w_0 = 0`` (slot 0, the anchor, is not trained), or ``s0 = 0`` and slot 0 on
the formula under ``sample_from_anchor``. A hypothesis changes one or more of: gamma (the
value fitted from the weights), no decay at all (``w_s = 1``), the offset ``s0`` by one, slot
0's weight, or a common scale (weights normalised per block). Each is compared with the
candidate's per-slot weights on the slots the case supervises; only the hypotheses with the
fewest deviations are named, and where several remain the case cannot separate them: they are
named together with the slots a separating case must supervise.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Relative tolerance of a per-slot weight match (weights are fp32 exponentials).
WEIGHT_RTOL = 1e-3


@dataclass(frozen=True)
class WeightFormula:
    """``w_s = scale * exp(-(s - s0) / gamma)`` (``scale`` for ``gamma`` None: no decay), slot
    0 weighted ``w0`` when given, else on the formula."""

    gamma: float | None
    s0: int
    w0: float | None
    scale: float = 1.0

    def weight(self, s: int) -> float:
        if s == 0 and self.w0 is not None:
            return self.w0
        decay = 1.0 if self.gamma is None else math.exp(-(s - self.s0) / self.gamma)
        return self.scale * decay


def reference_formula(gamma: float, sample_from_anchor: bool) -> WeightFormula:
    """The reference's fixed-exp-decay weights."""
    return WeightFormula(gamma, 0, None) if sample_from_anchor else WeightFormula(gamma, 1, 0.0)


def _decay(f: WeightFormula) -> str:
    return "exp(-s/gamma)" if f.s0 == 0 else f"exp(-(s{-f.s0:+d})/gamma)"


def deviations(f: WeightFormula, ref: WeightFormula, sample_from_anchor: bool) -> list[str]:
    """The named differences of ``f`` from the reference formula, slot 0 first."""
    out = []
    w0, r0 = f.weight(0), ref.weight(0)
    if abs(w0 - r0) > WEIGHT_RTOL * max(1.0, abs(r0)):
        if sample_from_anchor:
            out.append(f"slot 0 weighted {w0:.4g} where sample_from_anchor trains it with "
                       f"weight {r0:.4g} (fit {w0:.4g} vs {r0:.4g})")
        else:
            out.append(f"slot 0 weighted (w_0 = {w0:.3g}; reference 0): the anchor slot is not "
                       "masked out of the loss")
    if f.gamma is None:
        out.append(f"no position decay (w_s = {f.scale:.4g}); reference "
                   f"{_decay(ref).replace('gamma', f'{ref.gamma:g}')}")
        return out
    if abs(f.gamma - ref.gamma) > 1e-3 * ref.gamma:
        out.append(f"decay gamma {f.gamma:.4g} (fitted from the weights: w_(s+1)/w_s = "
                   f"exp(-1/gamma)), reference {ref.gamma:g}")
    if f.s0 != ref.s0:
        out.append(f"decay formula {_decay(f)} instead of {_decay(ref)}")
    if abs(f.scale - 1.0) > WEIGHT_RTOL:
        out.append(f"per-slot weights scaled by {f.scale:.4g} (e.g. normalised per block)")
    return out


def _matches(f: WeightFormula, per_slot: dict[int, float]) -> bool:
    return all(abs(f.weight(s) - w) <= WEIGHT_RTOL * max(abs(w), 1e-6) + 1e-7
               for s, w in per_slot.items())


def weight_formula_causes(per_slot: dict[int, float], gamma_fit: float | None,
                          gamma: float, sample_from_anchor: bool, block_size: int
                          ) -> list[str]:
    """Name the formula of a candidate's fixed per-slot weights.

    Args:
        per_slot: the candidate's weight per supervised slot {s: w_s} (median over blocks).
        gamma_fit: the gamma fitted from those weights (:func:`fit_decay`), or
            None with fewer than two decaying slots.
        gamma: the profile's gamma; sample_from_anchor: the config's flag; block_size: B.

    Returns:
        One cause (the deviations of the single best hypothesis, joined by "; "), or, where
        several hypotheses with the same number of deviations reproduce the weights, one cause
        naming them all and the slots a separating case must supervise; [] when none does.
    """
    ref = reference_formula(gamma, sample_from_anchor)
    gammas = [gamma, None] + ([gamma_fit] if gamma_fit and abs(gamma_fit - gamma) > 1e-3 * gamma
                              else [])
    w0s = [ref.w0] + ([per_slot[0]] if 0 in per_slot else [])
    found: dict[tuple[str, ...], int] = {}
    for g, d, w0 in itertools.product(gammas, (0, -1, 1), w0s):
        f = WeightFormula(g, ref.s0 + d, w0)
        trained = [s for s in per_slot if s > 0 or w0 is None]
        if g is None and trained:  # no decay: a constant weight, possibly not 1
            f = WeightFormula(None, f.s0, w0, per_slot[trained[0]])
        if (g is None and d) or not _matches(f, per_slot):
            continue
        named = tuple(deviations(f, ref, sample_from_anchor))
        if named:  # a constant other than 1 is no decay and a scale: two deviations
            found[named] = len(named) + (g is None and abs(f.scale - 1.0) > WEIGHT_RTOL)
    decaying = [s for s in per_slot if s >= 1 or sample_from_anchor]
    if len(decaying) == 1 and not found.get(()):  # one slot: a common scale also fits
        s = decaying[0]
        if ref.weight(s) > 0:
            scaled = WeightFormula(ref.gamma, ref.s0, ref.w0, per_slot[s] / ref.weight(s))
            if _matches(scaled, per_slot):
                named = tuple(deviations(scaled, ref, sample_from_anchor))
                found.setdefault(named, len(named))
    if not found:
        return []
    fewest = min(found.values())
    best = ["; ".join(named) for named, n in found.items() if n == fewest]
    if len(best) == 1:
        return best
    seen = sorted(per_slot)
    return [f"{' or '.join(best)}: this case supervises only slot(s) {seen} of each block and "
            f"cannot tell them apart; a case supervising two or more of slots 1..{block_size - 1}"
            " in one block separates them"]


def fit_decay(weights: torch.Tensor, supervised: torch.Tensor, block_size: int
              ) -> dict[str, float | None] | None:
    """Fit ``w_s = exp(-(s - s0) / gamma)`` to per-position weights on supervised slots.

    Args:
        weights: [1,Q] or [Q]; supervised: [Q] bool; block_size: B.

    Returns:
        ``{"gamma", "offset" (s0: 1 for exp(-(s-1)/g), 0 for exp(-s/g)), "w0" (weight of slot 0
        where seen, else None), "constant_per_slot" (same weight in every block)}``, gamma and
        offset None when fewer than two slots carry positive weight; None without supervised
        slots. Each slot's weight is its median over supervised positions.
    """
    w = weights.reshape(-1, block_size).double()
    m = supervised.reshape(-1, block_size)
    if not m.any():
        return None
    per_slot, constant = {}, True
    for s in range(block_size):
        vals = w[:, s][m[:, s]]
        if vals.numel():
            per_slot[s] = float(vals.median())
            constant &= bool((vals - vals.median()).abs().max() <= 1e-6 * max(1.0, abs(
                per_slot[s])))
    w0 = per_slot.get(0)
    pts = [(s, math.log(v)) for s, v in per_slot.items() if s >= 1 and v > 0]
    gamma = offset = None
    if len(pts) >= 2:
        n = len(pts)
        sx, sy = sum(p[0] for p in pts), sum(p[1] for p in pts)
        sxx, sxy = sum(p[0] ** 2 for p in pts), sum(p[0] * p[1] for p in pts)
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        intercept = (sy - slope * sx) / n
        if slope < 0:
            gamma = -1.0 / slope
            offset = intercept * gamma  # log w = (s0 - s)/g  =>  intercept = s0/g
    return {"gamma": gamma, "offset": offset, "w0": w0, "constant_per_slot": constant,
            "per_slot": per_slot}


def no_decay_causes(fit: dict[str, Any], sample_from_anchor: bool) -> list[str]:
    """Name candidate weights that are not the ``none`` weighting's (w_0 = 0 unless
    sample_from_anchor, every other trained slot 1; SpecForge's ``loss_decay_gamma=None``)."""
    out = []
    w0 = fit["per_slot"].get(0)
    if not sample_from_anchor and w0 is not None and abs(w0) > 1e-6:
        out.append(f"slot 0 weighted (w_0 = {w0:.3g}; reference 0): the anchor slot is not "
                   "masked out of the loss")
    if fit.get("gamma") is not None:
        out.append(f"per-slot weights decay (gamma {fit['gamma']:.4g} fitted from the weights) "
                   "where the profile's weighting 'none' gives every trained slot weight 1")
    elif any(abs(w - 1.0) > 1e-3 for s, w in fit["per_slot"].items() if s > 0):
        other = {s: round(w, 4) for s, w in fit["per_slot"].items() if s > 0}
        out.append(f"per-slot weights {other} where the profile's weighting 'none' gives every "
                   "trained slot weight 1")
    return out
