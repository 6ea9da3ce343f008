"""Each captured slice, and the last state, against every verifier layer's output.

For a row the files hold ``hidden_states`` ``[T, n*H]`` (slice j = target layer j, ascending
ids) and ``verifier_last_hidden_states`` ``[T, H]`` (the last layer, id N, pre-norm). Each is
compared with the N+2 recomputed candidates of :mod:`~dflash_audit.batch_audit.recompute`
(ids 0..N and ``post-norm``); the closest one within its tolerance is the layer the slice
*equals*. Hypotheses, each with its name in :attr:`Check.finding`:

- ``layer N-k``: the slice equals another layer's output than the files say (e.g. the last
  state taken two layers short: ``layer N-2``; a target slice at ``layer 28`` for id 29);
- ``post-norm``: the slice equals the final norm of the last layer's output (HF
  ``hidden_states[-1]``); the drafter norms the last state itself, so it would be normed twice;
- ``cross-document attention``: no layer per document, but the first document equals layer
  L and the whole row equals layer L recomputed in one causal forward over the packed row
  (:mod:`~dflash_audit.batch_audit.capture_attention`, which also says what the evidence
  cannot tell apart);
- ``no layer``: no candidate within tolerance (another verifier, other weights, positions
  wrong within a document, or a dtype far from the files'); on a packed row the message adds
  what the documents showed (the first one equal to a layer, later ones not).

Before any matching, each slice's values are checked (:func:`value_problem`): a slice that is
not floating point (``dtype int32``) or holds NaN / inf (``non-finite``) fails with that name
and is not matched (a NaN distance would otherwise read as "equals layer 0").
"""

from __future__ import annotations

import torch

from dflash_audit.batch_audit.capture_attention import PackedStates, explain_no_layer
from dflash_audit.batch_audit.files import Row
from dflash_audit.batch_audit.recompute import LayerStates, token_mask
from dflash_audit.batch_audit.result import FAIL, PASS, Check

LAST = "verifier_last_hidden_states"


def _relation(matched: int, expected: int, n: int) -> str:
    """``layer N-2`` style name of a layer relative to N, or ``layer 7`` for shallow ones."""
    return f"layer N-{n - matched}" if matched > n // 2 else f"layer {matched}"


def _judge(name: str, row: Row, x, expected: int | None, states: LayerStates, tokens,
           what: str, packed: PackedStates | None) -> tuple[Check, int | None]:
    n = states.num_layers
    best, dist = states.closest(x, tokens)
    tol = states.tolerance[best]
    details = {"matched": states.label(best), "expected": None if expected is None
               else states.label(expected), "error": dist[best], "tolerance": tol,
               "error_to_expected": None if expected is None else dist[expected],
               "dtype": str(states.dtype).removeprefix("torch.")}
    if dist[best] > tol:
        named, layer, evidence = explain_no_layer(name, row, x, expected, states, packed)
        if named is not None:
            return named, layer
        why = f"; {evidence}" if evidence else (" (another verifier or weights, wrong "
                                                 "positions, or a different dtype)")
        return Check(name, FAIL, f"{name} equals no layer of this verifier: closest is "
                     f"{states.label(best)} at error {dist[best]:.3g} > tolerance {tol:.3g}"
                     f"{why}", row=row.name, finding="no layer", details=details), None
    matched = None if best == n + 1 else best
    if expected is None or best == expected:
        return Check(name, PASS, f"{name} equals {states.label(best)}'s output{what} (error "
                     f"{dist[best]:.2g} <= {tol:.2g})", row=row.name, details=details), matched
    if best == n + 1:
        return Check(name, FAIL, f"{name} is post-norm: it equals the final norm of the last "
                     f"layer's output (HF hidden_states[-1]), not {states.label(expected)}'s "
                     "output; the drafter norms it again (normed twice downstream)",
                     row=row.name, finding="post-norm", details=details), matched
    relation = _relation(best, expected, n)
    return Check(name, FAIL, f"{name} equals layer {best}'s output; the files say "
                 f"{states.label(expected)}{what}: L = {relation.removeprefix('layer ')}",
                 row=row.name, finding=relation, details=details), matched


def value_problem(name: str, row: Row, x: torch.Tensor) -> Check | None:
    """A failing check when ``x`` (slice ``name`` of ``row``, [T, H]) is not floating point
    (finding ``dtype <name>``) or holds NaN / inf (finding ``non-finite``, first token named);
    None when its values can be matched."""
    if not x.is_floating_point():
        dtype = str(x.dtype).removeprefix("torch.")
        return Check(name, FAIL, f"{name} holds {dtype} values; hidden states are floating "
                     "point (float32, bfloat16 or float16): the capture wrote another tensor "
                     "or cast it", row=row.name, finding=f"dtype {dtype}",
                     details={"dtype": dtype})
    bad = ~torch.isfinite(x)
    if bad.any():
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        token = int(bad.nonzero()[0][0])
        return Check(name, FAIL, f"{name} holds {nan} NaN and {inf} inf of {x.numel()} "
                     f"values (first at token {token}): a capture in too low a precision or a "
                     "broken verifier", row=row.name, finding="non-finite",
                     details={"nan": nan, "inf": inf, "first_token": token})
    return None


def check_layers(row: Row, states: LayerStates, target_layer_ids: list[int] | None,
                 hidden_size: int, packed: PackedStates | None = None
                 ) -> tuple[list[Check], list[int | None]]:
    """Judge every slice of ``row`` (see the module docstring).

    Args:
        row: the files' row; ``hidden_states`` must be ``[T, n*hidden_size]``.
        states: the recomputed candidates for this row.
        target_layer_ids: what the files say slice j is (speculators convention), or ``None``
            when they do not say (each slice is then only located).
        hidden_size: H.
        packed: the row recomputed over the packed row (causal mask across documents), asked
            for only when a slice equals no layer per document; None: not examined.

    Returns:
        One check per slice then the last state's, and the layer id each target slice
        actually equals (``None`` where it equals none, or post-norm).
    """
    tokens = token_mask(row.input_ids.numel(), row.documents)
    n_slices = row.hidden_states.shape[-1] // hidden_size
    checks, measured = [], []
    for j in range(n_slices):
        expected = target_layer_ids[j] if target_layer_ids else None
        x = row.hidden_states[:, j * hidden_size:(j + 1) * hidden_size]
        bad = value_problem(f"hidden_states[{j}]", row, x)
        check, matched = (bad, None) if bad else _judge(f"hidden_states[{j}]", row, x,
                                                        expected, states, tokens, "",
                                                        packed)
        checks.append(check)
        measured.append(matched)
    bad = value_problem(LAST, row, row.last)
    check = bad or _judge(LAST, row, row.last, states.num_layers, states, tokens,
                          " (the last layer, pre-norm)", packed)[0]
    checks.append(check)
    return checks, measured
