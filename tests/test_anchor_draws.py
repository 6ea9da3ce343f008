"""The anchors check: a candidate's own anchor sampler against the reference's, by distribution.

Bug samplers below are written out independently (not through our select_anchors). The
reference side is our sampler (hand-perturbed section) or the real reference's (marked
``reference``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dflash_audit.audit.anchor_stats import conditional_p, mann_whitney_z
from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.checks import run_checks
from dflash_audit.audit.checks.anchors import check_anchor_draws
from dflash_audit.audit.diagnose import diagnose
from dflash_audit.audit.sides.anchor_draws import draw_anchors
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.loss import LossSpec

pytestmark = pytest.mark.usefixtures("single_thread")

B = 4
CONFIG = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=1, vocab_size=96,
                      num_verifier_layers=6, target_layer_ids=(1, 3, 4), mask_token_id=95,
                      block_size=B)
T = 64  # the case's row length


@functools.cache
def case():
    """The shared case, built on first use (not at collection: its drafter imports
    transformers)."""
    built = synthetic_case("anchors", CONFIG, LossSpec(), seed=5, seq_len=T, num_documents=2,
                           pad=0, max_anchors=6)
    assert built.inputs["loss_mask"].shape[-1] == T
    return built


def _pad(chosen: torch.Tensor, max_anchors: int, fill: int = 0):
    anchors = torch.full((max_anchors,), fill, dtype=torch.long)
    valid = torch.zeros(max_anchors, dtype=torch.bool)
    anchors[:chosen.numel()], valid[:chosen.numel()] = chosen, True
    return anchors, valid


def uniform(exclude_tail=B, use_loss_mask=True, fewer=0, order=torch.sort, fill=0):
    """Uniform without replacement over supervised positions minus the last ``exclude_tail``."""
    def select(loss_mask, max_anchors, block_size, g):
        ok = loss_mask[0].bool() if use_loss_mask else torch.ones(T, dtype=torch.bool)
        if exclude_tail:
            ok[-exclude_tail:] = False
        pool = ok.nonzero().squeeze(-1)
        k = min(max_anchors - fewer, pool.numel())
        chosen = pool[torch.multinomial(torch.ones(pool.numel()), k, generator=g)]
        return _pad(order(chosen).values if order else chosen, max_anchors, fill)
    return select


def with_replacement(loss_mask, max_anchors, block_size, g):
    pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
    k = min(max_anchors, pool.numel())
    return _pad(pool[torch.randint(pool.numel(), (k,), generator=g)].sort().values, max_anchors)


def early_biased(loss_mask, max_anchors, block_size, g):
    """Half the time the first valid positions, else uniform: a skewed distribution with the
    right support and count."""
    pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
    k = min(max_anchors, pool.numel())
    if torch.rand((), generator=g) < 0.5:
        return _pad(pool[:k], max_anchors)
    return _pad(pool[torch.randperm(pool.numel(), generator=g)[:k]].sort().values, max_anchors)


def per_document(loss_mask, max_anchors, block_size, g, document_ids=None):
    """speculators PR 1071's direction: max_anchors anchors per packed document."""
    ok = loss_mask[0].bool().clone()
    ok[-block_size:] = False
    chosen = []
    for d in sorted(set(document_ids[0][ok].tolist())):
        pool = (ok & (document_ids[0] == d)).nonzero().squeeze(-1)
        k = min(max_anchors, pool.numel())
        chosen.append(pool[torch.randperm(pool.numel(), generator=g)[:k]])
    docs = int(document_ids.max()) + 1
    return _pad(torch.cat(chosen).sort().values, max_anchors * docs)


def own_document(loss_mask, max_anchors, block_size, g, document_ids=None):
    """NeMo Automodel's packed-row rule: an anchor needs block_size-1 further tokens of its own
    document (doc_remaining >= block_size - 1)."""
    ok = loss_mask[0].bool().clone()
    ok[-block_size:] = False
    doc = document_ids[0]
    ok[:-block_size] &= doc[block_size - 1:-1] == doc[:-block_size]
    pool = ok.nonzero().squeeze(-1)
    k = min(max_anchors, pool.numel())
    return _pad(pool[torch.randperm(pool.numel(), generator=g)[:k]].sort().values, max_anchors)


