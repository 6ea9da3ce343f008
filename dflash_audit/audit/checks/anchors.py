"""The ``anchors`` check: anchor selection, compared by distribution (DESIGN.md sec. 3 "Anchors").

Both sides get the same injected anchors in the forward, so no other check sees how a
candidate selects anchors. Here each side draws anchors ``ANCHOR_DRAWS`` times for the case's
``loss_mask``, A (``anchor_positions.numel()``) and block_size, each from its own random
stream: two implementations need not share one, only the distribution reaches training.

Compared on the valid anchors of every draw: the positions ever drawn (the support; a position
the reference draws only rarely may be missed by chance on a long row, see
:data:`MIN_MISSING_DRAWS`), the
number of valid anchors per draw, repeats within a draw, how often each position is drawn (a
two-proportion z-test per position, failing beyond |z| = ``Z_LIMIT``, and their pooled
chi-square, failing below p = ``P_LIMIT``), and the shape of each draw among the valid
positions (:mod:`dflash_audit.audit.anchor_stats`): the share of draws at a fixed stride, and a
rank test of each draw's mean rank, smallest and largest gap (tolerance: |z| = ``Z_LIMIT``).
A case that cannot show a sampler's choice (every draw holds all valid positions) or its
dependence (one anchor per draw) says so in its pass.
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
not random (every draw the same: the first or last valid positions), anchors outside the packed
row, anchors admitted at T-B (ModelOpt: its block ends inside the row) or drawn from past it,
anchors where loss_mask is 0, more than the last block_size positions excluded, an anchor that
also needs loss_mask[a+1] (SpecForge's) or block_size-1 further tokens of its own document,
positions the reference draws never drawn, one anchor fewer than there are valid positions
(ModelOpt) or another number of anchors per draw, anchors drawn with replacement, anchors at a
fixed stride from a random start (a contiguous window for stride 1; the start drawn within the
slack, as in the TorchSpec PR 186 review, or wrapping around), per-position frequencies that
differ (where the excess lies: early, middle or late valid positions), and draws shaped
otherwise.
"""

from __future__ import annotations

import torch

from dflash_audit.audit.anchor_stats import (
    P_LIMIT,
    Z_LIMIT,
    DrawShape,
    conditional_p,
    draw_shape,
    frequency_z,
    mann_whitney_z,
    pooled_p,
)
from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult

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
        only, pool = list(next(iter(c_draws))), _pool(case).tolist()
        which = (" (the first valid positions)" if only == pool[:len(only)] else
                 " (the last valid positions)" if only == pool[len(pool) - len(only):] else "")
        found.append((f"anchors not random: every draw returns the same anchors{which}; the "
                      "reference draws them uniformly at random each step",
                      f"{len(c)} draws, all {_positions(sorted(next(iter(c_draws))))}; the "
                      f"reference's {len(c)} draws hold {len(r_draws)} different sets"))
    c_set, r_set = set(c[cv].tolist()), set(r[rv].tolist())
    r_counts = torch.bincount(r[rv], minlength=1) if rv.any() else torch.zeros(1).long()
    # a position the reference drew n times and the candidate never: by chance with
    # probability ~exp(-n) when both sample alike (a long row, few anchors: ~2 draws each)
    missing = sorted(p for p in r_set - c_set if int(r_counts[p]) >= MIN_MISSING_DRAWS)
    never = set(r_set) - c_set
    # positions never drawn where the others are drawn unlike the reference's: a skew (named
    # by the frequencies below), not an exclusion rule
    skewed = bool(missing) and conditional_p(c[cv], r[rv], sorted(c_set & r_set)) < P_LIMIT
    found += [] if found else support_findings(case, sorted(c_set - r_set),
                                               [] if skewed else missing, never)
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
    if len(c_draws) > 1 and r_set:  # a stride is its own class, beside a support rule
        admitted = (set(_pool(case).tolist()) - set(missing)) | (c_set - r_set)
        shapes = (draw_shape(c, cv, torch.tensor(sorted(admitted))),
                  draw_shape(r, rv, _pool(case)))
        stride = None not in shapes and stride_finding(*shapes, details)
        found += [stride] if stride else []
    if not found and r_set:
        found += distribution_findings(case, (c, cv), (r, rv), details)
    causes = [cause for cause, _ in found]
    details["causes"] = causes
    if causes:
        return CheckResult("anchors", case.name, FAIL,
                           "; ".join(f"{cause} ({evidence})" for cause, evidence in found),
                           details=details)
    note = cannot_show(case, r_count, A)
    if note:
        details["cannot_show"] = note
    return CheckResult("anchors", case.name, PASS,
                       f"{len(c)} draws agree: the same {len(r_set)} positions, "
                       f"{_positions(r_count)} valid anchors per draw, frequencies within "
                       f"|z| <= {Z_LIMIT:g}, draws alike in stride, gaps and location"
                       + (f"; {note}" if note else ""), details=details)


def _pool(case: Case) -> torch.Tensor:
    """[n] int64: the valid anchor positions of the case (the reference's rule), sorted."""
    from dflash_audit.model.anchors import valid_anchor_mask

    return valid_anchor_mask(case.inputs["loss_mask"], case.config.block_size).nonzero()[:, 0]


def cannot_show(case: Case, per_draw: list[int], max_anchors: int) -> str | None:
    """What this case cannot show about a sampler (too few valid positions, one anchor per
    draw), or None."""
    n = int(_pool(case).numel())
    k = per_draw[0] if len(per_draw) == 1 else None
    if n <= max_anchors:
        return (f"this case cannot show how a sampler chooses: every draw holds all {n} valid "
                f"positions (max_anchors={max_anchors})")
    if k == 1:
        return ("one anchor per draw: only per-position frequencies can show a non-uniform "
                "sampler here, not a rule that ties a draw's anchors together (a stride)")
    if k is not None and k == n - 1:
        return (f"every {k} of the {n} valid positions are a window with stride 1: a strided "
                "sampler cannot show here, only per-position frequencies")
    return None


