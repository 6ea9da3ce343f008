"""The attention rule of one drafting step: which context positions and which block slots
each slot of a block sees, in training and at serving, per draft layer.

Layout of one step (DESIGN.md section 3; the engines' drafting step): the anchor ``a`` is the
last accepted token, the context is the verifier's hidden states at positions ``< a`` of the
same document, the block's slot s sits at position ``a + s``. A *mask* here is the
``[B, T + B]`` bool rows of one block (True = may attend; columns ``< T`` context, ``>= T``
the block's slots), for a row of ``T`` context positions and one anchor.

Training masks come from the reference's own mask builder (its probe) and our
``model/mask.py``; a serving mask is built from what the engine's code resolved for the layer
(window, causality, where the window is counted from), by :func:`serving_mask`, unless the
engine's probe gave its own.
"""

from __future__ import annotations

from typing import Any

import torch

#: ``window_origin`` values: the window counted back from the anchor (the reference's
#: ``kv >= a - W`` for every slot), or from each query's own position (``kv > a + s - W``:
#: flash / flex attention's sliding window applied to the block's positions).
ORIGINS = ("anchor", "query")


def serving_mask(document_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 window: int | None, block_causal: bool, origin: str | None) -> torch.Tensor:
    """``[Q, T + Q]`` bool (Q = A * B): the rule an engine runs for blocks at ``anchors``.

    Context column kv (< T) is visible to slot s of the block at anchor a when it is in a's
    document (not padding, -1), ``kv < a`` and, for a window W, ``kv >= a - W`` (origin
    ``"anchor"``) or ``a + s - kv < W`` (origin ``"query"``: flash / flex attention's window
    over the block's positions, which also bounds the block itself, ``|q - k| < W``). Block
    column T + k is visible when it is the same block and ``k <= q`` (causal) or always.

    Args:
        document_ids: [T] or [1, T] int64.
        anchors: [A] int64.

    Raises:
        ValueError: an origin other than :data:`ORIGINS` for a windowed layer.
    """
    if window is not None and origin not in ORIGINS:
        raise ValueError(f"window_origin {origin!r}: expected one of {ORIGINS}")
    doc = document_ids.reshape(-1)
    T, B = doc.numel(), block_size
    Q = anchors.numel() * B
    a = anchors.long().repeat_interleave(B)[:, None]
    s = (torch.arange(Q) % B)[:, None]
    kv = torch.arange(T)[None, :]
    base = (doc[None, :] == doc[a]) & (doc[a] != -1) & (kv < a)
    k = torch.arange(Q)[None, :]
    q = torch.arange(Q)[:, None]
    block = (k // B) == (q // B)
    if block_causal:
        block &= k <= q
    if window is not None:
        if origin == "query":
            base &= (a + s) - kv < window
            block &= (q - k) < window
            if not block_causal:
                block &= (k - q) < window
        else:
            base &= kv >= a - window
    return torch.cat([base, block], dim=1)


def block_rows(mask: Any, total_seq_len: int) -> torch.Tensor:
    """The ``[B, T + B]`` bool rows of one block from a probe's ``rows`` (lists of 0/1)."""
    rows = torch.as_tensor(mask).bool()
    if rows.dim() != 2 or rows.shape[1] <= total_seq_len:
        raise ValueError(f"a block mask must be [B, T + B] with T = {total_seq_len}, got "
                         f"{list(rows.shape)}")
    return rows


def rule_of(rows: torch.Tensor, anchor: int, total_seq_len: int) -> dict[str, Any]:
    """What each slot sees, as offsets from the anchor.

    Returns:
        ``{"context": [[lo, hi] | None per slot], "slots": [[t, ...] per slot],
        "block_causal": bool}``: ``lo..hi`` are ``kv - anchor`` of the first and last
        visible context position (``lo`` is ``"start"`` when the slot sees back to the
        row's first position, i.e. no window bound was hit); ``None`` when it sees none.
    """
    T = total_seq_len
    context, slots = [], []
    for row in rows:
        idx = torch.nonzero(row[:T]).flatten()
        if idx.numel() == 0:
            context.append(None)
        else:
            lo = "start" if int(idx[0]) == 0 else int(idx[0]) - anchor
            context.append([lo, int(idx[-1]) - anchor])
        slots.append([int(t) for t in torch.nonzero(row[T:]).flatten()])
    B = rows.shape[0]
    causal = all(slots[s] == list(range(s + 1)) for s in range(B))
    return {"context": context, "slots": slots, "block_causal": causal}


def window_origin(rule: dict[str, Any], window: int | None) -> str | None:
    """``"anchor"`` / ``"query"`` / ``"other"`` from a rule's context ranges (None for no
    window): every slot's first position ``-W`` is the anchor rule, ``s + 1 - W`` per slot the
    query rule."""
    if window is None:
        return None
    lows = [c[0] if c else None for c in rule["context"]]
    if all(lo == -window for lo in lows):
        return "anchor"
    if all(lo == s + 1 - window for s, lo in enumerate(lows)):
        return "query"
    return "other"


def rule_differences(trained: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """One line per slot whose visible context or slots differ (empty when equal), over the
    slots both have: a block size that differs is the block-size field's row (a warn where the
    engine drafts fewer slots than were trained), not each missing slot's."""
    out = []
    for s, (tc, sc) in enumerate(zip(trained["context"], served["context"])):
        if tc != sc:
            out.append(f"slot {s} sees context {_span(sc)} at serving, {_span(tc)} in training")
    for s, (tb, sb) in enumerate(zip(trained["slots"], served["slots"])):
        if tb != sb:
            out.append(f"slot {s} sees block slots {sb} at serving, {tb} in training")
    return out


def _span(c: list | None) -> str:
    if c is None:
        return "nothing"
    lo, hi = c
    left = "the document start" if lo == "start" else f"a{lo:+d}"
    return f"{left}..a{hi:+d}"
