"""The checks: unit tests on hand-perturbed outputs (no reference), and our drafter against
the real reference (speculators 0.9.0) on >= 200 hypothesis-generated cases in one process."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_audit.audit import checks
from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.checks import run_checks
from dflash_audit.audit.checks.context import check_context
from dflash_audit.audit.checks.defaults import check_defaults, diagnose_defaults
from dflash_audit.audit.checks.gradients import check_gradients
from dflash_audit.audit.checks.logits import check_logits
from dflash_audit.audit.checks.loss import check_loss, fit_decay
from dflash_audit.audit.checks.mask import check_masks
from dflash_audit.audit.checks.metrics import check_metrics, eal_definitions, eal_value
from dflash_audit.audit.checks.structure import check_structure
from dflash_audit.audit.checks.targets import check_targets
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.sides.anchor_draws import draw_anchors
from dflash_audit.audit.sides.run_sides import run_candidate
from dflash_audit.audit.slots import attended_positions
from dflash_audit.audit.tolerance import TOLERANCES, closeness, tolerance
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.config import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    DFlashConfig,
)
from dflash_audit.model.loss import LOSSES, WEIGHTINGS, LossSpec, exp_decay_weights
from dflash_audit.model.metrics import dflash_metrics

pytestmark = pytest.mark.usefixtures("single_thread")


CONFIG = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=2, vocab_size=96,
                      num_verifier_layers=6, target_layer_ids=(1, 3, 5), mask_token_id=95,
                      block_size=4, layer_types=(FULL_ATTENTION, SLIDING_ATTENTION),
                      sliding_window=6)


@functools.cache
def _case():
    """3 documents, padding, and one padding anchor (anchor_valid False) appended; built once,
    on first use (not at collection: its drafter imports transformers)."""
    case = synthetic_case("unit", CONFIG, LossSpec(), seed=11, seq_len=48, num_documents=3, pad=4,
                          max_anchors=5)
    case.inputs["anchor_positions"] = torch.cat([case.inputs["anchor_positions"],
                                                 torch.zeros(1, dtype=torch.long)])
    case.inputs["anchor_valid"] = torch.cat([case.inputs["anchor_valid"],
                                             torch.zeros(1, dtype=torch.bool)])
    return case

B = CONFIG.block_size


@pytest.fixture(scope="module")
def ours():
    """Our drafter's outputs: the "reference" of the unit tests (conformant, see below)."""
    cand = DrafterCandidate()
    out = cand.run_case(_case().config, _case().loss, _case().weights, _case().inputs)
    out.structure.update(verifier_norm="Qwen3RMSNorm", load_missing_keys=[],
                         load_unexpected_keys=[])
    out.tensors.update(draw_anchors(cand.select_anchors, _case()))  # as the harness adds them
    return out


def edited(side: SideOutputs, drop=(), **tensors) -> SideOutputs:
    """A deep copy of ``side`` with some tensors replaced (keys with dots: pass a dict)."""
    out = SideOutputs(tensors={k: v.clone() for k, v in side.tensors.items() if k not in drop},
                      metrics=dict(side.metrics), structure=copy.deepcopy(side.structure),
                      defaults=dict(side.defaults), trainable=list(side.trainable))
    out.tensors.update(tensors)
    return out


def supervised(side):
    return side.tensors["aligned_loss_mask"][0].bool()


# --------------------------------------------------------------------------- helpers
def test_tolerance_table_is_keyed_by_dtype():
    assert TOLERANCES[torch.float32] == {"atol": 1e-5, "rtol": 1e-5}
    assert TOLERANCES[torch.bfloat16]["rtol"] > TOLERANCES[torch.float16]["rtol"] > \
        TOLERANCES[torch.float32]["rtol"]
    assert tolerance(_case()) == {"atol": 1e-5, "rtol": 1e-5}


