"""The shipped example candidates against the real reference (speculators 0.9.0): each known
bug fails on the right check with the right diagnosis, and nothing upstream of it fails; our
drafter and the minimal user model pass every check."""

from __future__ import annotations

import functools

from pathlib import Path

import pytest

from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.checks import run_checks
from dflash_audit.audit.diagnose import diagnose
from dflash_audit.audit.sides.run_sides import run_candidate
from dflash_audit.candidate import DrafterCandidate, load_candidate
from dflash_audit.data.families import family_config
from dflash_audit.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashConfig,
    default_target_layer_ids,
)
from dflash_audit.model.loss import LossSpec

pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("single_thread")]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
N = 30  # verifier depth: the z-lab default ids [2, 9, 15, 21, 28] end at N-2
IDS = default_target_layer_ids(N)
BASE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_hidden_layers=2, vocab_size=96, num_verifier_layers=N,
            target_layer_ids=IDS, mask_token_id=95)
#: The cases of each group, by name; built once on first use (:func:`named`), not at collection.
CASES = ("mixed", "zlab-full")
USER_CASES = ("gemma3-ce-mixed", "llama-sliding-from-anchor")
SPECIAL = ("sample-from-anchor", "dpace-one-block", "dpace")


def _cases():
    return [
        synthetic_case("mixed", DFlashConfig(**BASE, block_size=4, sliding_window=8,
                                             layer_types=(FULL_ATTENTION, SLIDING_ATTENTION)),
                       LossSpec(), seed=7, seq_len=64, num_documents=3, pad=4, max_anchors=6),
        synthetic_case("zlab-full", DFlashConfig(**BASE, block_size=5), LossSpec(), seed=8,
                       seq_len=64, num_documents=2, pad=2, max_anchors=5),
    ]


# example -> ({check[.layer type]: start of its first diagnosis}, checks that must pass)
EXPECTED = {
    "fc_subset": ({"structure": "fc fed 4 of 5 target layers: Linear(4*H, H) instead of "
                                "Linear(5*H, H)",
                   "context": "fc fed 4 of 5 target layers: it reads layers [2, 9, 15, 21] "
                              "(hidden_states slices [0, 1, 2, 3]) and misses [28]",
                   "logits": "follows from the context difference: our drafter fed the "
                             "candidate's own context reproduces the candidate's logits"},
                  ("mask", "targets")),
    "targets_from_target_layer": ({"targets": "targets from target layer 28 (hidden_states slice "
                                              "4), not the verifier's last layer N=30: L = N-2",
                                   "loss": "the candidate's loss formula conforms"},
                                  ("structure", "mask", "context", "logits")),
    "targets_post_norm": ({"targets": "targets from post-norm states: the verifier's final norm "
                                      "is applied twice"},
                          ("structure", "mask", "context", "logits")),
    "grad_accumulation_unscaled": ({"gradients": "gradients scaled by 2: every parameter's "
                                                 "gradient is 2 x the reference's while the "
                                                 "reported loss matches"},
                                   ("structure", "mask", "context", "targets", "logits", "loss")),
    "gamma7": ({"loss": "decay gamma 7 (fitted from the weights",
                "gradients": "follows from the loss difference"},
               ("structure", "mask", "context", "targets", "logits")),
    "context_rule_le": ({"mask.full_attention": "context rule kv <= anchor (reference: kv < "
                                                "anchor)",
                         "logits": "follows from the mask difference: our drafter fed the "
                                   "candidate's own masks reproduces the candidate's logits"},
                        ("structure", "context", "targets")),
    "causal_block": ({"mask.full_attention": "causal attention inside the block in a "
                                             "full-attention layer (reference: bidirectional "
                                             "block)",
                      "logits": "follows from the mask difference"},
                     ("structure", "context", "targets")),
    "shifted_inputs": ({"context": "hidden_states shifted left by 1 relative to loss_mask / "
                                   "position_ids",
                        "logits": "hidden_states and input_ids shifted left by 1 relative to "
                                  "loss_mask / position_ids"},
                       ("structure", "mask", "targets")),
    "bool_mask_added": ({"logits": "attention ignores the mask: the boolean mask is added to "
                                   "the scores"},
                        ("structure", "mask", "context", "targets")),
    "no_decay": ({"loss": "no position decay (w_s = 1); reference exp(-(s-1)/4)",
                  "gradients": "follows from the loss difference"},
                 ("structure", "mask", "context", "targets", "logits")),
    "lk_hybrid_loss": ({"loss": "loss computed as 'lk_hybrid' where the profile says 'kl_div'",
                        "gradients": "follows from the loss difference"},
                       ("structure", "mask", "context", "targets", "logits")),
}


@pytest.fixture(scope="module")
def reference(run_reference_cases):
    return run_reference_cases(cases(CASES))


