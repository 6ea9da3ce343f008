"""Tolerances of a low-precision audit, derived from the reference's measured noise.

Tolerances for a dtype other than fp32 are not guessed: the reference process runs every
case twice, in the audited dtype and in fp32 on the same (already rounded) inputs, and
reports the largest difference per quantity (``noise`` in its ``outputs.json``).
:func:`derive_tolerances` measures it relative to each case's magnitude (bf16 rounding is
relative), takes the largest relative noise over all cases and gives each case
``atol = max(K * relative noise * its magnitude, fp32 atol)`` per quantity; the report records
the measured noise and the derived tolerances (its ``tolerance`` section).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_audit.audit.case import Case
from dflash_audit.audit.replay.loss_formulas import own_loss

#: Two conforming implementations in a low-precision dtype each sit within the measured noise
#: of the exact result, so they may differ by twice it; K = 4 leaves a factor 2 of margin.
NOISE_FACTOR = 4.0
#: Quantities with a measured noise (keys of the adapter's ``noise``; ``grad`` is scaled by
#: ``max(1, max|g_ref|)`` per parameter as the gradients check does; ``loss_from_logits`` is
#: the reference's loss against the reference formula in fp32 on its own logits and targets).
NOISE_QUANTITIES = ("context", "targets", "logits", "loss", "loss_weights", "grad", "metrics",
                    "loss_from_logits")


def magnitudes(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """The scale of each noise quantity in one side's outputs: max |value| of context, targets,
    logits and the loss weights, |loss| for loss and loss_from_logits; 1 for grad (already
    scaled by its magnitude) and metrics (counts and ratios)."""
    def top(t: torch.Tensor) -> float:
        return float(t.detach().abs().max()) if t.numel() else 0.0

    out = {q: top(tensors[q]) for q in ("context", "targets", "logits") if q in tensors}
    if "loss" in tensors:
        out["loss"] = out["loss_from_logits"] = abs(float(tensors["loss"]))
    weights = [top(v) for k, v in tensors.items() if k.startswith("loss_weights.")]
    if weights:
        out["loss_weights"] = max(weights)
    return {**out, "grad": 1.0, "metrics": 1.0}


def derive_tolerances(dtype: str, noises: list[dict[str, float]],
                      scales: list[dict[str, float]], floor: dict[str, float]
                      ) -> tuple[dict[str, Any], list[dict[str, dict[str, float]]]]:
    """Per-case, per-quantity tolerances of a low-precision audit from measured noise.

    bf16 rounding is relative, so the noise is measured relative to each case's magnitude
    (:func:`magnitudes`): ``rel_q = max over cases of noise_q / scale_q``, and a case gets
    ``atol_q = max(k * rel_q * its scale_q, fp32 atol)``, ``rtol`` = fp32's. A tiny synthetic
    case is then not judged with the absolute noise of a real one, and every case gets at
    least k times the worst relative noise seen on any case.

    Args:
        dtype: the audit dtype.
        noises: per case, ``{quantity: max |low - fp32|}`` of the reference against itself.
        scales: per case, :func:`magnitudes` of the reference's outputs.
        floor: the fp32 ``{"atol", "rtol"}`` (no tolerance is tighter than fp32's).

    Returns:
        (the report's ``tolerance`` section ``{"dtype", "k", "source", "quantities": {q:
        {"measured_max_abs", "measured_max_rel", "atol_min", "atol_max", "rtol"}}}``, one
        ``{quantity: {"atol", "rtol"}}`` per case).
    """
    rel: dict[str, float] = {}
    for noise, scale in zip(noises, scales, strict=True):
        for q, v in noise.items():
            rel[q] = max(rel.get(q, 0.0), float(v) / max(scale.get(q, 1.0), 1e-30))
    per_case = [{q: {"atol": max(NOISE_FACTOR * r * scale.get(q, 1.0), floor["atol"]),
                     "rtol": floor["rtol"]} for q, r in rel.items()} for scale in scales]
    quantities = {q: {"measured_max_abs": max(n.get(q, 0.0) for n in noises),
                      "measured_max_rel": rel[q],
                      "atol_min": min(c[q]["atol"] for c in per_case),
                      "atol_max": max(c[q]["atol"] for c in per_case),
                      "rtol": floor["rtol"]} for q in sorted(rel)}
    section = {"dtype": dtype, "k": NOISE_FACTOR,
               "source": (f"the reference against itself: every case in fp32 and in {dtype}; "
                          "relative to the case's magnitude, largest over all cases"),
               "quantities": quantities}
    return section, per_case


def loss_from_logits_noise(case: Case, ref: Any) -> float | None:
    """|the reference's loss - the reference's formula in fp32 on its own logits, targets,
    mask and weights|: how exactly the loss follows from the logits in this dtype."""
    value = own_loss(case, ref)
    return None if value is None else abs(value - float(ref.tensors["loss"]))


def measured_tolerances(planned: list[Any], cases_dir: Path) -> dict[str, Any]:
    """Derive the per-quantity tolerances of a non-fp32 audit from the noise the reference
    reported for each case (plus :func:`loss_from_logits_noise`), set them on every case
    (``Case.tolerances``) and return the report's ``tolerance`` section ({} in fp32 or when
    the reference wrote no outputs; check_all then reports that)."""
    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.audit.tolerance import TOLERANCES

    low = [p for p in planned if p.case.dtype != "fp32"]
    if not low:
        return {}
    noises, scales = [], []
    for p in low:
        try:
            ref = SideOutputs.read(cases_dir / p.case.name)
        except (OSError, KeyError, ValueError):
            return {}
        n = dict(ref.noise)
        own = loss_from_logits_noise(p.case, ref) if "loss" in ref.tensors else None
        if own is not None:
            n["loss_from_logits"] = own
        noises.append(n)
        scales.append(magnitudes(ref.tensors))
    section, per_case = derive_tolerances(low[0].case.dtype, noises, scales,
                                          TOLERANCES[torch.float32])
    for p, table in zip(low, per_case, strict=True):
        p.case.tolerances = table
    return section
