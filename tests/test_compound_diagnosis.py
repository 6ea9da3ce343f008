"""Issue 20: the shipped example candidates of real-framework bug classes, against the real
reference (speculators 0.9.0): several causes at once, each named, nothing "unexplained", and
no false name: every named cause, applied to our drafter (or the reference's formula), is
replayed here and reproduces the candidate's own numbers. Our drafter on the same cases is the
conformant twin of every example (it passes).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.checks import run_checks
from dflash_audit.audit.checks.anchors import rule_sets
from dflash_audit.audit.checks.loss import data_token_ce, dpace_match
from dflash_audit.audit.checks.mask import (
    build_mask,
    expected_mask_hypothesis,
)
from dflash_audit.audit.diagnose import diagnose
from dflash_audit.audit.replay.architecture import interleaved_rope_weights
from dflash_audit.audit.replay.evidence import Evidence, SearchMemo
from dflash_audit.audit.replay.loss_formulas import recompute_loss
from dflash_audit.audit.replay.replay import replay
from dflash_audit.audit.sides.run_sides import run_candidate
from dflash_audit.audit.slots import as_bool_mask, supervised_rows, supervised_slots
from dflash_audit.candidate import DrafterCandidate, load_candidate
from dflash_audit.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashConfig,
    default_target_layer_ids,
)
from dflash_audit.model.loss import LossSpec, parse_loss

pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("single_thread")]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "candidates"
BASE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_hidden_layers=2, vocab_size=96, num_verifier_layers=30,
            target_layer_ids=default_target_layer_ids(30), mask_token_id=95)
MIXED = DFlashConfig(**BASE, block_size=4, sliding_window=8,
                     layer_types=(FULL_ATTENTION, SLIDING_ATTENTION))


def _anchor_case():
    """Two documents, loss_mask set up to the row's end (T-B supervised), A above the number
    of valid positions (so "one fewer" shows)."""
    case = synthetic_case("anchors", MIXED, LossSpec(), seed=5, seq_len=40, num_documents=2,
                          pad=0, max_anchors=48)
    lm = case.inputs["loss_mask"].clone()
    lm[0, -6:] = 1
    return dataclasses.replace(case, inputs={**case.inputs, "loss_mask": lm})


#: The cases' names, in order (the cases are built on first use, not at collection).
CASE_NAMES = ("mixed", "dpace-ce", "dpace-kl", "anchors")


@functools.cache
def cases() -> dict:
    """``{name: case}`` of :data:`CASE_NAMES`, built once."""
    built = {c.name: c for c in [
        synthetic_case("mixed", MIXED, LossSpec(), seed=7, seq_len=64, num_documents=3, pad=4,
                       max_anchors=6),
        synthetic_case("dpace-ce", MIXED, LossSpec("ce", "dpace"), seed=11, seq_len=64,
                       num_documents=2, pad=2, max_anchors=6),
        synthetic_case("dpace-kl", MIXED, LossSpec("kl_div", "dpace"), seed=12, seq_len=64,
                       num_documents=2, pad=2, max_anchors=6),
        _anchor_case(),
    ]}
    assert tuple(built) == CASE_NAMES
    return built


@pytest.fixture(scope="module")
def reference(run_reference_cases):
    return run_reference_cases(list(cases().values()))


def audit(candidate, case, reference, memo=None):
    cand, failed = run_candidate(candidate, case)
    assert failed is None, failed.summary
    results = run_checks(case, cand, reference[case.name])
    diagnose(case, cand, reference[case.name], results, memo)
    by_key = {(f"{r.name}.{r.details['layer_type']}" if r.name == "mask" else r.name): r
              for r in results}
    return cand, by_key


def close(a, b, atol=1e-5, rtol=1e-5):
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)


def packed(case):
    """Replay positions of a packed row read as one sequence: context 0..T-1, noise a+s."""
    T = case.inputs["position_ids"].shape[-1]
    a = case.inputs["anchor_positions"].long()
    noise = (a[:, None] + torch.arange(case.config.block_size)).reshape(1, -1)
    return lambda pos: torch.cat([torch.arange(T)[None], noise], 1)


def masks_of(case, **per_type):
    """{layer type: [Q,T+Q]} built from the expected hypothesis with per-type changes."""
    return {t: build_mask(case, dataclasses.replace(expected_mask_hypothesis(case, t), **kw))
            for t, kw in per_type.items()}


def logits_replay(case, cand, **kw):
    sup = supervised_slots(case, cand)
    return close(replay(case, **kw)[:, sup], cand.tensors["logits"][:, sup])


def rows_equal(case, cand, masks):
    rows = supervised_rows(case, cand)
    return all(torch.equal(as_bool_mask(cand.tensors[f"mask.{t}"])[rows], m[rows])
               for t, m in masks.items())


def loss_replay(case, cand, ref, mix, denom):
    value = recompute_loss(Evidence(case, cand, ref), mix, denom)
    return abs(value - float(cand.tensors["loss"])) <= 1e-5 * max(1.0, abs(value))


W = MIXED.sliding_window
PER_QUERY = "sliding window measured from the query's own position: kv >= a + s - W + 1"
LEAK = "cross-document leakage"
PACKED = ("position ids: context not restarting per document (0..T-1), noise block a+s "
          "(packed position, not restarting per document)")
WEIGHT_SUM = "loss normalised by the sum of weights instead of the number of supervised tokens"
SOFT_CE = "soft cross-entropy -sum p log q (= KL + the teacher's entropy H(p)"


def replays_per_query(case, cand, ref):
    masks = masks_of(case, sliding_attention={"per_query": True})
    return rows_equal(case, cand, masks) and logits_replay(case, cand, masks=masks)


def replays_packed(case, cand, ref):
    masks = masks_of(case, full_attention={"documents": False},
                     sliding_attention={"documents": False})
    return rows_equal(case, cand, masks) and logits_replay(case, cand, masks=masks,
                                                           positions=packed(case))


def replays_three(case, cand, ref):
    masks = masks_of(case, full_attention={"documents": False},
                     sliding_attention={"documents": False, "per_query": True})
    return (rows_equal(case, cand, masks) and logits_replay(case, cand, masks=masks,
                                                            positions=packed(case))
            and loss_replay(case, cand, ref, parse_loss(case.loss.loss), "weights"))


def replays_targets(case, cand, ref):
    ev = Evidence(case, cand, ref)
    sup = supervised_slots(case, ref)
    return torch.equal(cand.tensors["targets"][0, sup].argmax(-1), ev.data_labels[sup])


# example -> (case, {check: a diagnosis entry starts with}, the replay of every named cause)
EXPECTED = {
    "per_query_window": ("mixed", {"mask.sliding_attention": [PER_QUERY],
                                   "logits": ["follows from the mask difference: our drafter"]},
                         replays_per_query),
    "packed_positions": ("mixed", {"mask.full_attention": [LEAK], "logits": [
        PACKED, "follows from the mask difference together with this change"]}, replays_packed),
    "three_causes": ("mixed", {"mask.full_attention": [LEAK],
                               "mask.sliding_attention": [PER_QUERY],
                               "logits": [PACKED], "loss": [WEIGHT_SUM]}, replays_three),
    "rope_interleaved": ("mixed", {"logits": ["RoPE applied to interleaved pairs (x0,x1),(x2,x3)"]},
                         lambda case, cand, ref: logits_replay(
                             case, cand, weights=interleaved_rope_weights(case.config,
                                                                          case.weights))),
    "targets_data_tokens": ("mixed", {"targets": ["targets are the data tokens input_ids[a+s], "
                                                  "not the verifier's prediction at a+s-1"]}, replays_targets),
    "soft_ce": ("mixed", {"loss": [SOFT_CE]}, lambda case, cand, ref: loss_replay(
        case, cand, ref, {"soft_ce": 1.0}, "tokens")),
    "soft_ce_weight_sum": ("mixed", {"loss": [SOFT_CE, WEIGHT_SUM]},
                           lambda case, cand, ref: loss_replay(case, cand, ref,
                                                               {"soft_ce": 1.0}, "weights")),
    "dpace_weight_sum": ("dpace-ce", {"loss": [WEIGHT_SUM]}, lambda case, cand, ref: loss_replay(
        case, cand, ref, {"ce": 1.0}, "weights")),
    "dpace_batch_size": ("dpace-ce", {"loss": ["loss divided by the batch size"]},
                         lambda case, cand, ref: loss_replay(case, cand, ref, {"ce": 1.0},
                                                             "batch")),
    "dpace_data_token_confidence": ("dpace-kl", {"loss": [
        "D-PACE confidences computed from cross-entropy against the data tokens"]},
        lambda case, cand, ref: dpace_match(ev := Evidence(case, cand, ref), "kl_div",
                                            data_token_ce(ev))),
}
#: soft CE under D-PACE: the weights follow from the loss kind (a consequence, named after it)
EXPECTED["soft_ce_dpace"] = ("dpace-kl", {"loss": [
    SOFT_CE, "follows from the loss kind difference: D-PACE weights depend on the per-token "
             "loss"]}, lambda case, cand, ref: loss_replay(case, cand, ref, {"soft_ce": 1.0},
                                                           "tokens"))


def no_unexplained(results):
    return not [(k, d) for k, r in results.items() for d in r.diagnosis
                if "unexplained" in d or "differ as well" in d]


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_example_names_every_cause_and_each_cause_replays(example, reference):
    case_name, expected, replays = EXPECTED[example]
    case = cases()[case_name]
    file = "soft_ce" if example == "soft_ce_dpace" else example
    cand, results = audit(load_candidate(f"{EXAMPLES / file}.py:candidate"), case, reference)
    for key, starts in expected.items():
        r = results[key]
        assert r.status == "fail", (key, r.summary)
        for i, start in enumerate(starts):
            assert any(d.startswith(start) for d in r.diagnosis), (key, start, r.diagnosis)
            if i == 0:  # the first named cause leads (causes before consequences)
                assert r.diagnosis[0].startswith(start), (key, r.diagnosis)
    assert no_unexplained(results), [(k, r.diagnosis) for k, r in results.items()]
    assert replays(case, cand, reference[case.name]), "a named cause does not replay"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_our_drafter_is_the_conformant_twin(name, reference):
    case = cases()[name]
    _, results = audit(DrafterCandidate(), case, reference)
    assert {r.status for r in results.values()} <= {"pass", "warn"}, \
        [(k, r.summary) for k, r in results.items() if r.status == "fail"]
    assert all(r.status == "pass" for k, r in results.items() if k != "derivation")


ANCHORS = {
    "anchor_needs_next": ("an anchor also needs loss_mask[a+1]", "next"),
    "anchor_needs_block_in_document": ("an anchor needs block_size-1 further tokens of its own "
                                       "document", "document"),
    "anchor_one_fewer": ("one anchor fewer per draw than there are valid positions", None),
    # a plain candidate: the rule is named, no framework's name (ModelOpt's rule only when
    # ModelOpt is the candidate, frameworks/rules.py)
    "anchor_at_t_minus_b": ("anchors admitted at T-B: a <= T - block_size; the block of an "
                            "anchor at T-B ends at T-1, inside the row", None),
}


@pytest.mark.parametrize("example", sorted(ANCHORS))
def test_anchor_rule_is_named_and_its_rule_replays(example, reference):
    case = cases()["anchors"]
    cause, rule = ANCHORS[example]
    cand, results = audit(load_candidate(f"{EXAMPLES / example}.py:candidate"), case, reference)
    r = results["anchors"]
    assert r.status == "fail" and r.diagnosis[0].startswith(cause), r.diagnosis
    assert "runs past" not in r.diagnosis[0]
    ref = reference[case.name]
    c_set = set(cand.tensors["anchor_draws"][cand.tensors["anchor_draws_valid"].bool()].tolist())
    r_set = set(ref.tensors["anchor_draws"][ref.tensors["anchor_draws_valid"].bool()].tolist())
    T, B = case.inputs["loss_mask"].shape[-1], case.config.block_size
    if rule:  # the named rule applied to the reference's support gives the candidate's
        assert c_set == r_set - rule_sets(case)[rule]
    elif example == "anchor_at_t_minus_b":
        assert c_set == r_set | {T - B}
    else:
        counts = cand.tensors["anchor_draws_valid"].sum(1)
        assert set(counts.tolist()) == {int(ref.tensors["anchor_draws_valid"][0].sum()) - 1}
    # every other check passes: the anchors the forward uses are injected
    assert all(x.status != "fail" for k, x in results.items() if k != "anchors")


@pytest.fixture(scope="module")
def family_cases(run_reference_cases):
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.profile import Profile

    planned = plan_synthetic_cases(Profile.load("reference-model"), 8, seed=8)
    cases = {p.case.name.split("-")[2]: p.case for p in planned}
    cases = {k: cases[k] for k in ("gemma3_text", "llama")}
    return cases, run_reference_cases(list(cases.values()))


@pytest.mark.parametrize("example,family,cause", [
    ("derive_config_defaults", "llama", "the drafter config does not inherit the verifier's "
                                        "num_attention_heads, num_key_value_heads, head_dim"),
    ("derive_rope_theta_attribute", "llama", "rope_theta set as a config attribute (500000, "
                                             "what the saved config.json says) that "
                                             "transformers 5's rotary embedding never reads"),
    ("derive_config_raises", "gemma3_text", "derive_config raised KeyError: 'rope_type'"),
])
def test_derivation_classes_are_named(example, family, cause, family_cases):
    cases, reference = family_cases
    case = cases[family]
    cand, results = audit(load_candidate(f"{EXAMPLES / example}.py:candidate"), case,
                          reference)
    r = results["derivation"]
    assert r.status == "fail" and r.diagnosis[0].startswith(cause), r.diagnosis
    assert not any("unexplained" in d or "not a conformance failure" in d for d in r.diagnosis)
    if example == "derive_config_raises":
        llama = audit(load_candidate(f"{EXAMPLES / example}.py:candidate"), cases["llama"],
                      reference)[1]["derivation"]
        assert llama.status == "pass", llama.summary


def test_a_cause_found_on_one_case_is_tried_first_on_the_next(reference):
    memo = SearchMemo()
    example = load_candidate(f"{EXAMPLES / 'packed_positions'}.py:candidate")
    audit(example, cases()["mixed"], reference, memo)
    assert any(label.startswith(PACKED) for label in memo.found["logits"])
    _, results = audit(example, cases()["dpace-kl"], reference, memo)
    assert results["logits"].diagnosis[0].startswith(PACKED)


def test_causes_found_before_are_tried_together_first_and_the_fewest_still_win():
    """``compound_search`` with ``known`` (the labels earlier cases reproduced with): a pair of
    them is confirmed in a few replays instead of a full pass; one of them that reproduces
    alone is reported alone; a known label this case has no hypothesis for is skipped; with
    nothing known the full search finds the same pair."""
    from dflash_audit.audit.replay.compound import compound_search

    hyps = [(name, {name: True}) for name in "ABCDEFGH"]
    labels = lambda kw: frozenset(k for k in kw if kw[k] is True)  # noqa: E731

    def search(truth: set[str], known: list[str]):
        probe = lambda kw: (labels(kw) == truth, len(labels(kw) ^ truth) / 8)  # noqa: E731
        return compound_search(hyps, {}, None, probe, lambda kw: labels(kw) == truth,
                               baseline=1.0, known=known)

    full = search({"C", "F"}, [])
    assert full.labels == ["C", "F"] and full.replays > len(hyps)
    seeded = search({"C", "F"}, ["F", "Z", "C"])  # Z: a cause of another case's kind
    assert sorted(seeded.labels) == ["C", "F"] and seeded.replays == 3  # F, C, then both
    assert search({"C"}, ["F", "C"]).labels == ["C"]  # alone, before the pair
    assert search({"B", "G"}, ["F", "C"]).labels == ["B", "G"]  # a new cause: full search


# ------------------------------------------------ wording that is true (no reference needed)
@pytest.fixture(scope="module")
def ours():
    case = cases()["mixed"]
    return DrafterCandidate().run_case(case.config, case.loss, case.weights, case.inputs)


def _edited(side, **tensors):
    import copy

    from dflash_audit.audit.case import SideOutputs

    return SideOutputs({**side.tensors, **tensors}, dict(side.metrics),
                       copy.deepcopy(side.structure), dict(side.defaults), list(side.trainable))


def test_eal_offset_named_only_where_the_case_tells_the_readings_apart(ours):
    from dflash_audit.audit.checks.metrics import eal_offset_causes
    from dflash_audit.audit.result import CheckResult

    ev = Evidence(cases()["mixed"], ours, ours)
    eal = ours.metrics["eal_sum"] / ours.metrics["eal_total"]

    def named(value):
        r = CheckResult("metrics", "mixed", "warn", "",
                        details={"differences": {"eal": {"candidate": value}}})
        return eal_offset_causes(ev, r)

    assert named(eal) == []  # the reference's own definition: no offset to name
    assert named(ours.metrics["eal_product"]) == []  # the other definition itself
    if abs(eal + 1 - ours.metrics["eal_product"]) > 1e-3:
        assert named(eal + 1)[0].startswith("acceptance length off by +1")


def test_dpace_weights_imply_no_gamma(reference):
    from dflash_audit.audit.checks.loss import check_loss

    case = cases()["dpace-kl"]
    out = DrafterCandidate().run_case(case.config, case.loss, case.weights, case.inputs)
    key = "loss_weights.kl_div"
    r = check_loss(case, _edited(out, **{key: out.tensors[key] * 1.5}), reference[case.name])
    assert r.status == "fail" and "implied gamma" not in r.summary, r.summary


def test_a_warning_only_field_is_never_part_of_a_failure(ours, family_cases):
    from dflash_audit.audit.checks.derivation import diagnose_derivation
    from dflash_audit.audit.result import CheckResult

    differing = {"mask_token_id": {"candidate": 16, "reference": 2},
                 "head_dim": {"candidate": 16, "reference": 8}}
    r = CheckResult("derivation", "llama", "fail", "", details={"differing": differing})
    (cause,) = diagnose_derivation(Evidence(family_cases[0]["llama"], ours, ours), r)
    assert cause == "head_dim 16 where the reference derives 8"


def test_fp32_tolerance_scales_with_the_magnitude():
    from dflash_audit.audit.tolerance import magnitude_tolerance

    case = cases()["mixed"]
    big = torch.full((4,), 6500.0)
    tol = {"atol": 1e-5, "rtol": 1e-5}
    scaled = magnitude_tolerance(case, "targets", big, tol)
    assert scaled["atol"] == pytest.approx(64 * torch.finfo(torch.float32).eps * 6500)
    assert magnitude_tolerance(case, "targets", torch.ones(4), tol) == tol  # |ref| ~ 1
    assert magnitude_tolerance(case, "loss", big, tol) == tol


def test_unexplained_logits_say_where_they_start(ours):
    """A score scale no hypothesis lists (1.3/sqrt(head_dim)): unexplained, located in the
    query/key path of the draft attention, with what was tried."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_diagnose import attention_with, candidate, drafter

    case = cases()["mixed"]
    out = candidate(drafter(attention_with(scale=1.3 * case.config.head_dim ** -0.5))).run_case(
        case.config, case.loss, case.weights, case.inputs)
    results = run_checks(case, out, ours)
    diagnose(case, out, ours, results)
    (r,) = [x for x in results if x.name == "logits"]
    assert r.diagnosis[0].startswith("unexplained difference in logits")
    assert r.diagnosis[1].startswith("where it starts: draft layer 0 attention, the query/key "
                                     "path"), r.diagnosis
    assert r.diagnosis[1].endswith("the masks, context and targets conform")
    assert r.diagnosis[2].startswith("tried and ruled out: ")


