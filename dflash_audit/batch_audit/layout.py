"""``position_ids``, ``document_ids`` and padding of a packed row (our format; DESIGN.md
section 3 and :mod:`dflash_audit.data.pack`): ``document_ids`` run ``0, 0, ..., 1, ...,
k-1`` then ``-1`` on padding at the end of the row; ``position_ids`` restart at 0 for every
document and count up by one; ``input_ids`` / ``loss_mask`` / ``position_ids`` are 0 on
padding. The reference's offline format has one conversation per row and no positions (its
collator builds them), so these checks are skipped there.

Findings: ``positions continue`` (one count across the packed documents) and ``positions start
at 1``: a per-document offset, which leaves every RoPE distance inside a document as it is, so
with a relative RoPE (the default, linear, llama3, yarn ...) and attention kept per document by
``document_ids`` it cannot change what a drafter learns (compare passes such a candidate): a
warning; a FAIL only where the verifier's ``rope_type`` makes the frequencies depend on the
absolute position (:data:`POSITION_DEPENDENT_ROPE`). ``positions wrong`` (anything else),
``document_ids not contiguous``, ``padding not at the end``, ``padding values``: failures.
"""

from __future__ import annotations

import torch

from dflash_audit.batch_audit.files import Row
from dflash_audit.batch_audit.result import FAIL, PASS, SKIP, WARN, Check

#: RoPE types whose rotation of a position depends on the absolute position or the sequence's
#: length (transformers' ``dynamic`` NTK scaling, Phi-3's ``longrope`` short/long factors):
#: there a per-document position offset changes the drafter's attention.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


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


def rope_types(config: object) -> set[str]:
    """Every ``rope_type`` in a transformers config's ``rope_parameters`` / ``rope_scaling``
    (per layer type where it is nested, as Gemma 3's), ``{"default"}`` where none is set."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    found: set[str] = set()
    for part in ([rope] if isinstance(rope, dict) else []):
        nested = [v for v in part.values() if isinstance(v, dict)]
        for d in (nested or [part]):
            found.add(str(d.get("rope_type") or d.get("type") or "default"))
    return found or {"default"}


def _positions(row: Row, rope: set[str]) -> Check:
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
    status = FAIL
    if finding != "positions wrong":
        absolute = sorted(rope & set(POSITION_DEPENDENT_ROPE))
        status = FAIL if absolute else WARN
        what += (f": the verifier's rope_type {absolute[0]!r} makes the rotation depend on the "
                 "absolute position, so the drafter's attention changes" if absolute else
                 ": a per-document offset, which keeps every RoPE distance inside a document "
                 f"(rope_type {', '.join(sorted(rope))}), so with attention kept per document "
                 "it cannot change what the drafter learns; the reference restarts them")
    return Check("position_ids", status, f"{what} (document {doc} at position {first}: "
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


def check_layout(row: Row, rope: set[str] | frozenset[str] = frozenset({"default"})
                 ) -> list[Check]:
    """The layout checks of one row (see the module docstring); skips without positions.
    ``rope``: the verifier's rope types (:func:`rope_types`)."""
    if row.position_ids is None or row.document_ids is None:
        return [Check("position_ids", SKIP, "one conversation per row, no position_ids in the "
                      "files (the reference's collator builds them)", row=row.name)]
    docs = _document_ids(row)
    if docs.status == FAIL:
        return [docs]
    return [docs, _positions(row, set(rope)), _padding(row)]