def audit(candidate, case, reference):
    """The harness's own path: run_case, then the candidate's anchor sampler drawn."""
    cand, failed = run_candidate(candidate, case)
    if failed is not None:
        raise RuntimeError(failed.summary)
    results = run_checks(case, cand, reference[case.name])
    diagnose(case, cand, reference[case.name], results)
    return {(f"{r.name}.{r.details['layer_type']}" if r.name == "mask" else r.name): r
            for r in results}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_example_fails_on_the_right_check_with_the_right_diagnosis(example, case, reference):
    results = audit(load_candidate(f"{EXAMPLES / 'candidates' / example}.py:candidate"), case,
                    reference)
    failing, passing = EXPECTED[example]
    for key, cause in failing.items():
        r = results[key]
        assert r.status == "fail", (key, r.summary)
        assert r.diagnosis[0].startswith(cause), (key, r.diagnosis)
    for key in passing:
        keys = [k for k in results if k == key or k.startswith(key + ".")]
        assert keys and all(results[k].status == "pass" for k in keys), \
            [(k, results[k].summary) for k in keys]
    assert {r.status for r in results.values()} >= {"fail"}


@pytest.mark.parametrize("name", CASES)
def test_every_layer_type_shows_the_context_rule_bug(case, reference):
    results = audit(load_candidate(f"{EXAMPLES}/candidates/context_rule_le.py:candidate"), case,
                    reference)
    masks = [r for k, r in results.items() if k.startswith("mask.")]
    assert len(masks) == len(set(case.config.effective_layer_types))
    assert all(r.status == "fail" and r.diagnosis[0].startswith("context rule kv <= anchor")
               for r in masks)


def test_causal_block_leaves_the_sliding_layer_passing(reference):
    results = audit(load_candidate(f"{EXAMPLES}/candidates/causal_block.py:candidate"),
                    named("mixed"), reference)
    assert results["mask.sliding_attention"].status == "pass"


def test_gamma7_defaults_warn_with_both_values(reference):
    r = audit(load_candidate(f"{EXAMPLES}/candidates/gamma7.py:candidate"), named("mixed"),
              reference)["defaults"]
    assert r.status == "warn" and r.details["fields"]["gamma"] == {
        "profile": 4.0, "candidate_default": 7.0, "reference_default": 4.0}


@pytest.mark.parametrize("name", CASES)
def test_our_drafter_passes_every_check(case, reference):
    results = audit(DrafterCandidate(), case, reference)
    assert {r.status for r in results.values()} == {"pass"}, \
        [(k, r.summary) for k, r in results.items() if r.status != "pass"]


def _family_case(name, family, loss, seed, **drafter):
    """A synthetic case whose drafter config derives from a verifier family's proxy (N=12)."""
    config = DFlashConfig.from_verifier_config(
        family_config(family, num_hidden_layers=12), target_layer_ids=[1, 4, 7, 10],
        mask_token_id=127, **drafter)
    return synthetic_case(name, config, loss, seed=seed, seq_len=48, num_documents=2, pad=3,
                          max_anchors=5)


# gemma3_text: gelu_pytorch_tanh, x*(1+w) verifier norm, head_dim 16 != H/heads, nested rope;
# llama: llama3 rope scaling, eps 1e-5, a draft vocabulary; both with sliding layers (W=6)
def _user_cases():
    return [
        _family_case("gemma3-ce-mixed", "gemma3_text", LossSpec("ce", gamma=7.0), seed=12,
                     num_hidden_layers=2, block_size=4, sliding_window=6,
                     layer_types=(SLIDING_ATTENTION, FULL_ATTENTION)),
        _family_case("llama-sliding-from-anchor", "llama", LossSpec(), seed=13, block_size=3,
                     sliding_window=6, layer_types=(SLIDING_ATTENTION,), sample_from_anchor=True,
                     draft_vocab_size=64),
    ]


@pytest.fixture(scope="module")
def user_reference(run_reference_cases):
    return run_reference_cases(cases(USER_CASES))


@pytest.mark.parametrize("name", CASES + USER_CASES)
def test_minimal_user_model_passes_every_check(case, reference, user_reference):
    user = load_candidate(f"{EXAMPLES}/minimal_user_model.py:TinyDFlashCandidate")
    results = audit(user, case, {**reference, **user_reference})
    assert {r.status for r in results.values()} == {"pass"}, \
        [(k, r.summary) for k, r in results.items() if r.status != "pass"]
    assert {k for k in results if k.startswith("mask.")} == {
        f"mask.{t}" for t in case.config.effective_layer_types}


def test_minimal_user_model_names_what_it_does_not_implement():
    case = named("dpace")
    cand, failed = run_candidate(
        load_candidate(f"{EXAMPLES}/minimal_user_model.py:TinyDFlashCandidate"), case)
    assert cand is None and failed.summary.startswith(
        "the candidate's run_case raised NotImplementedError: TinyDFlash: loss 'ce' with "
        "'dpace' weighting"), failed.summary


