"""The adapter's row layout for NVIDIA ModelOpt: a packed audit row as one ModelOpt row per
conversation, and ModelOpt's per-row outputs back in the reference's coordinates.

ModelOpt trains one conversation per row (its offline ``.pt`` dumps, ``OfflineSupervisedDataset``
and ``EagleOfflineDataCollator``, modelopt/torch/speculative/eagle/utils.py:83-218: each row
padded to ``training_seq_len``, no document ids, positions ``arange`` per row). The reference
trains one packed row [1, T] with ``document_ids``. So the adapter (this module, glue only)
cuts the packed row at document boundaries: document d becomes row r = d, its tokens first,
zeros after (length L, a multiple of the block size, as ModelOpt requires,
hf_dflash.py:930-934). Each reference anchor j at packed position a in document d becomes
block ``anchor_block[j]`` of row d at row position ``a - start_d``; padding anchors
(``anchor_valid`` False) become padding blocks of row 0. Nothing here computes a quantity of
training: it moves ModelOpt's own tensors between the two coordinate systems.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RowLayoutError(ValueError):
    """A packed row the adapter cannot cut into conversations (named in the message)."""


@dataclass
class RowLayout:
    """Where each document and anchor of a packed row lives in ModelOpt's batch.

    ``starts`` / ``lengths``: packed start and token count of row r's document;
    ``row_len``: L; ``anchor_row`` / ``anchor_block``: [A] long, row and block index of each
    reference anchor; ``anchors`` / ``keep``: [R, N] row-local anchor positions and validity,
    what ModelOpt's ``_sample_anchor_positions`` returns (hf_dflash.py:605-644).
    """

    starts: list[int]
    lengths: list[int]
    row_len: int
    block_size: int
    anchor_row: torch.Tensor
    anchor_block: torch.Tensor
    anchors: torch.Tensor
    keep: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.starts)


def documents(document_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, length)]`` of each document of a packed row ``document_ids`` [1, T] (long,
    -1 = padding), in order. A row without document ids >= 0 is one document.

    Raises:
        RowLayoutError: a document is not contiguous.
    """
    doc = document_ids.reshape(-1)
    ids = [int(d) for d in torch.unique_consecutive(doc[doc >= 0])]
    if not ids:
        return [(0, int(doc.numel()))]
    if len(set(ids)) != len(ids):
        raise RowLayoutError("a document of the packed row is split in two (document_ids not "
                             "contiguous); ModelOpt rows hold one conversation each")
    out = []
    for d in ids:
        where = (doc == d).nonzero().reshape(-1)
        out.append((int(where[0]), int(where.numel())))
    return out


def plan_rows(inputs: dict[str, torch.Tensor], block_size: int) -> RowLayout:
    """The row layout of a case's ``inputs`` (``document_ids`` [1,T], ``anchor_positions`` [A],
    ``anchor_valid`` [A]) for block size B.

    Raises:
        RowLayoutError: a valid anchor lies on padding (document id -1), or documents are not
            contiguous.
    """
    docs = documents(inputs["document_ids"])
    doc_ids = inputs["document_ids"].reshape(-1)
    starts = [s for s, _ in docs]
    lengths = [n for _, n in docs]
    row_len = -(-max(lengths) // block_size) * block_size
    positions = inputs["anchor_positions"].reshape(-1).long()
    valid = inputs["anchor_valid"].reshape(-1).bool()
    rows, blocks, local = [], [], []
    count = [0] * len(docs)
    for a, v in zip(positions.tolist(), valid.tolist()):
        if v:
            if len(docs) > 1 and int(doc_ids[a]) < 0:
                raise RowLayoutError(f"valid anchor {a} lies on padding (document id -1)")
            r = max(i for i, s in enumerate(starts) if s <= a)
            pos = a - starts[r]
        else:
            r, pos = 0, 0
        rows.append(r)
        blocks.append(count[r])
        local.append((pos, v))
        count[r] += 1
    n = max(1, max(count))
    anchors = torch.zeros(len(docs), n, dtype=torch.long)
    keep = torch.zeros(len(docs), n, dtype=torch.bool)
    for r, b, (pos, v) in zip(rows, blocks, local):
        anchors[r, b], keep[r, b] = pos, v
    return RowLayout(starts, lengths, row_len, block_size, torch.tensor(rows, dtype=torch.long),
                     torch.tensor(blocks, dtype=torch.long), anchors, keep)


def row_slices(layout: RowLayout, tensor: torch.Tensor) -> list[torch.Tensor]:
    """One [len_r, ...] slice per row of a packed tensor [1, T, ...] (a conversation's part)."""
    t = tensor[0]
    return [t[s:s + n] for s, n in zip(layout.starts, layout.lengths)]


def slot_index(layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row [Q], index [Q])``: where reference slot q = j*B + s lives in ModelOpt's
    [R, N*B, ...] outputs."""
    B = layout.block_size
    s = torch.arange(B).repeat(layout.anchor_row.numel())
    return (layout.anchor_row.repeat_interleave(B),
            layout.anchor_block.repeat_interleave(B) * B + s)


def to_slots(layout: RowLayout, tensor: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-row slot tensor [R, N*B, ...] (or [R, N, B, ...]) as the reference's
    [1, Q, ...] (Q = A*B, anchors in the reference's order)."""
    R, N, B = layout.rows, layout.anchors.shape[1], layout.block_size
    blocked = tensor.ndim >= 3 and tuple(tensor.shape[:3]) == (R, N, B)
    t = tensor.reshape(R, N * B, *tensor.shape[3 if blocked else 2:])
    row, idx = slot_index(layout)
    return t[row, idx].unsqueeze(0)


def to_packed_context(layout: RowLayout, context: torch.Tensor, seq_len: int) -> torch.Tensor:
    """ModelOpt's context [R, L, H] as the packed row's [1, T, H]; positions of no document
    (padding) stay 0 (no reference query attends them)."""
    out = context.new_zeros(1, seq_len, context.shape[-1])
    for r, (s, n) in enumerate(zip(layout.starts, layout.lengths)):
        out[0, s:s + n] = context[r, :n]
    return out


def to_packed_mask(layout: RowLayout, mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """ModelOpt's attention mask [R, 1, N*B, L + N*B] (float: 0 = attend, finfo.min = blocked,
    or bool) as the reference's [Q, T + Q] bool (True = attend). A packed position outside a
    query's conversation, and a block of another conversation, is never attended (ModelOpt's
    row does not hold it)."""
    keep = (mask == 0) if mask.is_floating_point() else mask.bool()
    keep = keep[:, 0]
    L = layout.row_len
    row, idx = slot_index(layout)
    starts = torch.tensor(layout.starts)[row]
    lengths = torch.tensor(layout.lengths)[row]
    local = torch.arange(seq_len)[None, :] - starts[:, None]  # [Q, T]
    inside = (local >= 0) & (local < lengths[:, None])
    context = keep[row[:, None], idx[:, None], local.clamp(0, L - 1)] & inside
    block_cols = L + idx  # the block column of every reference slot, in its own row
    block = keep[row[:, None], idx[:, None], block_cols[None, :]] & (row[None, :] == row[:, None])
    return torch.cat([context, block], dim=1)