def test_closeness_reports_max_diffs_and_first_index():
    ref = torch.tensor([[1.0, 2.0, 4.0]])
    res = closeness(ref + torch.tensor([[0.0, 1e-6, 0.5]]), ref, atol=1e-5, rtol=1e-5)
    assert not res.ok and res.num_bad == 1 and res.first_bad == (0, 2)
    assert res.max_abs == pytest.approx(0.5) and res.max_rel == pytest.approx(0.125)
    nan = closeness(torch.tensor([float("nan"), 1.5]), torch.tensor([1.0, 1.0]), atol=1, rtol=1)
    assert not nan.ok and nan.num_bad == 1 and nan.first_bad == (0,)
    assert nan.num_non_finite == 1 and nan.max_abs == pytest.approx(0.5)  # finite pairs only
    assert nan.non_finite_text() == "1 non-finite (candidate NaN 1)"


@pytest.mark.parametrize("gamma", [2.5, 4.0, 7.0])
def test_fit_decay_recovers_gamma_and_formula(gamma):
    sup = torch.ones(3 * 6, dtype=torch.bool)
    fit = fit_decay(exp_decay_weights(6, gamma).repeat(3), sup, 6)
    assert fit["gamma"] == pytest.approx(gamma, rel=1e-5)
    assert fit["offset"] == pytest.approx(1.0, abs=1e-5) and fit["w0"] == 0.0
    assert fit["constant_per_slot"]
    shifted = fit_decay(exp_decay_weights(6, gamma, sample_from_anchor=True).repeat(3), sup, 6)
    assert shifted["offset"] == pytest.approx(0.0, abs=1e-5)  # exp(-s/g)


# --------------------------------------------------------------------------- identical
def test_identical_outputs_pass_every_check(ours):
    results = run_checks(_case(), ours, ours)
    assert [r.name for r in results] == ["protocol", "structure", "defaults", "mask", "mask",
                                         "context", "targets", "logits", "loss", "gradients",
                                         "metrics", "anchors"]
    assert {r.status for r in results} == {"pass"}, [(r.name, r.summary) for r in results]
    assert [r.details["layer_type"] for r in results if r.name == "mask"] == [
        FULL_ATTENTION, SLIDING_ATTENTION]


# ------------------------------------------------------------------------------ mask
def test_mask_difference_on_a_trained_row_fails_with_coordinates(ours):
    m = ours.tensors["mask.full_attention"].clone()
    q = int(supervised(ours).nonzero()[0])  # a supervised slot
    j, s = divmod(q, B)
    kv = int(_case().inputs["anchor_positions"][j])  # its anchor position: `<=` rule
    m[q, kv] = True
    full, sliding = check_masks(_case(), edited(ours, **{"mask.full_attention": m}), ours)
    assert full.status == "fail" and sliding.status == "pass"
    doc = int(_case().inputs["document_ids"][0, kv])
    assert full.first_diff == {"anchor": j, "anchor_position": kv, "slot": s, "position": kv + s,
                               "document": doc, "kv_position": kv, "kv_document": doc,
                               "layer_type": FULL_ATTENTION}
    assert full.details["extra_attention"] == 1 and full.details["missing_attention"] == 0
    assert (full.candidate, full.reference) == (True, False)


def test_mask_difference_on_an_untrained_block_passes(ours):
    m = ours.tensors["mask.sliding_attention"].clone()
    pad_block = _case().inputs["anchor_valid"].numel() - 1  # the padding anchor's block
    m[pad_block * B:, :] = ~m[pad_block * B:, :]
    _, sliding = check_masks(_case(), edited(ours, **{"mask.sliding_attention": m}), ours)
    assert sliding.status == "pass" and "cannot change training" in sliding.summary
    assert sliding.details["differing"] > 0 and sliding.details["differing_on_supervised_rows"] == 0