def first_k(loss_mask, max_anchors, block_size, g):
    """The first max_anchors valid positions every time (no randomness)."""
    pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
    return _pad(pool[:max_anchors], max_anchors)


def last_k(loss_mask, max_anchors, block_size, g):
    """The last max_anchors valid positions every time."""
    pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
    return _pad(pool[-max_anchors:], max_anchors)


def strided(wrap=False, cap=True):
    """A strided sampler (TorchSpec PR 186): max_anchors valid positions ``stride`` apart,
    stride = valid // max_anchors (capped at block_size + 1), from a random start drawn within
    the slack the stride leaves (the reviewed version) or over every position, wrapping
    around (its fix: uniform per-position frequencies)."""
    def select(loss_mask, max_anchors, block_size, g):
        pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
        n = pool.numel()
        k = min(max_anchors, n)
        s = max(1, min(n // max_anchors, block_size + 1 if cap else n))
        if wrap:
            ranks = (int(torch.randint(n, (), generator=g)) + torch.arange(k) * s) % n
        else:
            ranks = int(torch.randint(n - s * (k - 1), (), generator=g)) + torch.arange(k) * s
        return _pad(pool[ranks].sort().values, max_anchors)
    return select


def sorted_truncated(loss_mask, max_anchors, block_size, g):
    """Twice max_anchors drawn without replacement, sorted, the first max_anchors kept: the
    right support and count, early positions favoured."""
    pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
    k = min(max_anchors, pool.numel())
    chosen = pool[torch.randperm(pool.numel(), generator=g)[:2 * k]].sort().values[:k]
    return _pad(chosen, max_anchors)


def paired(loss_mask, max_anchors, block_size, g):
    """Anchors drawn in adjacent pairs (a, a+1 in rank): uniform per-position frequencies
    (nearly), dependent anchors."""
    pool = loss_mask[0, :-block_size].bool().nonzero().squeeze(-1)
    n, k = pool.numel(), min(max_anchors, pool.numel())
    shift = int(torch.randint(2, (), generator=g))
    starts = torch.randperm(n // 2, generator=g)[:(k + 1) // 2] * 2 + shift
    ranks = torch.stack([starts, starts + 1], 1).reshape(-1)[:k] % n
    return _pad(pool[ranks].sort().values, max_anchors)


@pytest.fixture(scope="module")
def ours():
    return SideOutputs(draw_anchors(DrafterCandidate().select_anchors, case()), {}, {})


def check(select, ref):
    drawn = SideOutputs(draw_anchors(select, case(), seed=7), {}, {})
    return check_anchor_draws(case(), drawn, ref)


@pytest.mark.parametrize("select", [
    uniform(), uniform(order=None), uniform(fill=-1)], ids=["other-rng", "unsorted", "pad-minus-1"])
def test_what_cannot_change_training_passes(select, ours):
    """Another random stream, unsorted anchors, another padding value: the same training."""
    r = check(select, ours)
    assert r.status == "pass", r.summary
    assert r.details["max_abs_z"] < 6


def test_a_long_row_with_few_anchors_passes_the_same_sampler():
    """T=2100, 8 anchors, 512 draws: each position is drawn ~2 times, so each side misses
    some positions the other drew by chance; that is no support difference."""
    long = synthetic_case("long", CONFIG, LossSpec(), seed=6, seq_len=2100, num_documents=1,
                          pad=0, max_anchors=8)
    ours = SideOutputs(draw_anchors(DrafterCandidate().select_anchors, long), {}, {})
    cand = SideOutputs(draw_anchors(DrafterCandidate().select_anchors, long, seed=7), {}, {})
    r_set, c_set = (set(s.tensors["anchor_draws"][s.tensors["anchor_draws_valid"]].tolist())
                    for s in (ours, cand))
    assert r_set - c_set  # chance misses exist ...
    r = check_anchor_draws(long, cand, ours)
    assert r.status == "pass", r.summary  # ... and are not a finding


@pytest.mark.parametrize("select,cause,evidence", [
    (uniform(exclude_tail=0), "anchors drawn from the last block_size positions of the row",
     f"positions 60, 61, 62, 63 of T={T}, block_size={B}"),
    (uniform(use_loss_mask=False), "anchors drawn where loss_mask is 0", "positions 0, 1,"),
    (with_replacement, "anchors drawn with replacement", "of 512 draws repeat a position"),
    (uniform(exclude_tail=B + 3), "more than the last block_size positions excluded",
     f"none drawn from position {T - B - 3} on; the reference draws up to {T - B - 1}"),
    (uniform(fewer=1), "another number of anchors per draw than the reference's",
     "5 per draw, reference 6"),
    (early_biased, "anchors not drawn uniformly over the valid positions", "position"),
    (first_k, "anchors not random: every draw returns the same anchors (the first valid "
              "positions)",
     "512 draws, all 4, 5, 6, 7, 8, 31; the reference's 512 draws hold 512 different sets"),
    (last_k, "anchors not random: every draw returns the same anchors (the last valid "
             "positions)", "512 draws, all 54, 55, 56, 57, 58, 59;"),
    (strided(), "anchors drawn at a fixed stride over the valid positions: 6 anchors 4 valid "
                "positions apart from a random start, its start drawn within the slack the "
                "stride leaves, so the middle of the valid positions is drawn more often",
     "100% of 512 draws are strided by 4, reference 0%"),
    (strided(wrap=True), "anchors drawn at a fixed stride over the valid positions: 6 anchors 4 "
                         "valid positions apart from a random start, its start wrapping around",
     "100% of 512 draws are strided by 4, reference 0%"),
    (sorted_truncated, "anchors not drawn uniformly over the valid positions: the first third of "
                       "the valid positions drawn more often than the rest",
     "; never drawn: positions 53, 54"),
    (paired, "anchors of a draw not drawn independently of each other: they cluster",
     "than the reference's, rank test z = "),
    (own_document, "an anchor needs block_size-1 further tokens of its own document (no block "
     "crosses a document boundary)", "never drawn: positions "),
], ids=["tail", "loss-mask", "replacement", "tail-too-long", "fewer", "skewed", "first-k",
        "last-k", "strided", "strided-wrapping", "sorted-truncated", "paired", "own-document"])
def test_sampler_bug_is_named(select, cause, evidence, ours):
    r = check(select, ours)
    assert r.status == "fail" and len(r.details["causes"]) == 1, r.summary
    assert r.details["causes"][0].startswith(cause) and evidence in r.summary, r.summary


def torchspec_sampler(loss_mask, max_anchors, block_size, g):
    """TorchSpec's ``sample_anchor_positions`` as fixed after the PR 186 review, written out:
    admitted positions a <= T - B whose next token is supervised too, a stride from a start
    that wraps around."""
    T = loss_mask.shape[-1]
    lm = loss_mask[0].bool()
    positions = torch.arange(T - block_size + 1)
    pool = positions[lm[positions] & lm[(positions + 1).clamp(max=T - 1)]]
    n = pool.numel()
    s = max(1, min(n // max_anchors, block_size + 1))
    ranks = (int(torch.randint(n, (), generator=g)) + torch.arange(min(max_anchors, n)) * s) % n
    return _pad(pool[ranks].sort().values, max_anchors)


def test_a_stride_is_named_beside_the_support_rules(ours):
    """TorchSpec's sampler differs in three ways, each named: T-B admitted, loss_mask[a+1]
    needed, and a stride (measured among the positions it admits)."""
    causes = check(torchspec_sampler, ours).details["causes"]
    assert [c.split(":")[0] for c in causes] == [
        "anchors admitted at T-B", "an anchor also needs loss_mask[a+1]",
        "anchors drawn at a fixed stride over the valid positions"], causes


def with_slots(case, max_anchors):
    """The case with ``max_anchors`` anchor slots (what the samplers are asked to fill)."""
    zeros = torch.zeros(max_anchors, dtype=torch.long)
    return dataclasses.replace(case, inputs={**case.inputs, "anchor_positions": zeros,
                                             "anchor_valid": zeros.bool()})


def test_a_window_is_a_stride_of_one():
    """20 anchors among 29 valid positions: the strided sampler takes a contiguous window."""
    slotted = with_slots(case(), 20)
    ref = SideOutputs(draw_anchors(DrafterCandidate().select_anchors, slotted), {}, {})
    r = check_anchor_draws(slotted, SideOutputs(draw_anchors(strided(), slotted, seed=7), {}, {}),
                           ref)
    assert r.status == "fail" and r.details["causes"] == [
        "anchors drawn at a fixed stride over the valid positions: a contiguous window of 20 "
        "valid positions from a random start, its start drawn within the slack the stride "
        "leaves, so the middle of the valid positions is drawn more often than its ends; the "
        "reference draws max_anchors positions uniformly without replacement"], r.summary


@pytest.mark.parametrize("slots,note", [
    (40, "this case cannot show how a sampler chooses: every draw holds all 29 valid positions "
         "(max_anchors=40)"),
    (1, "one anchor per draw: only per-position frequencies can show a non-uniform sampler "
        "here, not a rule that ties a draw's anchors together (a stride)"),
], ids=["all-positions", "one-anchor"])
def test_a_case_that_cannot_show_a_stride_says_so(slots, note):
    slotted = with_slots(case(), slots)
    ref = SideOutputs(draw_anchors(DrafterCandidate().select_anchors, slotted), {}, {})
    for select in (strided(), strided(wrap=True)):
        r = check_anchor_draws(slotted, SideOutputs(draw_anchors(select, slotted, seed=7), {}, {}),
                               ref)
        assert r.status == "pass" and r.details["cannot_show"] == note and r.summary.endswith(
            f"; {note}"), r.summary
    if slots == 1:  # per-position frequencies still show a skewed single anchor
        r = check_anchor_draws(slotted, SideOutputs(draw_anchors(sorted_truncated, slotted,
                                                                 seed=7), {}, {}), ref)
        assert r.status == "fail" and r.details["causes"][0].startswith(
            "anchors not drawn uniformly over the valid positions: the first third")


#: (seq_len, documents, padding, anchor slots, block size): rows of one or several documents,
#: few or many anchors (2 to all valid positions), one long row.
SPREAD = [(48, 1, 0, 2, 4), (64, 3, 4, 5, 3), (96, 2, 6, 12, 8), (40, 2, 0, 30, 2),
          (80, 4, 2, 9, 5), (1200, 1, 0, 8, 4)]


def test_a_strided_sampler_is_named_on_every_case_that_can_show_it():
    """The TorchSpec PR 186 review's sampler, as reviewed and as fixed (wrapping start: uniform
    per-position frequencies), fails with the stride named wherever the case can show it;
    the reference's own sampler (another stream) passes everywhere."""
    seen = []
    for i, (seq_len, docs, pad, slots, block) in enumerate(SPREAD):
        config = CONFIG.replace(block_size=block)
        case = synthetic_case(f"spread-{i}", config, LossSpec(), seed=30 + i, seq_len=seq_len,
                              num_documents=docs, pad=pad, max_anchors=slots)
        n = int(case.inputs["loss_mask"][0, :-block].sum())
        ref = SideOutputs(draw_anchors(DrafterCandidate().select_anchors, case), {}, {})
        same = check_anchor_draws(case, SideOutputs(draw_anchors(
            DrafterCandidate().select_anchors, case, seed=7), {}, {}), ref)
        assert same.status == "pass", (case.name, same.summary)
        for select in (strided(), strided(wrap=True)):
            r = check_anchor_draws(case, SideOutputs(draw_anchors(select, case, seed=7), {},
                                                     {}), ref)
            if n <= slots:
                assert r.status == "pass" and "cannot show" in r.summary, (case.name, r.summary)
            else:
                assert r.status == "fail" and r.details["causes"][0].startswith(
                    "anchors drawn at a fixed stride over the valid positions"), r.summary
            seen.append(r.status)
    assert seen.count("pass") == 2 and seen.count("fail") == 10  # one case cannot show it


def test_sampler_with_the_reference_signature_uses_the_global_rng(ours):
    """select_anchors(loss_mask, n, block_size), as the reference writes it: no generator."""
    def reference_style(loss_mask, n, block_size):
        return uniform()(loss_mask, n, block_size, None)

    assert check(reference_style, ours).status == "pass"
    again = draw_anchors(reference_style, case())["anchor_draws"]
    assert torch.equal(again, draw_anchors(reference_style, case())["anchor_draws"])  # seeded


def test_missing_sampler_warns_and_shape_mismatch_fails(ours):
    assert check_anchor_draws(case(), SideOutputs({}, {}, {}), ours).status == "warn"
    short = {k: v[:10] for k, v in ours.tensors.items()}
    assert check_anchor_draws(case(), SideOutputs(short, {}, {}), ours).status == "fail"


@pytest.mark.reference
def test_against_the_reference_sampler(run_reference_cases):
    """Our sampler matches the real reference's; one without the tail exclusion fails with a
    diagnosis through the full check run."""
    CASE = case()
    ref = run_reference_cases([CASE])[CASE.name]
    assert ref.tensors["anchor_draws"].shape == (512, 6)
    cand = DrafterCandidate()
    out = cand.run_case(CASE.config, CASE.loss, CASE.weights, CASE.inputs)
    out.tensors.update(draw_anchors(cand.select_anchors, CASE))
    results = {r.name: r for r in run_checks(CASE, out, ref)}
    assert results["anchors"].status == "pass", results["anchors"].summary
    out.tensors.update(draw_anchors(uniform(exclude_tail=0), CASE))
    results = run_checks(CASE, out, ref)
    diagnose(CASE, out, ref, results)
    r = next(r for r in results if r.name == "anchors")
    assert r.status == "fail" and r.diagnosis[0].startswith("anchors drawn from the last")
    # a per-document sampler gets document_ids and is named against the per-row reference
    out.tensors.update(draw_anchors(per_document, CASE))
    assert out.tensors["anchor_draws"].shape == (512, 12)
    r = next(r for r in run_checks(CASE, out, ref) if r.name == "anchors")
    assert r.status == "fail" and r.details["sampling"] == {"candidate": "per document",
                                                            "reference": "per row"}
    assert r.summary.startswith("anchors sampled per document (max_anchors=6 per packed "
                                "document) where the reference samples per row"), r.summary


def test_rank_statistics_are_the_textbook_ones():
    """Mann-Whitney z of two separated samples of 3 (U = 0: z = -4.5 / sqrt(9 * 7 / 12)), ties
    averaged; a chi-square p of identical spreads is 1."""
    assert mann_whitney_z(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])) == pytest.approx(
        -4.5 / (9 * 7 / 12) ** 0.5)
    assert mann_whitney_z(torch.tensor([1, 1]), torch.tensor([1, 1])) == 0.0
    same = torch.arange(10).repeat(20)
    assert conditional_p(same, same, list(range(10))) == pytest.approx(1.0)
    assert conditional_p(same, torch.arange(5).repeat(40), list(range(5))) == pytest.approx(1.0)
    skew = torch.cat([torch.zeros(400, dtype=torch.long), same])
    assert conditional_p(same, skew, list(range(10))) < 1e-9