# ------------------------------------------------ cases that need another profile or config
def _special():
    return [
        synthetic_case("sample-from-anchor", DFlashConfig(**BASE, block_size=4,
                                                          sample_from_anchor=True),
                       LossSpec(), seed=9, seq_len=48, num_documents=2, pad=2, max_anchors=4),
        # reference-train-cli's weighting: ce with D-PACE; one supervised block (B=2, one anchor)
        synthetic_case("dpace-one-block", DFlashConfig(**BASE, block_size=2),
                       LossSpec("ce", "dpace"),
                       seed=10, seq_len=32, num_documents=1, pad=0, max_anchors=1),
        synthetic_case("dpace", DFlashConfig(**BASE, block_size=4), LossSpec("ce", "dpace"),
                       seed=11, seq_len=64, num_documents=2, pad=2, max_anchors=6),
    ]


@functools.cache
def _all_cases() -> dict:
    built = {c.name: c for c in [*_cases(), *_user_cases(), *_special()]}
    assert tuple(built) == CASES + USER_CASES + SPECIAL
    return built


def named(name: str):
    """The case ``name`` (of :data:`CASES`, :data:`USER_CASES` or :data:`SPECIAL`)."""
    return _all_cases()[name]


def cases(names: tuple[str, ...]) -> list:
    return [named(n) for n in names]


@pytest.fixture(name="case")
def _case(name: str):
    """The case of the test's ``name`` parameter."""
    return named(name)


@pytest.fixture(scope="module")
def special(run_reference_cases):
    return run_reference_cases(cases(SPECIAL))


def test_raising_candidate_is_a_failure_that_names_the_dropped_slice():
    cand, failed = run_candidate(
        load_candidate(f"{EXAMPLES}/candidates/fc_drops_last_slice.py:candidate"),
        named("zlab-full"))
    assert cand is None and failed.status == "fail"
    assert failed.summary.startswith("the candidate's run_case raised RuntimeError: mat1 and "
                                     "mat2 shapes")
    assert failed.diagnosis[0].startswith(
        "fc expects 5 target layers (160 = 5*H features, H = 32), the candidate passed 4 (128 "
        "features): 1 target-layer slice(s) dropped before fc"), failed.diagnosis


def test_no_decay_defaults_warn_on_gamma_none(reference):
    r = audit(load_candidate(f"{EXAMPLES}/candidates/no_decay.py:candidate"), named("zlab-full"),
              reference)["defaults"]
    assert r.status == "warn" and r.details["fields"]["gamma"]["candidate_reports_none"]
    assert r.diagnosis[0].startswith("the candidate's default gamma is None (no position decay")


def test_sample_from_anchor_slot_zero_weight_is_named(special):
    case = named("sample-from-anchor")
    r = audit(load_candidate(f"{EXAMPLES}/candidates/anchor_slot_zero.py:candidate"), case,
              special)["loss"]
    assert r.status == "fail"
    assert r.diagnosis[0] == ("slot 0 weighted 0 where sample_from_anchor trains it with weight 1 "
                              "(fit 0 vs 1); decay formula exp(-(s-1)/gamma) instead of "
                              "exp(-s/gamma)"), r.diagnosis


def test_dpace_on_one_block_names_no_fixed_weights_and_follows_the_mask(special):
    """Issue 11 items 7/8: one supervised block makes "constant weight per slot" trivially
    true; the D-PACE weight shift follows from the mask difference."""
    case = named("dpace-one-block")
    results = audit(load_candidate(f"{EXAMPLES}/candidates/context_rule_le.py:candidate"), case,
                    special)
    loss = results["loss"]
    assert loss.status == "fail"
    assert not any("fixed per-slot weights" in d for d in loss.diagnosis), loss.diagnosis
    assert loss.diagnosis[0].startswith("follows from the mask"), loss.diagnosis
    assert not any("unexplained" in d for r in results.values() for d in r.diagnosis), \
        [(k, r.diagnosis) for k, r in results.items() if r.diagnosis]


def test_fixed_weights_under_dpace_named_where_the_case_separates_them(special):
    class FixedDecay(DrafterCandidate):
        def run_case(self, config, loss, weights, inputs):
            fixed = LossSpec(loss.loss, "fixed-exp-decay", loss.gamma, loss.dpace_alpha)
            return super().run_case(config, fixed, weights, inputs)

    case = named("dpace")
    assert audit(FixedDecay(), case, special)["loss"].diagnosis[0] == \
        "fixed per-slot weights where the profile says D-PACE"
    one = named("dpace-one-block")
    assert not any("fixed per-slot" in d for d in audit(FixedDecay(), one, special)[
        "loss"].diagnosis)


@pytest.mark.parametrize("name", SPECIAL)
def test_our_drafter_passes_the_special_cases(case, special):
    results = audit(DrafterCandidate(), case, special)
    assert {r.status for r in results.values()} == {"pass"}, \
        [(k, r.summary) for k, r in results.items() if r.status != "pass"]