@pytest.mark.parametrize("change, cause", [
    ({"offset": B}, "context rule kv < anchor + block_size (reference: kv < anchor): each "
                    "block sees the verifier states of its own positions, the tokens it predicts "
                    "(a leak that never occurs at inference)"),
    ({"offset": 2}, "context rule kv < anchor + 2 (reference: kv < anchor): queries see the "
                    "verifier states of positions anchor..anchor+1, the tokens their block "
                    "predicts (a leak that never occurs at inference)"),
    ({"offset": -3}, "context rule kv < anchor - 3 (reference: kv < anchor): the 3 positions "
                     "before the anchor are hidden"),
    ({"blocks": "earlier"}, "queries also see the noise tokens of earlier blocks (a mask over all "
                            "Q noise positions, not per block; reference: own block only)"),
    ({"blocks": "all"}, "queries see the noise tokens of every block (no block rule; reference: "
                        "own block only)"),
])
def test_mask_leaks_are_named(ours, change, cause):
    """Any context offset kv < anchor + k is fitted from the candidate's mask and named (SpecForge
    issue 470: a block seeing its own positions' verifier states); noise tokens of other blocks
    visible are named."""
    from dflash_audit.audit.checks.mask import build_mask, expected_mask_hypothesis
    from dflash_audit.audit.diagnose import diagnose

    h = dataclasses.replace(expected_mask_hypothesis(_case(), FULL_ATTENTION), **change)
    cand = edited(ours, **{"mask.full_attention": build_mask(_case(), h)})
    results = check_masks(_case(), cand, ours)
    diagnose(_case(), cand, ours, results)
    assert [r.status for r in results] == ["fail", "pass"]
    assert results[0].diagnosis == [cause]
    expected = build_mask(_case(), expected_mask_hypothesis(_case(), FULL_ATTENTION))
    assert torch.equal(expected, ours.tensors["mask.full_attention"])  # the rebuild is exact


def test_missing_or_float_masks(ours):
    missing = check_masks(_case(), edited(ours, drop=("mask.full_attention",)), ours)
    assert [r.status for r in missing] == ["warn", "pass"]
    assert missing[0].summary.startswith("not provided")
    additive = torch.zeros_like(ours.tensors["mask.full_attention"], dtype=torch.float32)
    additive[~ours.tensors["mask.full_attention"]] = float("-inf")
    float_mask = check_masks(_case(), edited(ours, **{"mask.full_attention": additive[None, None]}),
                             ours)
    assert [r.status for r in float_mask] == ["pass", "pass"]


# --------------------------------------------------------------------- float tensors
def test_logits_compared_only_on_supervised_slots(ours):
    sup = supervised(ours)
    logits = ours.tensors["logits"].clone()
    logits[0, ~sup] += 5.0
    assert check_logits(_case(), edited(ours, logits=logits), ours).status == "pass"
    q = int(sup.nonzero()[2])
    logits[0, q, 7] += 1e-3
    res = check_logits(_case(), edited(ours, logits=logits), ours)
    assert res.status == "fail" and res.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    j, s = divmod(q, B)
    assert res.first_diff["anchor"] == j and res.first_diff["slot"] == s
    assert res.first_diff["vocab"] == 7 and res.details["num_bad"] == 1
    assert res.tolerance == {"atol": 1e-5, "rtol": 1e-5}


def test_tiny_noise_within_tolerance_passes(ours):
    noise = 1 + 1e-7 * torch.randn(ours.tensors["targets"].shape,
                                   generator=torch.Generator().manual_seed(0))
    res = check_targets(_case(), edited(ours, targets=ours.tensors["targets"] * noise), ours)
    assert res.status == "pass" and 0 < res.max_abs_diff < 1e-5


def test_shape_mismatch_and_missing_tensors(ours):
    short = ours.tensors["targets"][..., :50]
    res = check_targets(_case(), edited(ours, targets=short), ours)
    assert res.status == "fail" and res.candidate == [1, 24, 50] and res.reference == [1, 24, 96]
    res = check_logits(_case(), edited(ours, drop=("logits",)), ours)
    assert res.status == "warn" and res.summary.startswith("not provided")


def test_context_compared_on_attended_positions_only(ours):
    ctx = ours.tensors["context"].clone()
    pad = (_case().inputs["document_ids"][0] == -1).nonzero().squeeze(-1)
    ctx[0, pad] = float("nan")  # padding is never attended
    assert check_context(_case(), edited(ours, context=ctx), ours).status == "pass"
    doc = _case().inputs["document_ids"][0]
    seen = attended_positions(_case(), ours)
    p = int(seen.nonzero()[0])
    ctx[0, p, 3] += 0.1
    res = check_context(_case(), edited(ours, context=ctx), ours)
    assert res.status == "fail"
    assert res.first_diff == {"position": p, "document": int(doc[p]), "feature": 3}


