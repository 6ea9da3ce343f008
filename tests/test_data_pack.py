"""Packing tokenized conversations into [1, T] rows (reference layout and pad values)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_audit.data.errors import DataError
from dflash_audit.data.pack import pack_fill, pack_row, pack_stream
from dflash_audit.data.tokenize import TokenizedConversation


def doc(n: int, first: int = 10, masked: int = 1, source: str = "") -> TokenizedConversation:
    ids = list(range(first, first + n))
    mask = [0] * (n - masked) + [1] * masked
    return TokenizedConversation(input_ids=ids, loss_mask=mask, source=source)


def test_pack_row_layout():
    row = pack_row([doc(3, 10), doc(2, 20, masked=2)], seq_len=8)
    assert row.input_ids.tolist() == [[10, 11, 12, 20, 21, 0, 0, 0]]
    assert row.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 0, 0]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert row.document_ids.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]
    assert all(t.dtype == torch.int64 for t in (row.input_ids, row.loss_mask, row.position_ids,
                                                row.document_ids))
    assert row.document_bounds() == [(0, 3), (3, 5)] and row.seq_len == 8


def test_pack_row_overflow():
    with pytest.raises(DataError, match="cannot pack"):
        pack_row([doc(5), doc(4)], seq_len=8)
    with pytest.raises(DataError, match="cannot pack"):
        pack_row([], seq_len=8)


def test_pack_stream_is_next_fit_and_lazy():
    docs = [doc(5, source="a"), doc(4, source="b"), doc(3, source="c"), doc(8, source="d")]
    rows = list(pack_stream(iter(docs), seq_len=8))
    assert [[d.source for d in r.documents] for r in rows] == [["a"], ["b", "c"], ["d"]]

    def endless():
        i = 0
        while True:
            i += 1
            yield doc(3, source=str(i))
    first_two = []
    for row in pack_stream(endless(), 8):
        first_two.append(row)
        if len(first_two) == 2:
            break
    assert [[d.source for d in r.documents] for r in first_two] == [["1", "2"], ["3", "4"]]
    with pytest.raises(DataError, match="> seq_len"):
        list(pack_stream([doc(9)], 8))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(40, 120))
def test_packing_property(lengths, seq_len):
    docs = [doc(n, first=100 * (k + 1), masked=1 + n // 3, source=str(k))
            for k, n in enumerate(lengths)]
    rows = list(pack_stream(docs, seq_len))
    assert [d.source for r in rows for d in r.documents] == [d.source for d in docs]
    for row in rows:
        ids, pos = row.input_ids[0], row.position_ids[0]
        dids, mask = row.document_ids[0], row.loss_mask[0]
        used = sum(row.lengths)
        assert used <= seq_len
        for k, ((s, e), d) in enumerate(zip(row.document_bounds(), row.documents)):
            assert ids[s:e].tolist() == d.input_ids and mask[s:e].tolist() == d.loss_mask
            assert pos[s:e].tolist() == list(range(e - s))  # restart at 0 per document
            assert (dids[s:e] == k).all()
        assert (dids[used:] == -1).all() and (ids[used:] == 0).all()
        assert (pos[used:] == 0).all() and (mask[used:] == 0).all()
    # next-fit: a row closed early only because the next document did not fit
    for row, nxt in zip(rows, rows[1:]):
        assert sum(row.lengths) + nxt.lengths[0] > seq_len


def test_pack_fill_truncates_the_overflowing_conversation_into_the_gap():
    lengths = {"a": 20, "b": 30, "c": 25, "d": 3}

    def tokenize(name, budget):
        n = min(lengths[name], budget)
        return doc(n, masked=min(n, 2), source=name) if budget >= 2 else None

    rows = list(pack_fill(["a", "b", "c", "d"], tokenize, seq_len=32, min_fill=8))
    # a (20) fits; b (30) does not: cut to the 12 left; c opens row 2 (25); d fits (28);
    # the 4 left are below min_fill
    assert [[(d.source, len(d)) for d in r.documents] for r in rows] == [
        [("a", 20), ("b", 12)], [("c", 25), ("d", 3)]]
    assert rows[0].document_ids[0].tolist() == [0] * 20 + [1] * 12

    def no_supervision(name, budget):
        return None if name == "b" else tokenize(name, budget)
    rows = list(pack_fill(["a", "b", "c"], no_supervision, seq_len=32))
    assert [[d.source for d in r.documents] for r in rows] == [["a"], ["c"]]