def test_a_window_that_also_bounds_the_block_is_named():
    """z-lab's inference mask applies ``query_pos - key_pos < W`` to every key: with W < B the
    window also hides earlier slots of the block itself. Named as the per-query window that
    also bounds the block (our drafter is the reference side here: it conforms)."""
    config = DFlashConfig(**BASE, block_size=5, sliding_window=3,
                          layer_types=(SLIDING_ATTENTION, SLIDING_ATTENTION))
    case = synthetic_case("window-in-block", config, LossSpec(), seed=3, seq_len=48,
                          num_documents=1, pad=0)
    ours = DrafterCandidate().run_case(case.config, case.loss, case.weights, dict(case.inputs))
    exp = expected_mask_hypothesis(case, SLIDING_ATTENTION)
    zlab = build_mask(case, dataclasses.replace(exp, per_query=True, window_in_block=True))
    cand = dataclasses.replace(ours, tensors={**ours.tensors,
                                              "mask.sliding_attention": zlab})
    assert not torch.equal(zlab, build_mask(case, dataclasses.replace(exp, per_query=True)))
    results = run_checks(case, cand, ours)
    diagnose(case, cand, ours, results)
    mask = next(r for r in results if r.name == "mask"
                and r.details.get("layer_type") == SLIDING_ATTENTION)
    assert mask.status == "fail"
    assert any(d.startswith(PER_QUERY) and "it also bounds the block itself" in d
               for d in mask.diagnosis), mask.diagnosis
