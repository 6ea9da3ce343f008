"""The cases of a framework audit: the real rows and a synthetic spread the framework supports
(its adapter's CAPABILITIES, :class:`dflash_audit.audit.frameworks.capabilities.Capabilities`).

- A packed row (several documents or padding) for a framework without packed rows becomes a
  single-document variant: the row cut to one document (the first that leaves a valid
  anchor, :func:`single_document`).
- Synthetic cases outside the capabilities are skipped and the spread continues (case
  ``count``, ``count + 1``, ... of the same seeded sequence, so it still cycles over the
  verifier families and layouts the framework supports) until the budget is filled.
- A framework that takes exactly one target layer per draft layer (ModelOpt) gets drafters
  as deep as the profile's target layers (:func:`fitted_profile`; named in the notes).
- What stays unsupported is listed ("not supported by SpecForge 0.2.0: ..."), never failed;
  where the budget cannot be filled with supported cases, unsupported ones fill it with only
  the checks that need no training step (anchors, derivation), ``case.unsupported`` set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_audit.audit.cases.plan import (
    SYNTHETIC_VERIFIER,
    PlannedCase,
    layout_facts,
    plan_flex_padding_case,
    synthetic_planned,
    synthetic_target_layers,
)
from dflash_audit.audit.frameworks.capabilities import Capabilities, single_document

#: Synthetic candidates tried per synthetic case asked for, before unsupported ones fill in.
TRIES_PER_CASE = 12


def _fit(p: PlannedCase, caps: Capabilities, seed: int, dtype: str
         ) -> tuple[PlannedCase, list[tuple[str, str]]]:
    """``p`` as the framework can run it (cut to one document when only packing is in the
    way) and the ``(capability, reason)`` pairs why it still cannot (empty: supported) in the
    audit's ``dtype``."""

    def why(case: Any) -> list[tuple[str, str]]:
        return caps.unsupported_by(dataclasses.replace(case, dtype=dtype))

    reasons = why(p.case)
    if reasons and not caps.packed_rows and any(k == "packed_rows" for k, _ in reasons):
        cut = single_document(p.case, seed=seed)
        if cut is not None:
            p = PlannedCase(cut, p.kind, {**layout_facts(cut), "cut_to_first_document": True})
            reasons = why(cut)
    return p, reasons


def fitted_profile(profile: Any, caps: Capabilities, num_verifier_layers: int,
                   label: str) -> tuple[Any, str | None]:
    """``profile`` with as many draft layers as target layers for an ``num_verifier_layers``
    verifier where ``caps`` takes exactly one target layer per draft layer and the profile's
    depth differs, and the note saying so; else ``(profile, None)``.

    Raises:
        ProfileError: the profile's target layers do not fit the verifier.
    """
    if caps.any_target_layer_count:
        return profile, None
    n = len(profile.resolve_target_layer_ids(num_verifier_layers))
    if n == profile.num_draft_layers:
        return profile, None
    layout = profile.layer_layout
    if isinstance(layout, (list, tuple)):  # a per-layer list: cycled to the new depth
        layout = [layout[k % len(layout)] for k in range(n)]
    return (profile.replace(num_draft_layers=n, layer_layout=layout),
            f"{label} takes exactly one target layer per draft layer: the drafters have as "
            f"many draft layers as target layers ({n} for {num_verifier_layers} verifier "
            f"layers; the profile has {profile.num_draft_layers})")


def _mark(p: PlannedCase, reasons: list[str], label: str) -> PlannedCase:
    case = dataclasses.replace(p.case, unsupported=[f"not supported by {label}: {r}"
                                                    for r in reasons])
    return PlannedCase(case, p.kind, {**p.layout, "unsupported": case.unsupported})