def distribution_findings(case: Case, cand: tuple[torch.Tensor, torch.Tensor],
                          ref: tuple[torch.Tensor, torch.Tensor], details: dict
                          ) -> list[tuple[str, str]]:
    """(cause, evidence) for draws with the same support, count and no repeats (nor a stride:
    :func:`stride_finding`) that are still not drawn alike: per-position frequencies (one z per
    position, a pooled chi-square; named by where the candidate's excess lies), or draws shaped
    otherwise (a rank test of each draw's mean rank, smallest and largest gap). Fills
    ``details``."""
    (c, cv), (r, rv), K = cand, ref, len(cand[0])
    pool = _pool(case)
    size = int(max(c[cv].max(), r[rv].max())) + 1
    z = frequency_z(c[cv], r[rv], K, size)
    p = pooled_p(z, c[cv], r[rv], K)
    details.update(max_abs_z=float(z.abs().max()), pooled_p=p)
    shapes = draw_shape(c, cv, pool), draw_shape(r, rv, pool)
    if None in shapes or shapes[0].k != shapes[1].k:
        shapes = None
    if float(z.abs().max()) > Z_LIMIT or p < P_LIMIT:
        worst = int(z.abs().argmax())
        nc, nr = (torch.bincount(x, minlength=size)[worst] / K for x in (c[cv], r[rv]))
        never = sorted(set(r[rv].tolist()) - set(c[cv].tolist()))
        return [(f"anchors not drawn uniformly over the valid positions: {favoured(z, pool)}",
                 f"position {worst} drawn in {nc:.1%} of draws, reference {nr:.1%} "
                 f"(z = {float(z[worst]):.1f}); pooled chi-square p = {p:.1e}"
                 + (f"; never drawn: positions {_positions(never)}" if never else ""))]
    if shapes is None:
        return []
    zs = {name: mann_whitney_z(fc, shapes[1].features()[name])
          for name, fc in shapes[0].features().items()}
    details["draw_shape_z"] = zs
    name, worst = max(zs.items(), key=lambda item: abs(item[1]))
    if abs(worst) <= Z_LIMIT:
        return []
    more = "larger" if worst > 0 else "smaller"
    return [(f"anchors of a draw not drawn independently of each other: {SHAPES[name, more]}",
             f"each draw's {name} (in ranks among the valid positions) is {more} than the "
             f"reference's, rank test z = {worst:.1f}")]


#: What a draw-shape statistic that differs says about a sampler.
SHAPES = {
    ("smallest gap", "smaller"): "they cluster (closer together than uniform draws)",
    ("largest gap", "larger"): "they cluster (leaving longer empty stretches than uniform "
                               "draws)",
    ("smallest gap", "larger"): "they are kept apart (a minimum spacing uniform draws do not "
                                "have)",
    ("largest gap", "smaller"): "they are spread more evenly than uniform draws",
    ("mean rank", "smaller"): "whole draws lean towards the early valid positions",
    ("mean rank", "larger"): "whole draws lean towards the late valid positions",
}


def favoured(z: torch.Tensor, pool: torch.Tensor) -> str:
    """Where a sampler's excess lies: early / late valid positions, the middle or the ends."""
    zz = z[pool[pool < z.numel()]]
    thirds = [float(part.sum()) for part in zz.tensor_split(3)]
    where = max(range(3), key=lambda i: thirds[i])
    return ("the first third of the valid positions drawn more often than the rest",
            "the middle of the valid positions drawn more often than its ends",
            "the last third of the valid positions drawn more often than the rest")[where]


def stride_finding(cand: DrawShape, ref: DrawShape, details: dict) -> tuple[str, str] | None:
    """A fixed stride: most of the candidate's draws are k anchors s positions apart among the
    positions it admits (all but one cyclic gap equal), far more than the reference's draws
    among its valid positions; None otherwise."""
    strides = cand.stride
    if not bool((strides > 0).any()):
        return None
    s = int(strides[strides > 0].mode().values)
    K = strides.numel()
    fc, fr = float((strides == s).double().mean()), float((ref.stride == s).double().mean())
    pooled = (fc + fr) / 2
    z = (fc - fr) / max((2 * pooled * (1 - pooled) / K) ** 0.5, 1e-12)
    details["stride"] = {"stride": s, "candidate": fc, "reference": fr, "z": z}
    if fc < 0.5 or z <= Z_LIMIT:
        return None
    what = (f"a contiguous window of {cand.k} valid positions" if s == 1 else
            f"{cand.k} anchors {s} valid positions apart")
    start = ("its start drawn within the slack the stride leaves, so the middle of the valid "
             "positions is drawn more often than its ends" if bool(cand.linear[strides == s].all())
             else "its start wrapping around the valid positions, so each is drawn equally "
             "often, but never independently of the others")
    return (f"anchors drawn at a fixed stride over the valid positions: {what} from a random "
            f"start, {start}; the reference draws max_anchors positions uniformly without "
            "replacement", f"{fc:.0%} of {K} draws are strided by {s}, reference {fr:.0%}")


def diagnose_anchors(ev: Evidence, result: CheckResult) -> list[str]:
    """The causes :func:`check_anchor_draws` named itself (its comparison is the diagnosis)."""
    return result.details.get("causes", [])
