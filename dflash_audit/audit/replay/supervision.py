"""Per-slot supervision hypotheses of the ``loss`` check: which slots a candidate trains.

The reference trains slot s of anchor a where ``loss_mask[a+s]`` and ``anchor_valid``, slot 0
excluded unless ``sample_from_anchor`` (speculators 0.9.0 ``models/dflash/core.py:472-484``).
A candidate may take the per-slot supervision from another mask the case holds: the attention
(non-padding) mask (NeMo Automodel PR 2214, first revision: prompt tokens trained), all ones (no
mask at all), the anchor's document (document boundaries instead of loss_mask), or loss_mask
cut at document boundaries; and, with any of them, keep slot 0, ignore ``anchor_valid`` or read
the mask one position off. Every combination is a hypothesis (:func:`aligned_mask_hypotheses`);
sources that are the same mask on a case are one hypothesis naming all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from dflash_audit.audit.replay.evidence import Evidence

#: Masks a per-slot supervision may be read from: (what, what it trains); loss_mask first.
SOURCES: dict[str, tuple[str, str]] = {
    "loss_mask": ("loss_mask", ""),
    "attention": ("the attention (non-padding) mask, document_ids != -1",
                  "every non-padding slot trained, prompt tokens included"),
    "ones": ("all ones (no supervision mask)", "every slot trained, padding included"),
    "document": ("the anchor's document (document boundaries)",
                 "every slot inside the anchor's document trained"),
    "loss_mask_in_document": ("loss_mask cut at document boundaries",
                              "loss_mask slots past the anchor's document not trained, where "
                              "the reference trains loss_mask[a+s] across them"),
}


def source_cause(names: list[str]) -> str:
    """"per-slot supervision taken from <mask> instead of loss_mask: <what it trains>" for
    sources that are the same mask on a case."""
    what = " or ".join(SOURCES[n][0] for n in names)
    tie = " (the same mask on this case)" if len(names) > 1 else ""
    return f"per-slot supervision taken from {what}{tie} instead of loss_mask: " \
           f"{SOURCES[names[0]][1]}"


def source_masks(ev: Evidence, d: int = 0) -> dict[str, torch.Tensor]:
    """Each :data:`SOURCES` mask read at ``a+s+d`` (modulo T), as [Q] bool."""
    loss_mask, docs = ev.inputs["loss_mask"].reshape(-1).bool(), ev.inputs["document_ids"]
    docs = docs.reshape(-1)
    T, B = loss_mask.numel(), ev.config.block_size
    p = (ev.block_idx + d) % T
    anchor_doc = docs[ev.inputs["anchor_positions"].long() % T].repeat_interleave(B)
    same = (docs[p] == anchor_doc) & (docs[p] != -1)
    return {"loss_mask": loss_mask[p], "attention": docs[p] != -1,
            "ones": torch.ones_like(loss_mask[p]), "document": same,
            "loss_mask_in_document": loss_mask[p] & same}


def aligned_mask_hypotheses(ev: Evidence) -> Iterator[tuple[str, torch.Tensor]]:
    """Supervision source (:data:`SOURCES`) x ``a+s+d`` (d = 0, 1, -1) x slot 0 (zeroed / kept)
    x anchor_valid (applied / ignored), as (cause, [Q] bool), the reference's own combination
    left out; sources equal on the case are one hypothesis (a source equal to loss_mask is
    loss_mask)."""
    B = ev.config.block_size
    valid = ev.inputs["anchor_valid"].bool().repeat_interleave(B)
    slot0 = torch.arange(ev.block_idx.numel()) % B == 0
    zero0 = not ev.config.sample_from_anchor
    for d in (0, 1, -1):
        groups: list[tuple[list[str], torch.Tensor]] = []
        for name, mask in source_masks(ev, d).items():
            same = next((g for g in groups if torch.equal(g[1], mask)), None)
            if same is None:
                groups.append(([name], mask))
            elif "loss_mask" not in same[0]:
                same[0].append(name)
        for (names, source), keep0, use_valid in itertools.product(
                groups, (not zero0, zero0), (True, False)):
            m = source & valid if use_valid else source.clone()
            if not keep0:
                m = m & ~slot0
            causes = []
            if "loss_mask" not in names:
                causes.append(source_cause(names))
            if keep0 and zero0:
                causes.append("slot 0 (the anchor itself) not masked out of the loss")
            if not keep0 and not zero0:
                causes.append("slot 0 masked out although sample_from_anchor trains it")
            if not use_valid:
                causes.append("padding anchors (anchor_valid False) not masked out of the loss")
            if d:
                causes.append(f"loss mask misaligned: loss_mask[a+s{d:+d}] instead of "
                              "loss_mask[a+s]")
            if causes:
                yield "; ".join(causes), m


def supervision_counts(ev: Evidence, cand: torch.Tensor) -> str:
    """``(on this case: ...)``: how many slots the candidate's [Q] bool mask trains against
    the reference's aligned mask, and how many of each kind differ."""
    ref, loss_mask = ev.sup, source_masks(ev)["loss_mask"]
    extra, missing = cand & ~ref, ref & ~cand
    parts = [f"the candidate trains {int(cand.sum())} slots, the reference {int(ref.sum())}"]
    if extra.any():
        outside = int((extra & ~loss_mask).sum())
        parts.append(f"{int(extra.sum())} trained that the reference does not"
                     + (f", {outside} of them outside loss_mask" if outside else ""))
    if missing.any():
        parts.append(f"{int(missing.sum())} of the reference's not trained")
    return f" (on this case: {'; '.join(parts)})"