def framework_cases(real: list[PlannedCase], profile: Any, count: int, seed: int,
                    caps: Capabilities, label: str, dtype: str = "fp32",
                    exercised: dict[str, list[str]] | None = None
                    ) -> tuple[list[PlannedCase], list[str]]:
    """The real cases fitted to ``caps`` and ``count`` synthetic cases the framework supports.

    Args:
        real: the real cases (:func:`dflash_audit.audit.cases.plan.plan_real_cases`).
        label: the framework as the report names it (``SpecForge 0.2.0``).
        dtype: the dtype the cases will run in (``fp32`` / ``bf16``).
        exercised: filled with ``{capability: [case names]}``: the cases whose input needed a
            capability ``caps`` lack (cut to one document, or left out): where the
            framework's latent difference (:mod:`dflash_audit.audit.frameworks.latent`)
            would have shown.

    Returns:
        ``(planned cases, notes)``: notes list each distinct reason a case was cut or left
        out, with the cases it concerns.
    """
    planned: list[PlannedCase] = []
    skipped: dict[str, list[str]] = {}
    cut: list[str] = []
    exercised = exercised if exercised is not None else {}

    def count_in(name: str, reasons: list[tuple[str, str]]) -> None:
        for key, r in reasons:
            skipped.setdefault(r, []).append(name)
            exercised.setdefault(key, []).append(name)

    for p in real:
        fitted, reasons = _fit(p, caps, seed, dtype)
        if fitted.case is not p.case:
            cut.append(p.case.name)
            exercised.setdefault("packed_rows", []).append(p.case.name)
        planned.append(_mark(fitted, [r for _, r in reasons], label) if reasons else fitted)
        count_in(p.case.name, reasons)
    synthetic: list[PlannedCase] = []
    spares: list[tuple[PlannedCase, list[str]]] = []
    depth = None if caps.any_target_layer_count else len(synthetic_target_layers(
        profile, SYNTHETIC_VERIFIER["num_hidden_layers"]))
    i = 0
    while len(synthetic) < count and i < max(count, 1) * TRIES_PER_CASE:
        p = synthetic_planned(profile, i, count, seed, num_draft_layers=depth)
        fitted, reasons = _fit(p, caps, seed * 7919 + i, dtype)
        i += 1
        if fitted.case is not p.case:
            exercised.setdefault("packed_rows", []).append(p.case.name)
            if not reasons:
                cut.append(p.case.name)
        if reasons:
            count_in(p.case.name, reasons)
            spares.append((fitted, [r for _, r in reasons]))
            continue
        synthetic.append(fitted)
    for fitted, reasons in spares[: count - len(synthetic)]:
        synthetic.append(_mark(fitted, reasons, label))
    notes = [f"not supported by {label}: {r} (cases {', '.join(names[:4])}"
             + (f" and {len(names) - 4} more" if len(names) > 4 else "") + ")"
             for r, names in skipped.items()]
    if cut:
        notes.append(f"{label} takes one document per row: packed rows were cut to one "
                     f"document each ({', '.join(cut[:4])}"
                     + (f" and {len(cut) - 4} more" if len(cut) > 4 else "") + ")")
    return planned + synthetic, notes


def nothing_runs(planned: list[PlannedCase], caps: Capabilities, label: str,
                 dtype: str = "fp32") -> str | None:
    """The setup error's message when not one of ``planned`` is a case ``caps`` can run (each
    would run only the checks that need no training step, whose warnings alone would pass
    the audit): why, and what to pass instead (``--dtype``, ``--verifier family:...``, a
    profile within the named capabilities); None when some case runs the framework's step."""
    if not planned or any(not p.case.unsupported for p in planned):
        return None
    per_case = [dict(caps.unsupported_by(dataclasses.replace(p.case, dtype=dtype)))
                for p in planned]
    every = [k for k in per_case[0] if all(k in c for c in per_case)]  # what blocks them all
    keys = every or list(dict.fromkeys(k for c in per_case for k in c))
    reasons = list(dict.fromkeys(c[k] for c in per_case for k in keys if k in c))
    hints = [f"--dtype {caps.dtypes[0]}" for k in keys if k == "dtypes" and caps.dtypes]
    hints += [f"--verifier family:{caps.verifier_families[0]}" for k in keys
              if k == "verifier_families" and caps.verifier_families]
    rest = [k for k in keys if k not in ("dtypes", "verifier_families")]
    if rest:
        hints.append(f"a --profile within its CAPABILITIES ({', '.join(rest)})")
    return (f"none of the {len(planned)} audit cases can run on {label}: "
            f"{'; '.join(reasons[:3])}{' ...' if len(reasons) > 3 else ''}. Nothing of its "
            f"training step would be audited, so this audit cannot pass or fail it; rerun with "
            f"{' and '.join(hints) or 'options within its CAPABILITIES'}")


def framework_flex_case(profile: Any, caps: Capabilities, label: str, seed: int = 0,
                        dtype: str = "fp32") -> PlannedCase:
    """The flex-padding case of ``--device cuda`` (:func:`plan_flex_padding_case`) fitted to
    ``caps`` like every other case: a verifier family the framework takes, cut to one
    document where it has no packed rows, as deep as its target layers; marked unsupported
    (named, never failed) when it still cannot run it."""
    from dflash_audit.data.families import FAMILIES

    families = [f for f in FAMILIES if caps.verifier_families is None
                or f in caps.verifier_families] or [None]
    profile, _ = fitted_profile(profile, caps, SYNTHETIC_VERIFIER["num_hidden_layers"], label)
    p, reasons = _fit(plan_flex_padding_case(profile, seed, families[0]), caps, seed, dtype)
    return _mark(p, [r for _, r in reasons], label) if reasons else p
