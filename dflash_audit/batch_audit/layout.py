"""``position_ids``, ``document_ids`` and padding of a packed row (our format; DESIGN.md
section 3 and :mod:`dflash_audit.data.pack`): ``document_ids`` run ``0, 0, ..., 1, ...,
k-1`` then ``-1`` on padding at the end of the row; ``position_ids`` restart at 0 for every
document and count up by one; ``input_ids`` / ``loss_mask`` / ``position_ids`` are 0 on
padding. The reference's offline format has one conversation per row and no positions (its
collator builds them), so these checks are skipped there.

Findings: ``positions continue`` (one count across the packed documents: the drafter's RoPE
and the verifier's would disagree after the first document), ``positions start at 1``,
``positions wrong`` (anything else), ``document_ids not contiguous``, ``padding not at the
end``, ``padding values``.
"""

from __future__ import annotations

import torch

from dflash_audit.batch_audit.files import Row
from dflash_audit.batch_audit.result import FAIL, PASS, SKIP, Check


def _document_ids(row: Row) -> Check:
    doc = row.document_ids
    valid = doc >= 0
    n_valid = int(valid.sum())
    if bool((doc < -1).any()) or not bool(valid[:n_valid].all()):
        return Check("document_ids", FAIL, "document_ids: padding (-1) appears before the end "
                     "of the row (or values below -1)", row=row.name,
                     finding="padding not at the end")
    d = doc[:n_valid]
    step = d[1:] - d[:-1]
    if n_valid and (int(d[0]) != 0 or bool((step < 0).any()) or bool((step > 1).any())):
        return Check("document_ids", FAIL, "document_ids must run 0, 0, ..., 1, 1, ..., k-1 "
                     "(contiguous, ascending)", row=row.name,
                     finding="document_ids not contiguous")
    return Check("document_ids", PASS, f"{len(row.documents)} documents, contiguous, padding "
                 f"(-1) only at the end ({row.input_ids.numel() - n_valid} tokens)",
                 row=row.name)


def expected_positions(row: Row) -> torch.Tensor:
    """int64 ``[T]``: ``0..len-1`` in each document, 0 on padding."""
    pos = torch.zeros(row.input_ids.numel(), dtype=torch.long)
    for s, e in row.documents:
        pos[s:e] = torch.arange(e - s)
    return pos


def _positions(row: Row) -> Check:
    expected = expected_positions(row)
    inside = row.document_ids >= 0
    got = row.position_ids
    bad = (got != expected) & inside
    if not bool(bad.any()):
        return Check("position_ids", PASS, f"position_ids restart at 0 in each of the "
                     f"{len(row.documents)} documents", row=row.name)
    first = int(bad.nonzero()[0])
    doc = int(row.document_ids[first])
    n = int(inside.sum())
    if torch.equal(got[:n], torch.arange(n)):
        finding = "positions continue"
        what = ("position_ids do not restart per packed document: they count on across "
                "documents")
    elif torch.equal(got[inside], expected[inside] + 1):
        finding, what = "positions start at 1", "position_ids start at 1, not 0"
    else:
        finding, what = "positions wrong", "position_ids do not count 0..len-1 per document"
    return Check("position_ids", FAIL, f"{what} (document {doc} at position {first}: "
                 f"{int(got[first])}, expected {int(expected[first])})", row=row.name,
                 finding=finding, details={"first_position": first, "document": doc})


def _padding(row: Row) -> Check:
    pad = row.document_ids < 0
    bad = [k for k in ("input_ids", "loss_mask", "position_ids")
           if bool((getattr(row, k)[pad] != 0).any())]
    if bad:
        return Check("padding", FAIL, f"{', '.join(bad)} must be 0 on padding positions "
                     "(document_ids == -1)", row=row.name, finding="padding values")
    return Check("padding", PASS, f"{int(pad.sum())} padding positions hold 0", row=row.name)


def check_layout(row: Row) -> list[Check]:
    """The layout checks of one row (see the module docstring); skips without positions."""
    if row.position_ids is None or row.document_ids is None:
        return [Check("position_ids", SKIP, "one conversation per row, no position_ids in the "
                      "files (the reference's collator builds them)", row=row.name)]
    docs = _document_ids(row)
    if docs.status == FAIL:
        return [docs]
    return [docs, _positions(row), _padding(row)]
