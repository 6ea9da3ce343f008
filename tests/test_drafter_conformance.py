"""Our drafter against the real reference (speculators 0.9.0), fp32 on CPU, atol 1e-5.

Same weights, batch and anchors on both sides; every quantity that defines training is
compared: context, masks, targets, draft logits, loss, per-slot weights, metrics and the
gradient of every trainable parameter.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.loss import LossSpec

pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("single_thread")]
ATOL = RTOL = 1e-5

BASE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_hidden_layers=2, vocab_size=96, num_verifier_layers=6,
            target_layer_ids=(1, 3, 5), mask_token_id=95, block_size=4)

LAYOUTS = {
    "full": {},
    "sliding-causal": dict(layer_types=("sliding_attention", "sliding_attention"),
                           sliding_window=8),
    "mixed-noncausal": dict(layer_types=("sliding_attention", "full_attention"),
                            sliding_window=5, sliding_window_non_causal=True),
    "draft-vocab": dict(draft_vocab_size=40),
    "sample-from-anchor": dict(sample_from_anchor=True, block_size=5),
    "gqa-1-kv-head": dict(num_key_value_heads=1, rope_theta=10_000.0),
}
LOSSES = [("kl_div", "fixed-exp-decay"), ("ce", "dpace"), ('{"ce": 0.1, "tv": 0.9}', "dpace"),
          ("rkl", "fixed-exp-decay"), ("jsd", "fixed-exp-decay"), ("nla", "fixed-exp-decay"),
          ("lk_hybrid", "fixed-exp-decay")]


#: The cases' names, in the order :func:`cases` builds them.
CASE_NAMES = [f"{layout}-{j}" for layout in LAYOUTS for j in range(len(LOSSES))]


@functools.cache
def cases() -> list:
    """The cases, built once on first use (not at collection: ~40 drafters)."""
    cases = []
    for i, (layout, extra) in enumerate(LAYOUTS.items()):
        config = DFlashConfig(**{**BASE, **extra})
        for j, (loss, weighting) in enumerate(LOSSES):
            spec = LossSpec(loss=loss, weighting=weighting, gamma=4.0 if j % 2 else 2.5)
            cases.append(synthetic_case(f"{layout}-{j}", config, spec, seed=100 * i + j,
                                        seq_len=48, num_documents=1 + (i + j) % 3, pad=3,
                                        max_anchors=5))
    assert [c.name for c in cases] == CASE_NAMES
    return cases


@pytest.fixture(scope="module")
def both_sides(run_reference_cases):
    ref = run_reference_cases(cases())
    ours = {c.name: DrafterCandidate().run_case(c.config, c.loss, c.weights, c.inputs)
            for c in cases()}
    return ours, ref


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_training_quantity_matches_reference(name, both_sides):
    (case,) = [c for c in cases() if c.name == name]
    ours, ref = both_sides[0][case.name], both_sides[1][case.name]
    o, r = ours.tensors, ref.tensors
    supervised = r["aligned_loss_mask"][0].bool()
    assert supervised.any(), "a case without supervised slots tests nothing"

    torch.testing.assert_close(o["context"], r["context"], atol=ATOL, rtol=RTOL)
    for layer_type in set(case.config.effective_layer_types):
        assert torch.equal(o[f"mask.{layer_type}"], r[f"mask.{layer_type}"]), layer_type
    torch.testing.assert_close(o["aligned_loss_mask"], r["aligned_loss_mask"], atol=0, rtol=0)
    for key in ("targets", "logits"):
        torch.testing.assert_close(o[key][:, supervised], r[key][:, supervised],
                                   atol=ATOL, rtol=RTOL, msg=key)
    torch.testing.assert_close(o["loss"], r["loss"], atol=ATOL, rtol=RTOL)
    ref_weights = sorted(k for k in r if k.startswith("loss_weights."))
    assert ref_weights == sorted(k for k in o if k.startswith("loss_weights."))
    for key in ref_weights:
        torch.testing.assert_close(o[key][:, supervised], r[key][:, supervised],
                                   atol=ATOL, rtol=RTOL, msg=key)

    assert sorted(ours.trainable) == sorted(ref.trainable)
    for name in ref.trainable:
        g_ref, g_ours = r[f"grad.{name}"], o[f"grad.{name}"]
        scale = max(1.0, float(g_ref.abs().max()))
        torch.testing.assert_close(g_ours, g_ref, atol=ATOL * scale, rtol=1e-4, msg=name)

    for key, value in ref.metrics.items():
        assert ours.metrics[key] == pytest.approx(value, abs=ATOL, rel=RTOL), key


def test_structure_and_state_dict_keys_match_reference(both_sides):
    ours, ref = both_sides
    for case in cases():
        o, r = ours[case.name].structure, ref[case.name].structure
        assert ref[case.name].structure["load_missing_keys"] == []
        assert ref[case.name].structure["load_unexpected_keys"] == []
        for key in ("fc_in_features", "fc_out_features", "target_layer_ids", "block_size",
                    "mask_token_id", "layer_types", "sliding_window",
                    "sliding_window_non_causal", "sample_from_anchor", "state_dict"):
            assert o[key] == r[key], (case.name, key)
