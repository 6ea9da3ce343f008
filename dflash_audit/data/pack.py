"""Pack tokenized conversations (documents) into one ``[1, T]`` row.

Layout of a packed row (reference names and pad values, DESIGN.md section 3):

| key          | dtype | value                                   | pad |
|--------------|-------|-----------------------------------------|-----|
| input_ids    | int64 | verifier tokens, documents back to back | 0   |
| loss_mask    | int64 | 1 on assistant tokens (incl. end-of-turn)| 0   |
| position_ids | int64 | 0..len-1, restarting for each document  | 0   |
| document_ids | int64 | 0..k-1, the document of each position   | -1  |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from dflash_audit.data.errors import DataError
from dflash_audit.data.tokenize import TokenizedConversation

C = TypeVar("C")


@dataclass
class PackedRow:
    """One packed row: four ``[1, T]`` int64 tensors and the documents in it (in order)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    documents: list[TokenizedConversation] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        """T."""
        return int(self.input_ids.shape[1])

    @property
    def lengths(self) -> list[int]:
        """Token count of each document, in row order."""
        return [len(d) for d in self.documents]

    def document_bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` positions of each document in the row."""
        bounds, start = [], 0
        for n in self.lengths:
            bounds.append((start, start + n))
            start += n
        return bounds


def pack_row(documents: Sequence[TokenizedConversation], seq_len: int) -> PackedRow:
    """Pack ``documents`` back to back into a ``[1, seq_len]`` row, padding the tail.

    Raises:
        DataError: the documents are longer than ``seq_len`` together, or there are none.
    """
    total = sum(len(d) for d in documents)
    if not documents or total > seq_len:
        raise DataError(f"cannot pack {len(documents)} documents of {total} tokens into a "
                        f"row of {seq_len}")
    input_ids = torch.zeros(1, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(1, seq_len, dtype=torch.long)
    position_ids = torch.zeros(1, seq_len, dtype=torch.long)
    document_ids = torch.full((1, seq_len), -1, dtype=torch.long)
    start = 0
    for k, doc in enumerate(documents):
        end = start + len(doc)
        input_ids[0, start:end] = torch.tensor(doc.input_ids, dtype=torch.long)
        loss_mask[0, start:end] = torch.tensor(doc.loss_mask, dtype=torch.long)
        position_ids[0, start:end] = torch.arange(len(doc))
        document_ids[0, start:end] = k
        start = end
    return PackedRow(input_ids, loss_mask, position_ids, document_ids, list(documents))


def pack_stream(documents: Iterable[TokenizedConversation], seq_len: int) -> Iterator[PackedRow]:
    """Next-fit packing: fill a row in stream order, start a new row when a document does
    not fit. Every document must be at most ``seq_len`` tokens (tokenization truncates).

    Yields rows lazily, so the caller can stop after as many rows as it needs; a last
    partly filled row is yielded when the stream ends.
    """
    current: list[TokenizedConversation] = []
    used = 0
    for doc in documents:
        if len(doc) > seq_len:
            raise DataError(f"document {doc.source} has {len(doc)} tokens > seq_len {seq_len}")
        if used + len(doc) > seq_len:
            yield pack_row(current, seq_len)
            current, used = [], 0
        current.append(doc)
        used += len(doc)
    if current:
        yield pack_row(current, seq_len)


def pack_fill(items: Iterable[C], tokenize: Callable[[C, int], TokenizedConversation | None],
              seq_len: int, min_fill: int = 16) -> Iterator[PackedRow]:
    """Pack conversations densely: like :func:`pack_stream`, but a conversation that does not
    fit in the space left in a row is first tried truncated to that space (as the
    reference's collator truncates its last document); the row is closed after it.

    Args:
        items: conversations, in order; each is used at most once (a truncated one is not
            continued in the next row).
        tokenize: ``tokenize(item, budget)`` -> a document of at most ``budget`` tokens, or
            ``None`` when no supervised token fits.
        seq_len: T.
        min_fill: do not try to fill a gap smaller than this many tokens.

    Yields:
        Rows lazily; a last partly filled row when the items run out.
    """
    current: list[TokenizedConversation] = []
    used = 0
    for item in items:
        doc = tokenize(item, seq_len)
        if doc is None:
            continue
        if used + len(doc) <= seq_len:
            current.append(doc)
            used += len(doc)
            continue
        room = seq_len - used
        trimmed = tokenize(item, room) if room >= min_fill else None
        if trimmed is not None:
            current.append(trimmed)
            yield pack_row(current, seq_len)
            current, used = [], 0
            continue
        yield pack_row(current, seq_len)
        current, used = [doc], len(doc)
    if current:
        yield pack_row(current, seq_len)