# --------------------------------------------------------------------------------- loss
def test_loss_weights_report_implied_gamma(ours):
    w7 = exp_decay_weights(B, 7.0).repeat(ours.tensors["loss_weights.kl_div"].numel() // B)[None]
    res = check_loss(_case(), edited(ours, **{"loss_weights.kl_div": w7}), ours)
    assert res.status == "fail"
    assert res.details["implied_gamma"]["kl_div"]["candidate"] == pytest.approx(7.0, rel=1e-5)
    assert res.details["implied_gamma"]["kl_div"]["reference"] == pytest.approx(4.0, rel=1e-5)
    assert "implied gamma: candidate 7, reference 4" in res.summary


def test_loss_total_and_aligned_mask(ours):
    res = check_loss(_case(), edited(ours, loss=ours.tensors["loss"] * 1.01), ours)
    assert res.status == "fail" and res.max_rel_diff == pytest.approx(0.01, rel=1e-3)
    m = ours.tensors["aligned_loss_mask"].clone()
    m[0, 0] = 1.0  # slot 0 of anchor 0 trained
    res = check_loss(_case(), edited(ours, aligned_loss_mask=m), ours)
    assert res.status == "fail" and res.first_diff["slot"] == 0 and res.first_diff["anchor"] == 0
    res = check_loss(_case(), edited(ours, drop=("loss_weights.kl_div",)), ours)
    assert res.status == "warn"


# ---------------------------------------------------------------------------- gradients
def test_gradients_relative_tolerance_and_named_parameter(ours):
    g = ours.tensors["grad.layers.1.mlp.up_proj.weight"]
    scale = float(g.abs().max())
    tiny = edited(ours, **{"grad.layers.1.mlp.up_proj.weight": g + 1e-6 * scale})
    assert check_gradients(_case(), tiny, ours).status == "pass"
    big = g.clone()
    big[2, 3] += 0.5 * scale
    res = check_gradients(_case(), edited(ours, **{"grad.layers.1.mlp.up_proj.weight": big}), ours)
    assert res.status == "fail"
    assert res.first_diff["parameter"] == "layers.1.mlp.up_proj.weight"
    assert res.first_diff["index"] == [2, 3]
    assert res.details["failing"] == ["layers.1.mlp.up_proj.weight"]


def test_missing_and_frozen_gradients(ours):
    res = check_gradients(_case(), edited(ours, drop=("grad.fc.weight",)), ours)
    assert res.status == "fail" and "fc.weight: no gradient on the candidate side" in res.summary
    frozen = edited(ours, **{"grad.embed_tokens.weight": torch.ones(96, 32)})
    res = check_gradients(_case(), frozen, ours)
    assert res.status == "fail" and res.details["failing"] == ["embed_tokens.weight"]
    none = edited(ours, drop=[k for k in ours.tensors if k.startswith("grad.")])
    none.trainable = []
    assert check_gradients(_case(), none, ours).status == "warn"


# ---------------------------------------------------------------------------- structure
def test_structure_one_sided_fields_ignored_and_profile_checked(ours):
    cand = edited(ours)
    for key in ("verifier_norm", "load_missing_keys", "load_unexpected_keys"):
        cand.structure.pop(key)
    assert check_structure(_case(), cand, ours).status == "pass"
    cand.structure["fc_in_features"] = 64
    cand.structure["state_dict"]["fc.weight"]["shape"] = [32, 64]
    res = check_structure(_case(), cand, ours)
    assert res.status == "fail"
    fields = {f["field"] for f in res.details["findings"]}
    assert {"fc_in_features", "state_dict.fc.weight.shape"} <= fields
    profile = [f for f in res.details["findings"] if "profile" in f]
    assert profile[0]["profile"] == 96 and profile[0]["candidate"] == 64


def test_structure_warnings_and_failures(ours):
    cand = edited(ours)
    cand.structure["state_dict"]["embed_tokens.weight"]["dtype"] = "bfloat16"  # frozen
    assert check_structure(_case(), cand, ours).status == "warn"
    cand.structure["state_dict"]["norm.weight"]["dtype"] = "bfloat16"  # trained, no master copy
    res = check_structure(_case(), cand, ours)
    assert res.status == "fail" and res.summary == (
        "1 fail: 'norm.weight' is trained in bfloat16 with no float32 master copy reported (the "
        "reference trains float32 weights)")
    cand.structure["master_weights"] = {"norm.weight": "float32"}  # its optimizer keeps one
    assert check_structure(_case(), cand, ours).status == "warn"
    cand = edited(ours)
    cand.structure["state_dict"]["embed_tokens.weight"]["trainable"] = True
    res = check_structure(_case(), cand, ours)
    assert res.status == "fail" and "trained on the candidate side" in res.summary
    ref = edited(ours)
    ref.structure["load_missing_keys"] = ["hidden_norm.weight"]
    res = check_structure(_case(), edited(ours), ref)
    assert res.status == "fail" and "did not fill reference parameter" in res.summary
    empty = edited(ours)
    empty.structure = {}
    assert check_structure(_case(), empty, ours).status == "warn"
    extra = edited(ours)  # a field the reference does not report: nothing to compare it with
    extra.structure["implementation"] = "my-dflash 0.1"
    res = check_structure(_case(), extra, ours)
    assert res.status == "warn" and res.details["findings"] == [
        {"field": "implementation", "candidate": "my-dflash 0.1", "reference": None,
         "status": "warn", "reason": "implementation reported only by the candidate"}]


def test_structure_window_ignored_without_sliding_layers(ours):
    full = dataclasses.replace(_case(),
                               config=CONFIG.replace(layer_types=None, sliding_window=None))
    cand, ref = edited(ours), edited(ours)
    for side, w in ((cand, 5), (ref, None)):
        side.structure.update(layer_types=[FULL_ATTENTION] * 2, sliding_window=w,
                              sliding_window_non_causal=w is not None)
    assert check_structure(full, cand, ref).status == "pass"


# ----------------------------------------------------------------------- defaults, metrics
def test_defaults_report_each_side_and_never_fail(ours):
    ref = edited(ours)
    ref.defaults = {"gamma": 4.0, "block_size": 8, "max_anchors": 512,
                    "per_position_loss_weight": "fixed-exp-decay",
                    "loss_when_unset": "kl_div (fused)"}
    res = check_defaults(_case(), ours, ref)
    assert res.status == "pass"
    assert res.details["fields"]["block_size"] == {"profile": 4, "candidate_default": 8,
                                                   "reference_default": 8}
    cand = edited(ours)
    cand.defaults = {"gamma": 7.0, "loss": "kl_div"}
    res = check_defaults(_case(), cand, ref)
    assert res.status == "warn" and "gamma: candidate 7.0, reference 4.0" in res.summary
    # 4 and 4.0 are one default: the diagnosis names only the gamma that differs in value
    cand.defaults = {"gamma": 7.0, "block_size": 8.0, "max_anchors": 512}
    res = check_defaults(_case(), cand, ref)
    assert diagnose_defaults(Evidence(_case(), cand, ref), res) == [
        "the candidate's default gamma 7.0 differs from the reference's 4.0: a run without an "
        "explicit profile would train differently"]


def test_metrics_eal_definition_difference_warns_naming_both(ours):
    cand = edited(ours)
    cand.metrics.update(eal_sum=ours.metrics["eal_product"], eal_total=1.0)
    res = check_metrics(_case(), cand, ours)
    assert res.status == "warn"
    assert res.details["eal"]["reference_definition"] == ["leading-run"]
    assert res.details["eal"]["candidate_definition"] == ["product-of-marginals"]
    assert "'product-of-marginals'" in res.summary and "'leading-run'" in res.summary
    res = check_metrics(_case(), ours, ours)
    assert res.status == "pass" and "leading-run" in res.summary


def test_metric_value_difference_warns_and_missing_metrics(ours):
    cand = edited(ours)
    cand.metrics["position_2_acc_sum"] += 1
    res = check_metrics(_case(), cand, ours)
    assert res.status == "warn" and res.first_diff["metric"] == "position_2_acc_sum"
    none = edited(ours)
    none.metrics = {}
    assert check_metrics(_case(), none, ours).summary.startswith("not provided")


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_metrics_over_the_other_slot_range_are_named(ours, sample_from_anchor):
    """speculators PR 760 review: accuracy / EAL that skip slot 0 under sample_from_anchor (or
    count it without) warn, naming the slot range, not "computed differently"."""
    from dflash_audit.audit.diagnose import diagnose

    case = dataclasses.replace(
        _case(), config=CONFIG.replace(sample_from_anchor=sample_from_anchor))
    mask = ours.tensors["aligned_loss_mask"].clone()
    mask.view(-1, B)[:, 0] = 1.0  # slot 0 supervised, as the anchor slot under sample_from_anchor
    ref, cand = edited(ours, aligned_loss_mask=mask), edited(ours, aligned_loss_mask=mask)
    t = ref.tensors
    ref.metrics = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"], B,
                                 sample_from_anchor)
    cand.metrics = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"], B,
                                  not sample_from_anchor)
    res = check_metrics(case, cand, ref)
    diagnose(case, cand, ref, [res])
    assert res.status == "warn"
    skipped, counted = ("1", "0") if sample_from_anchor else ("0", "1")
    assert res.diagnosis == [
        f"accuracy and acceptance metrics computed over slots {skipped}..B-1 where the reference "
        f"counts slots {counted}..B-1 (sample_from_anchor={sample_from_anchor}: the anchor slot "
        f"is {'' if sample_from_anchor else 'not '}a draft prediction; speculators PR 760)"]


