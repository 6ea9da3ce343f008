"""The ``anchors`` check: anchor selection, compared by distribution (DESIGN.md sec. 3 "Anchors").

Both sides get the same injected anchors in the forward, so no other check sees how a
candidate selects anchors. Here each side draws anchors ``ANCHOR_DRAWS`` times for the case's
``loss_mask``, A (``anchor_positions.numel()``) and block_size, each from its own random
stream: two implementations need not share one, only the distribution reaches training.

Compared on the valid anchors of every draw: the positions ever drawn (the support; a position
the reference draws only rarely may be missed by chance on a long row, see
:data:`MIN_MISSING_DRAWS`), the
number of valid anchors per draw, repeats within a draw, and how often each position is
drawn (a two-proportion z-test per position; tolerance: failing beyond |z| = ``Z_LIMIT``).
Not compared, because neither can change training: the order of the anchors in a draw (the
reference sorts them for its attention kernels) and the values of padding anchors
(anchor_valid False).

Tensors (both sides): ``anchor_draws`` [K, A] int64, ``anchor_draws_valid`` [K, A] bool. A
candidate provides them through an optional method ``select_anchors(loss_mask [1,T],
max_anchors, block_size[, generator]) -> (anchor_positions [A], anchor_valid [A])``; the
reference adapter calls the reference's ``select_anchors`` (speculators
``models/dflash/utils.py``).

A sampler whose signature names ``document_ids`` gets the case's packed-document ids, so
"per document" sampling (``max_anchors`` per packed document, the direction of speculators PR
1071) is named against the reference's "per row" sampling (and the other way round).

Hypotheses name (the comparison names them itself): per document vs per row sampling, anchors
not random (every draw the same), anchors outside the packed row, anchors admitted at T-B
(ModelOpt: its block ends inside the row) or drawn from past it, anchors where loss_mask is 0,
more than the last block_size positions excluded, an anchor that also needs loss_mask[a+1]
(SpecForge's) or block_size-1 further tokens of its own document, positions the reference draws
never drawn, one anchor fewer than there are valid positions (ModelOpt) or another number of
anchors per draw, anchors drawn with replacement, and per-position frequencies that differ.
"""

from __future__ import annotations

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult

#: |z| beyond which a position's draw frequency differs from the reference's (per position;
#: a uniform sampler exceeds 6 about once in 10^9 positions).
Z_LIMIT = 6.0
KEYS = ("anchor_draws", "anchor_draws_valid")
#: A position the reference draws at least this often and the candidate never is a support
#: difference (missed by chance with probability ~exp(-21) ~ 1e-9); rarer ones are left to the
#: per-position z-test (positions the candidate draws where the reference cannot -- outside
#: the row, in its last block_size positions, where loss_mask is 0 -- count from one draw).
MIN_MISSING_DRAWS = 21


def sampling_unit(case: Case, draws: torch.Tensor, valid: torch.Tensor, max_anchors: int
                  ) -> str | None:
    """``"per row"`` when every draw holds min(max_anchors, valid positions of the row)
    anchors, ``"per document"`` when every draw holds min(max_anchors, valid positions of the
    document) anchors in each packed document (speculators PR 1071's direction), None when
    neither or both fit (e.g. a row of one document)."""
    from dflash_audit.model.anchors import valid_anchor_mask

    allowed = valid_anchor_mask(case.inputs["loss_mask"], case.config.block_size)
    docs = case.inputs["document_ids"][0]
    ids = sorted(set(docs[allowed].tolist()))
    per_row = min(max_anchors, int(allowed.sum()))
    want_docs = [min(max_anchors, int((allowed & (docs == d)).sum())) for d in ids]
    row_fits = bool((valid.sum(1) == per_row).all())
    doc_fits = all([int(((docs[row[ok]]) == d).sum()) for d in ids] == want_docs
                   for row, ok in zip(draws, valid))
    if row_fits == doc_fits:
        return None
    return "per row" if row_fits else "per document"


def _positions(ps: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, ps[:limit])) + (f" (+{len(ps) - limit} more)" if len(ps) > limit
                                               else "")


def rule_sets(case: Case) -> dict[str, set[int]]:
    """Positions the reference admits that a stricter anchor rule excludes, per rule: an anchor
    that also needs ``loss_mask[a+1]`` (SpecForge ``_sample_anchor_positions``), and one that
    needs B-1 further tokens of its own document."""
    T, B = case.inputs["loss_mask"].shape[-1], case.config.block_size
    lm = case.inputs["loss_mask"][0].bool()
    doc = case.inputs["document_ids"][0]
    admitted = [p for p in range(T - B) if lm[p]]
    return {"next": {p for p in admitted if not lm[p + 1]},
            "document": {p for p in admitted if doc[p + B - 1] != doc[p]}}


