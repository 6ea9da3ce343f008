"""How the capture attended: per document, or over the packed row with a causal mask across
documents (cross-document attention in the capture).

A slice that equals no layer recomputed per document (:mod:`~dflash_audit.batch_audit.layers`)
is examined on a row of several documents. The evidence, in order:

1. the first document equals layer L per document: under a causal mask it attends to nothing
   before it, so every capture over the row computes it exactly as a per-document one does
   (a first document that equals no layer rules the class out);
2. a later document equals no layer per document;
3. the whole row equals layer L recomputed in one causal forward over the packed row, with
   positions counting on across the row (``model(input_ids=row)``) or restarting per
   document (per-document positions, but one mask over the row).

All three hold: the finding ``cross-document attention`` names the class and which positions
the evidence points to (both within tolerance: it says it cannot tell). Only 1 and 2 hold: the
slice stays ``no layer`` and the message gives that evidence (in place of the generic list of
causes) without naming a cause.

Siblings that the evidence cannot show, so nothing is claimed about them:

- positions not restarting per document while the attention stays within each document: RoPE
  depends on relative positions only, so the states equal the per-document ones within float
  noise (measured 1e-7 on the tiny Llama): nothing a drafter could learn differs;
- padding attended: padding sits at the end of a row, where a causal mask never lets a
  document's token see it, and no drafter query reads the padding's own states;
- a one-document row (the reference's offline format, or a row holding one conversation):
  there is no earlier document to attend to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_audit.batch_audit.files import Row
from dflash_audit.batch_audit.recompute import (
    PACKED_CONTINUE,
    PACKED_RESTART,
    LayerStates,
    token_distance,
    token_mask,
)
from dflash_audit.batch_audit.result import FAIL, Check

CROSS_DOCUMENT = "cross-document attention"
#: What each packed plan says about the positions the capture used.
POSITIONS = {
    PACKED_CONTINUE: "positions counting on across the row, as one plain "
                     "model(input_ids=row) forward computes them",
    PACKED_RESTART: "positions restarting per document, but one causal mask over the row",
}


class PackedStates:
    """The row's states recomputed under each packed plan, computed on first use and kept
    (every slice of a row asks for the same two recomputes)."""

    def __init__(self, recompute: Callable[[str], LayerStates]):
        self._recompute = recompute
        self._states: dict[str, LayerStates | None] = {}

    def __call__(self, plan: str) -> LayerStates | None:
        """The states under ``plan``; None when the row's documents are not contiguous."""
        if plan not in self._states:
            try:
                self._states[plan] = self._recompute(plan)
            except ValueError:  # documents with gaps: the layout check names that
                self._states[plan] = None
        return self._states[plan]


def explain_no_layer(name: str, row: Row, x: torch.Tensor, expected: int | None,
                     states: LayerStates, packed: PackedStates | None
                     ) -> tuple[Check | None, int | None, str]:
    """Examine slice ``x`` ``[T, H]`` of ``row`` that equals no layer per document.

    Args:
        name: the slice's check name (``hidden_states[2]``...).
        expected: the candidate index the files say it is, or None.
        states: the per-document recompute.
        packed: the packed recomputes of this row (None: not examined).

    Returns:
        ``(check, layer, evidence)``: a failing check with finding :data:`CROSS_DOCUMENT` and
        the layer id the slice holds (None for post-norm) when the evidence names the class
        (module docstring), else ``(None, None, evidence)`` where ``evidence`` is what the
        documents showed ("" when nothing), to add to "no layer".
    """
    docs = row.documents
    if packed is None or len(docs) < 2:
        return None, None, ""
    (s0, e0), later = docs[0], docs[1:]
    layer, dist = states.closest(x, token_mask(x.shape[0], docs[:1]))
    if dist[layer] > states.tolerance[layer]:
        return None, None, ""  # the first document is no per-document layer either
    errors = [token_distance(x[s:e], states.states[layer][s:e]) for s, e in later]
    label, tol = states.label(layer), states.tolerance[layer]
    off = [k for k, err in enumerate(errors, start=1) if err > tol]
    if not off:
        return None, None, ""
    shown = (f"document 0 (tokens {s0}-{e0 - 1}) equals {label}'s output per document (error "
             f"{dist[layer]:.2g} <= {tol:.2g}), later documents {off} do not (error up to "
             f"{max(errors):.3g})")
    tokens = token_mask(x.shape[0], docs)
    matches, by_plan = [], {}
    for plan in POSITIONS:
        alt = packed(plan)
        if alt is None:
            return None, None, shown
        best, alt_dist = alt.closest(x, tokens)
        by_plan[plan] = {"closest": alt.label(best), "error": alt_dist[best]}
        if best == layer and alt_dist[best] <= alt.tolerance[best]:
            matches.append((plan, alt_dist[best]))
    if not matches:
        return None, None, (f"{shown}, nor over the packed row with a causal mask "
                            "(positions counting on or restarting)")
    plans = [p for p, _ in matches]
    err = min(e for _, e in matches)
    positions = POSITIONS[plans[0]] if len(plans) == 1 else (
        "positions counting on or restarting: both recomputes match, the evidence does not "
        "tell which")
    also = "" if expected is None or expected == layer else (
        f"; and it is {label}'s output where the files say {states.label(expected)}")
    message = (f"{name} was captured over the packed row with a causal mask across documents "
               f"(cross-document attention in the capture; {positions}): {shown}, and the "
               f"whole row equals {label} recomputed over the packed row "
               f"(error {err:.2g} <= {tol:.2g}): each later document's states saw the "
               f"documents packed before it{also}")
    details = {"matched": label, "expected": None if expected is None
               else states.label(expected), "capture": plans, "error": err, "tolerance": tol,
               "first_document_error": dist[layer], "packed_recomputes": by_plan,
               "document_errors_per_document": [round(e, 6) for e in errors],
               "dtype": str(states.dtype).removeprefix("torch.")}
    return (Check(name, FAIL, message, row=row.name, finding=CROSS_DOCUMENT, details=details),
            None if layer == states.num_layers + 1 else layer, shown)
