"""Loss normalisers: the counts a DFlash loss may be divided by instead of the reference's number
of supervised tokens ``sum(aligned_loss_mask) + 1e-5`` (speculators ``losses/utils.py``).

A loss is a weighted sum over the trained slots divided by one count. Implementations divide by
the number of sampled anchors or blocks (NeMo Automodel PR 2572: ``B * N``, and
``B * N * (block_size - 1)`` in its generic strategy), by the valid anchors (SpecForge issue
828), by the row's tokens, and so on: each is a member of one class, "loss normalised by <count>
instead of the number of supervised tokens". On one case two counts can be equal (no padding
anchor: sampled = valid anchors); the cause then names all of them as one, and a case where they
differ (padding anchors, a block without a supervised slot) separates them. A count whose ratio
to the supervised tokens is a plain constant on the case (2, 1/4, ...) cannot be told from a
loss scaled by that constant there: the cause says so.

The per-case numbers sit in ``(N=...)`` groups, which
:func:`dflash_audit.audit.result.cause_key` drops, so one class on several cases is one cause.
"""

from __future__ import annotations

import torch

#: Count normalisers of a loss hypothesis (denominator name -> words), most common first.
#: ``slots`` (all Q) and ``batch`` (1 row) are the older members, worded in
#: :func:`dflash_audit.audit.replay.loss_formulas.formula_causes`.
COUNTS: dict[str, str] = {
    "anchors": "the number of sampled anchors (padding anchors included)",
    "valid_anchors": "the number of valid anchors (anchor_valid)",
    "supervised_blocks": "the number of blocks with a supervised slot",
    "predicted_slots": "the number of predicted slots, anchors x (block_size - 1)",
    "valid_predicted_slots": "valid anchors x (block_size - 1)",
    "valid_slots": "the slots of the valid anchors, valid anchors x block_size",
    "row_loss_tokens": "the row's loss_mask tokens (sum of loss_mask, not per slot)",
    "row_tokens": "the row's tokens (T, padding included)",
    "row_real_tokens": "the row's non-padding tokens",
}
#: The older count members (their own wording when alone), named with the others when tied.
OLDER_COUNTS: dict[str, str] = {"slots": "all Q slots (anchors x block_size)",
                                "batch": "the batch size (1 row)"}
#: The reference's normaliser, in the same words.
REFERENCE = "the number of supervised tokens"
#: Largest integer k for which a count ratio of k or 1/k is read as a plain constant.
PLAIN_CONSTANT = 64


def normaliser_counts(inputs: dict[str, torch.Tensor], m: torch.Tensor,
                      block_size: int) -> dict[str, float]:
    """Every :data:`COUNTS` and :data:`OLDER_COUNTS` member on one case: ``inputs`` the case's
    (anchor_positions [A], anchor_valid [A], loss_mask / document_ids [1,T]), ``m`` the aligned
    mask [1,Q] or [Q] (float or bool) the loss is reduced under. Returns {name: count}
    (floats)."""
    A = int(inputs["anchor_positions"].numel())
    valid = int(inputs["anchor_valid"].bool().sum())
    per_block = m.reshape(-1, block_size).float().sum(-1)
    docs = inputs.get("document_ids")
    T = int(inputs["loss_mask"].shape[-1])
    return {"anchors": float(A), "valid_anchors": float(valid),
            "supervised_blocks": float((per_block > 0).sum()),
            "predicted_slots": float(A * (block_size - 1)),
            "valid_predicted_slots": float(valid * (block_size - 1)),
            "valid_slots": float(valid * block_size),
            "row_loss_tokens": float(inputs["loss_mask"].bool().sum()),
            "row_tokens": float(T),
            "row_real_tokens": float((docs != -1).sum()) if docs is not None else float(T),
            "slots": float(A * block_size), "batch": 1.0}


def plain_constant(k: float) -> str | None:
    """``"2"`` / ``"1/4"`` when ``k`` is an integer or the reciprocal of one (up to
    :data:`PLAIN_CONSTANT`, within 1e-6 relative), else None."""
    for value, text in ((k, "{}"), (1.0 / k if k else 0.0, "1/{}")):
        n = round(value)
        if 2 <= n <= PLAIN_CONSTANT and abs(value - n) <= 1e-6 * n:
            return text.format(n)
    return None


def _n(x: float) -> str:
    return f"{x:.6g}"


def count_cause(names: list[str], counts: dict[str, float], supervised: float) -> str:
    """The class in words: "loss normalised by <count> (N=..) instead of the number of
    supervised tokens (N=..)". Several ``names`` that reproduce the loss on the case (equal
    counts, or counts within the loss tolerance of each other) are named together; a ratio that
    is a plain constant on the case is named as the alternative it cannot be told from here."""
    words = {**COUNTS, **OLDER_COUNTS}
    values = [counts[n] for n in names]
    same = len(set(values)) == 1
    if same:
        what = f"{' or '.join(words[n] for n in names)} (N={_n(values[0])})"
    else:
        what = " or ".join(f"{words[n]} (N={_n(counts[n])})" for n in names)
    tie = "" if len(names) == 1 else (
        " (equal on this case; a case where they differ separates them)" if same else
        " (within the loss tolerance of each other on this case)")
    text = f"loss normalised by {what} instead of {REFERENCE} (N={_n(supervised)}){tie}"
    k = plain_constant(supervised / values[0]) if same and values[0] else None
    if k:
        text += (f", or a loss scaled by the constant {k}: the two are equal on this case (N="
                 f"{_n(values[0])} x {k} = {_n(supervised)}), a case with another count "
                 "separates them")
    return text


def merge_count_causes(causes: list[list[str]], denoms: list[str], counts: dict[str, float],
                       supervised: float) -> list[list[str]]:
    """Tied formulas (lists of causes, one per denominator in ``denoms``, each reproducing the
    loss) of the same loss whose denominators are counts (:data:`COUNTS`,
    :data:`OLDER_COUNTS`) become one formula with one :func:`count_cause` naming them all; the
    others (and a count alone) are returned unchanged, in their order."""
    out: list[list[str]] = []
    groups: dict[tuple, int] = {}  # the loss's causes -> index in out
    members: dict[int, list[str]] = {}
    for causes_i, denom in zip(causes, denoms):
        if denom not in counts:
            out.append(causes_i)
            continue
        key = tuple(causes_i[:-1])  # the denominator's cause comes last
        if key not in groups:
            groups[key] = len(out)
            members[len(out)] = []
            out.append(causes_i)
        members[groups[key]].append(denom)
    for i, names in members.items():
        if len(names) > 1:
            out[i] = [*out[i][:-1], count_cause(names, counts, supervised)]
    return out


def count_of_scale(counts: dict[str, float], supervised: float, k: float,
                   rtol: float) -> list[str]:
    """The :data:`COUNTS` members ``N`` with ``supervised / N`` = ``k`` within ``rtol``
    (relative): the counts a backward on the loss normalised by ``N`` would scale every
    gradient by ``k`` for."""
    return [n for n, c in counts.items()
            if c > 0 and abs(supervised / c - k) <= rtol * abs(k)]