#: The names of anchor rules, in neutral words: which framework's own rule each is is said
#: only when that framework is the candidate (:mod:`dflash_audit.audit.frameworks.rules`).
NEEDS_NEXT = "an anchor also needs loss_mask[a+1]"
NEEDS_OWN_DOCUMENT = "an anchor needs block_size-1 further tokens of its own document"
AT_T_MINUS_B = "anchors admitted at T-B: a <= T - block_size"
ONE_FEWER = ("one anchor fewer per draw than there are valid positions: "
             "min(max_anchors, valid) - 1")
#: The named stricter rules of :func:`rule_sets`.
RULE_CAUSES = {
    "next": f"{NEEDS_NEXT}: the last supervised token before an unsupervised one is never an "
            "anchor; the reference admits every supervised position a < T - block_size",
    "document": f"{NEEDS_OWN_DOCUMENT} (no block crosses a document boundary); the reference "
                "admits every supervised position a < T - block_size of the packed row",
}


def support_findings(case: Case, extra: list[int], missing: list[int],
                     never: set[int] | None = None) -> list[tuple[str, str]]:
    """(cause, evidence) for positions only one side draws: anchors admitted at T-B, drawn
    from past it or beyond the row, outside the loss mask, a tail excluded in excess, a
    stricter rule (:func:`rule_sets`) or others. ``never``: the positions the reference admits
    that the candidate never drew (default ``missing``)."""
    T, B = case.inputs["loss_mask"].shape[-1], case.config.block_size
    lm = case.inputs["loss_mask"][0].bool()
    out = []
    beyond = [p for p in extra if not 0 <= p < T]
    tail = [p for p in extra if T - B <= p < T]
    unmasked = [p for p in extra if 0 <= p < T - B and not lm[p]]
    if beyond:
        out.append(("anchors outside the packed row", f"positions {_positions(beyond)}, T={T}"))
    if tail == [T - B]:
        out.append((f"{AT_T_MINUS_B}; the block of an anchor at T-B ends at T-1, inside the "
                    "row, but the reference also excludes it (valid_mask[:, -block_size:] = "
                    "False)",
                    f"position {T - B} of T={T}, block_size={B}"))
    elif tail:
        out.append(("anchors drawn from the last block_size positions of the row; the reference "
                    "excludes them (a block from a > T - block_size runs past the row)",
                    f"positions {_positions(tail)} of T={T}, block_size={B}"))
    if unmasked:
        out.append(("anchors drawn where loss_mask is 0; the reference draws only supervised "
                    "positions", f"positions {_positions(unmasked)}"))
    if missing:
        never = set(missing) if never is None else never
        cut = min(missing)
        rules = [rule for rule, ps in rule_sets(case).items() if ps and ps == never]
        if missing == [p for p in range(cut, T - B) if lm[p]]:
            out.append(("more than the last block_size positions excluded from anchors",
                        f"none drawn from position {cut} on; the reference draws up to "
                        f"{T - B - 1} (T={T}, block_size={B})"))
        elif len(rules) == 1:
            out.append((RULE_CAUSES[rules[0]], f"never drawn: positions "
                        f"{_positions(sorted(never))}"))
        else:
            out.append(("positions the reference draws are never drawn",
                        f"positions {_positions(missing)}"))
    return out