def test_a_candidate_with_almost_no_outputs_fails_the_protocol_not_crashes(ours):
    from dflash_audit.audit.diagnose import diagnose

    cand = SideOutputs({"logits": ours.tensors["logits"]}, {"eal": 1.0},
                       {"fc_in_features": 96})
    results = run_checks(_case(), cand, ours)
    diagnose(_case(), cand, ours, results)
    status = {(r.name, r.details.get("layer_type")): r.status for r in results}
    # the outputs it left out cannot be compared: that fails the gate (protocol), once
    protocol = next(r for r in results if r.name == "protocol")
    assert status.pop(("protocol", None)) == "fail"
    assert "candidate returned no context" in protocol.summary
    assert "no gradients" in " ".join(f["message"] for f in protocol.details["findings"])
    assert status.pop(("logits", None)) == "pass" and status.pop(("defaults", None)) == "pass"
    assert set(status.values()) == {"warn"}, status
    assert all("could not run" not in r.summary and not r.diagnosis for r in results
               if r.name not in ("metrics", "protocol"))
    metrics = next(r for r in results if r.name == "metrics")
    assert "not provided by the candidate: full_acc_sum" in metrics.summary


def test_a_crashing_check_becomes_a_failure(ours, monkeypatch):
    def boom(case, cand, ref):
        raise RuntimeError("bad output")

    monkeypatch.setattr(checks, "CHECKS", (("logits", boom),) + checks.CHECKS[-1:])
    res = run_checks(_case(), ours, ours)
    assert (res[0].name, res[0].status) == ("logits", "fail")
    assert "RuntimeError: bad output" in res[0].summary and res[1].status == "pass"


