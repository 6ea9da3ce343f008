"""Which slots, rows and positions can change training, and their coordinates.

A query slot q of the noise blocks is anchor j = q // block_size, slot s = q % block_size, at
packed position a_j + s; the reference trains on the slots of its ``aligned_loss_mask``.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.model.drafter import block_indices


def anchors(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``anchor_positions`` [A] int64 and ``anchor_valid`` [A] bool of the case."""
    return case.inputs["anchor_positions"].long(), case.inputs["anchor_valid"].bool()


def supervised_slots(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[Q] bool: the slots the reference trains on (its ``aligned_loss_mask``).

    Without that tensor, the reference contract: ``loss_mask[a_j + s] * anchor_valid_j`` with
    slot 0 zeroed unless ``sample_from_anchor`` (DESIGN.md sec. 3, "Loss")."""
    if "aligned_loss_mask" in ref.tensors:
        return ref.tensors["aligned_loss_mask"].reshape(-1).bool()
    B = case.config.block_size
    pos, valid = anchors(case)
    idx = block_indices(pos, B) % case.inputs["loss_mask"].shape[-1]
    m = case.inputs["loss_mask"][0, idx].bool() & valid.repeat_interleave(B)
    if not case.config.sample_from_anchor:
        m[::B] = False
    return m


def supervised_rows(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[Q] bool: query rows of blocks that hold at least one supervised slot (only these rows
    can change training: rows of other blocks feed no trained logit)."""
    B = case.config.block_size
    blocks = supervised_slots(case, ref).reshape(-1, B).any(-1)
    return blocks.repeat_interleave(B)


def slot_coordinates(case: Case, q: int) -> dict[str, int]:
    """Reference coordinates of query slot q: anchor j, its position, slot s, a_j + s, document."""
    B = case.config.block_size
    pos, _ = anchors(case)
    j, s = divmod(int(q), B)
    a = int(pos[j])
    doc = case.inputs["document_ids"].reshape(-1)
    return {"anchor": j, "anchor_position": a, "slot": s, "position": a + s,
            "document": int(doc[a])}


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A mask as [Q, T+Q] bool (True = may attend); leading size-1 axes are dropped.

    Integer masks are read as 0/1 (1 = attend); float masks holding only 0 and 1 too; other
    float masks as additive (0 = attend, -inf / large negative = blocked). The protocol
    check names every mask that is not bool (:mod:`dflash_audit.audit.protocol`)."""
    while mask.ndim > 2 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point() or bool(((mask == 0) | (mask == 1)).all()) and bool(
            (mask == 1).any()):
        return mask != 0
    return mask == 0


def reference_masks(ref: SideOutputs) -> dict[str, torch.Tensor]:
    """Layer type -> [Q, T+Q] bool mask of one side (keys ``mask.<layer type>``)."""
    return {k.split(".", 1)[1]: as_bool_mask(v) for k, v in ref.tensors.items()
            if k.startswith("mask.")}


def attended_positions(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[T] bool: context positions some supervised block may attend in a reference mask.

    The context elsewhere cannot change training. Without reference masks: every position
    with a document (``document_ids != -1``)."""
    T = case.inputs["document_ids"].shape[-1]
    masks = reference_masks(ref)
    if not masks:
        return case.inputs["document_ids"].reshape(-1) != -1
    rows = supervised_rows(case, ref)
    seen = torch.zeros(T, dtype=torch.bool)
    for m in masks.values():
        if m.shape[-1] >= T and m.shape[0] == rows.numel():
            seen |= m[rows, :T].any(0)
    return seen


def mask_coordinates(case: Case, q: int, kv: int) -> dict[str, Any]:
    """Reference coordinates of mask entry (q, kv): the query's anchor / slot / document and
    either the context position (kv < T) or the block key (anchor, slot) (kv >= T)."""
    B = case.config.block_size
    doc = case.inputs["document_ids"].reshape(-1)
    T = doc.numel()
    out: dict[str, Any] = slot_coordinates(case, q)
    if kv < T:
        out.update(kv_position=int(kv), kv_document=int(doc[kv]))
    else:
        kb, ks = divmod(int(kv) - T, B)
        out.update(block_key={"anchor": kb, "slot": ks})
    return out