def check_anchor_draws(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Support, count, repeats and frequencies of both sides' anchor draws (module docstring)."""
    if not all(k in ref.tensors for k in KEYS):
        return CheckResult("anchors", case.name, PASS, "not provided: the reference adapter "
                           "returned no anchor draws (nothing to compare)")
    if not all(k in cand.tensors for k in KEYS):
        return CheckResult("anchors", case.name, WARN, "not provided: the candidate has no "
                           "select_anchors(loss_mask, max_anchors, block_size[, generator])")
    c, cv = cand.tensors["anchor_draws"], cand.tensors["anchor_draws_valid"].bool()
    r, rv = ref.tensors["anchor_draws"], ref.tensors["anchor_draws_valid"].bool()
    A = case.inputs["anchor_positions"].numel()
    units = (sampling_unit(case, c, cv, A), sampling_unit(case, r, rv, A))
    if None not in units and units[0] != units[1]:
        cause = (f"anchors sampled {units[0]} (max_anchors={A} per "
                 f"{'packed document' if units[0] == 'per document' else 'packed row'}) where "
                 f"the reference samples {units[1]}")
        return CheckResult("anchors", case.name, FAIL,
                           f"{cause} ({len(set(case.inputs['document_ids'][0].tolist()) - {-1})}"
                           f" documents; anchors per draw {sorted(set(cv.sum(1).tolist()))}, "
                           f"reference {sorted(set(rv.sum(1).tolist()))})",
                           details={"causes": [cause], "sampling": {"candidate": units[0],
                                                                    "reference": units[1]}})
    if c.shape != r.shape or cv.shape != c.shape:
        return CheckResult("anchors", case.name, FAIL, f"anchor draws of shape "
                           f"{list(c.shape)}, reference {list(r.shape)} ([draws, max_anchors])")
    found: list[tuple[str, str]] = []  # (cause, evidence on this case)
    c_draws, r_draws = ({tuple(sorted(row[ok].tolist())) for row, ok in zip(x, v)}
                        for x, v in ((c, cv), (r, rv)))
    if len(c_draws) == 1 and len(r_draws) > 1:  # support and counts then follow from it
        found.append(("anchors not random: every draw returns the same anchors; the reference "
                      "draws them uniformly at random each step",
                      f"{len(c)} draws, all {_positions(sorted(next(iter(c_draws))))}; the "
                      f"reference's {len(c)} draws hold {len(r_draws)} different sets"))
    c_set, r_set = set(c[cv].tolist()), set(r[rv].tolist())
    r_counts = torch.bincount(r[rv], minlength=1) if rv.any() else torch.zeros(1).long()
    # a position the reference drew n times and the candidate never: by chance with
    # probability ~exp(-n) when both sample alike (a long row, few anchors: ~2 draws each)
    missing = sorted(p for p in r_set - c_set if int(r_counts[p]) >= MIN_MISSING_DRAWS)
    never = set(r_set) - c_set
    found += [] if found else support_findings(case, sorted(c_set - r_set), missing, never)
    c_count, r_count = sorted(set(cv.sum(1).tolist())), sorted(set(rv.sum(1).tolist()))
    if c_count != r_count and not found:  # with another support the count follows from it
        one_fewer = len(r_count) == 1 and r_count[0] < A and c_count == [r_count[0] - 1]
        found.append((f"{ONE_FEWER}; the reference draws min(max_anchors, valid)"
                      if one_fewer else
                      "another number of anchors per draw than the reference's "
                      "min(max_anchors, valid positions)",
                      f"{_positions(c_count)} per draw, reference {_positions(r_count)}"))
    repeats = sum(int(row[ok].unique().numel() < int(ok.sum())) for row, ok in zip(c, cv))
    if repeats:
        found.append(("anchors drawn with replacement (the reference draws without)",
                      f"{repeats} of {len(c)} draws repeat a position"))
    details: dict = {"draws": len(c), "support_size": {"candidate": len(c_set),
                                                       "reference": len(r_set)},
                     "anchors_per_draw": {"candidate": c_count, "reference": r_count}}
    if not found and r_set:
        size = int(max(r_set)) + 1
        nc = torch.bincount(c[cv], minlength=size).double()
        nr = torch.bincount(r[rv], minlength=size).double()
        K = len(c)
        p = (nc + nr) / (2 * K)
        z = (nc - nr) / (2 * K * p * (1 - p)).clamp_min(1e-12).sqrt()
        worst = int(z.abs().argmax())
        details["max_abs_z"] = float(z.abs().max())
        if z.abs().max() > Z_LIMIT:
            found.append(("anchors not drawn uniformly over the valid positions",
                          f"position {worst} drawn in {nc[worst] / K:.1%} of draws, reference "
                          f"{nr[worst] / K:.1%} (z = {float(z[worst]):.1f})"))
    causes = [cause for cause, _ in found]
    details["causes"] = causes
    if causes:
        return CheckResult("anchors", case.name, FAIL,
                           "; ".join(f"{cause} ({evidence})" for cause, evidence in found),
                           details=details)
    return CheckResult("anchors", case.name, PASS,
                       f"{len(c)} draws agree: the same {len(r_set)} positions, "
                       f"{_positions(r_count)} valid anchors per draw, frequencies within "
                       f"|z| <= {Z_LIMIT:g}", details=details)


def diagnose_anchors(ev: Evidence, result: CheckResult) -> list[str]:
    """The causes :func:`check_anchor_draws` named itself (its comparison is the diagnosis)."""
    return result.details.get("causes", [])