# ------------------------------------------------ our drafter vs the real reference, >= 200 cases
MIXES = [*LOSSES, '{"ce": 0.3, "kl_div": 0.7}']


@st.composite
def generated_case_params(draw):
    """A tiny config, batch layout and loss: H <= 32, T <= 64."""
    heads, kv = draw(st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 1)]))
    layers = draw(st.integers(1, 2))
    N = draw(st.integers(3, 8))
    n = draw(st.integers(1, 4))
    layout = draw(st.lists(st.sampled_from(LAYER_TYPES), min_size=layers, max_size=layers))
    vocab = draw(st.sampled_from([32, 64]))
    T = draw(st.integers(16, 64))
    return dict(
        hidden_size=draw(st.sampled_from([16, 32])), heads=heads, kv=kv, layers=layers, N=N,
        ids=sorted(draw(st.sets(st.integers(0, N), min_size=n, max_size=n))),
        block_size=draw(st.integers(2, 6)), layout=layout,
        window=draw(st.integers(1, 24)) if SLIDING_ATTENTION in layout else None,
        non_causal=draw(st.booleans()), vocab=vocab,
        draft_vocab=draw(st.one_of(st.none(), st.integers(4, vocab - 1))),
        sample_from_anchor=draw(st.booleans()), T=T, docs=draw(st.integers(1, 4)),
        pad=draw(st.integers(0, 6)), anchors=draw(st.integers(1, 8)),
        loss=draw(st.sampled_from(MIXES)), weighting=draw(st.sampled_from(WEIGHTINGS)),
        gamma=draw(st.sampled_from([1.5, 4.0, 7.0])), seed=draw(st.integers(0, 2**20)))


