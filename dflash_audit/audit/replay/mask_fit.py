"""Rule parameters read off a candidate's [Q, T+Q] bool attention mask, for the mask check's
hypotheses (:func:`dflash_audit.audit.checks.mask.mask_hypotheses`): the context offset k of
``kv < anchor + k`` and the window size W, measured from the anchor or from the query, so a rule
of any size is tried, not only the reference's and its neighbours."""

from __future__ import annotations

import torch

from dflash_audit.audit.case import Case


def fitted_context_offset(case: Case, mask: torch.Tensor, rows: torch.Tensor) -> int | None:
    """The offset k of a context rule ``kv < anchor + k`` read off a [Q, T+Q] bool ``mask``: the
    most common ``last visible context position - anchor + 1`` over the ``rows`` (bool [Q]) that
    see any context; None when no such row."""
    B, T = case.config.block_size, case.inputs["document_ids"].numel()
    qa = case.inputs["anchor_positions"].long().repeat_interleave(B)
    ctx = mask[:, :T]
    seen = rows & ctx.any(1)
    if not seen.any():
        return None
    last = T - 1 - ctx[seen].flip(1).int().argmax(1)
    return int(torch.mode(last - qa[seen] + 1).values)


def fitted_windows(case: Case, mask: torch.Tensor, rows: torch.Tensor) -> list[int]:
    """The window sizes W a [Q, T+Q] bool ``mask`` implies on the ``rows`` (bool [Q]) whose
    earliest visible context position f lies past the start of the anchor's document (where a
    window bounds the context): the most common ``a - f`` (a bound from the anchor,
    ``kv >= a - W``) and the most common ``a + s - f + 1`` (a bound from the query's own
    position, ``kv >= a + s - W + 1``), so a window of any size, either way measured, is
    named; [] when no row's context is cut short."""
    B = case.config.block_size
    doc = case.inputs["document_ids"].reshape(-1)
    T = doc.numel()
    a = case.inputs["anchor_positions"].long().repeat_interleave(B)
    s = torch.arange(a.numel()) % B
    ctx = mask[:, :T]
    seen = rows & ctx.any(1)
    if not seen.any():
        return []
    first = ctx.int().argmax(1)
    change = torch.ones(T, dtype=torch.bool)
    change[1:] = doc[1:] != doc[:-1]
    # the first position of each position's document
    starts = torch.cummax(torch.where(change, torch.arange(T), 0), 0).values
    cut = seen & (first > starts[a.clamp(max=T - 1)])
    if not cut.any():
        return []
    return [int(torch.mode(v[cut]).values) for v in (a - first, a + s - first + 1)]