def generated_case(i: int, p: dict):
    config = DFlashConfig(
        hidden_size=p["hidden_size"], intermediate_size=2 * p["hidden_size"],
        num_attention_heads=p["heads"], num_key_value_heads=p["kv"], head_dim=8,
        num_hidden_layers=p["layers"], vocab_size=p["vocab"], num_verifier_layers=p["N"],
        target_layer_ids=p["ids"], mask_token_id=p["vocab"] - 1, block_size=p["block_size"],
        draft_vocab_size=p["draft_vocab"], layer_types=p["layout"], sliding_window=p["window"],
        sliding_window_non_causal=p["non_causal"], sample_from_anchor=p["sample_from_anchor"])
    spec = LossSpec(loss=p["loss"], weighting=p["weighting"], gamma=p["gamma"])
    return synthetic_case(f"gen{i:03d}", config, spec, seed=p["seed"], seq_len=p["T"],
                          num_documents=p["docs"], pad=p["pad"], max_anchors=p["anchors"])


@pytest.mark.reference
def test_our_drafter_passes_200_generated_cases_against_the_reference(run_reference_cases):
    params: list[dict] = []

    @settings(max_examples=220, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(generated_case_params())
    def collect(p):
        if p not in params:
            params.append(p)

    collect()
    cases = [generated_case(i, p) for i, p in enumerate(params)]
    assert len(cases) >= 200
    refs = run_reference_cases(cases)
    failures, with_supervision = [], 0
    for case, p in zip(cases, params, strict=True):
        ours, _ = run_candidate(DrafterCandidate(), case)  # the harness's path, anchors too
        results = run_checks(case, ours, refs[case.name])
        with_supervision += bool(refs[case.name].tensors["aligned_loss_mask"].any())
        # weighting "none": the reference has none and runs gamma = inf, which the defaults
        # check says (warn); every other check must pass
        bad = [(r.name, r.status, r.summary) for r in results if r.status != "pass" and not (
            p["weighting"] == "none" and r.name == "defaults" and r.status == "warn"
            and r.summary.startswith("weighting: the reference has no weighting 'none'"))]
        if bad:
            failures.append((case.name, p, bad))
    assert not failures, failures[:3]
    assert with_supervision >= 150  # most cases train on something
    layouts = {tuple(sorted(set(p["layout"]))) for p in params}
    assert len(layouts) == 3 and any(p["draft_vocab"] for p in params)
    assert any(p["sample_from_anchor"] for p in params) and any(
        p["anchors"] * p["block_size"] >= p["T"] for p in params)


def test_metric_helper_matches_dflash_metrics(ours):
    """eal_definitions recomputes with dflash_metrics: the leading-run value is ours."""
    t = ours.tensors
    m = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"], B)
    assert eal_value(ours.metrics) == pytest.approx(m["eal_sum"] / m["eal_total"])
    assert "leading-run" in eal_definitions(ours, _case())


def test_all_finite_is_the_elementwise_test_in_one_sum():
    import torch

    from dflash_audit.audit.tolerance import all_finite, closeness

    big = torch.full((4,), 3e38)  # finite values whose sum overflows: still finite
    assert all_finite(big) and all_finite(torch.zeros(0)) and all_finite(torch.arange(5))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            t = torch.ones(1000, dtype=dtype)
            t[517] = bad
            assert not all_finite(t), (bad, dtype)
    mixed = torch.tensor([float("inf"), float("-inf")])  # the sum is NaN, not inf
    assert not all_finite(mixed)
    c = closeness(torch.tensor([1.0, float("nan"), 3e38, 3e38]),
                  torch.tensor([1.0, 2.0, 3e38, 3e38]), 1e-5, 1e-5)
    assert c.num_non_finite == 1 and c.non_finite == {"candidate NaN": 1, "candidate inf": 0,
                                                      "reference NaN": 0, "reference inf": 0}
