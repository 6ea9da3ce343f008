"""Output protocol validation and non-finite findings (dflash_audit.audit.protocol)."""

import copy
import math

import pytest
import torch

from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.protocol import (
    OUTPUT_SPEC,
    case_dims,
    non_finite_findings,
    output_findings,
    required_keys,
    validate_outputs,
)
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.profile import Profile


@pytest.fixture(scope="module")
def good():
    base = plan_synthetic_cases(Profile.load("reference-model"), 1, seed=8)[0].case
    case = synthetic_case("tiny", base.config.replace(block_size=4), base.loss, seed=3,
                          seq_len=40, max_anchors=5)
    out = DrafterCandidate().run_case(case.config, case.loss, case.weights,
                                      {k: v.clone() for k, v in case.inputs.items()})
    return case, out


def changed(out, **tensors):
    new = copy.copy(out)
    new.tensors = {**out.tensors, **tensors}
    new.metrics = dict(out.metrics)
    return new


def messages(findings):
    return [f.message for f in findings]


def test_our_drafter_conforms(good):
    case, out = good
    assert output_findings(out, case, "candidate") == []
    dims = case_dims(case)
    assert (dims["Q"], dims["T+Q"], dims["V_d"]) == (20, 60, 128)
    assert required_keys(case) == ["context", "mask.full_attention", "targets", "logits",
                                   "aligned_loss_mask", "loss", "loss_weights.kl_div"]
    assert len({s.key for s in OUTPUT_SPEC}) == len(OUTPUT_SPEC)


def test_int64_mask_is_named_not_read_as_additive(good):
    case, out = good
    bad = changed(out, **{"mask.full_attention": out.tensors["mask.full_attention"].long()})
    assert messages(validate_outputs(bad, case)) == [
        "candidate masks['full_attention'] is int64 0/1; expected bool, True = attend"]


def test_additive_float_mask(good):
    case, out = good
    m = out.tensors["mask.full_attention"]
    additive = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    f = validate_outputs(changed(out, **{"mask.full_attention": additive}), case)
    assert messages(f) == [("candidate masks['full_attention'] is float32 additive (0 = attend, "
                           "-inf = blocked); expected bool, True = attend")]
    assert non_finite_findings(changed(out, **{"mask.full_attention": additive}), case) == []


def test_float16_logits_name_the_dtype(good):
    case, out = good
    f = validate_outputs(changed(out, logits=out.tensors["logits"].half()), case)
    assert messages(f) == ["candidate logits is float16; expected float32 (the case dtype)"]
    assert f[0].status == "fail" and f[0].to_check_result("tiny").name == "protocol"


def test_wrong_shapes(good):
    case, out = good
    f = validate_outputs(changed(out, logits=out.tensors["logits"][:, :-1],
                                 **{"grad.fc.weight": out.tensors["grad.fc.weight"].t()}), case)
    assert messages(f) == [
        "candidate logits has shape [1, 19, 128]; expected [1, Q, V_d] = [1, 20, 128]",
        ("candidate gradients['fc.weight'] has shape [96, 32]; expected [32, 96] (the "
        "parameter's shape)")]


def test_missing_keys_and_non_tensors(good):
    case, out = good
    bad = changed(out, context=[1.0, 2.0])
    del bad.tensors["logits"], bad.tensors["mask.full_attention"]
    bad.metrics["eal_sum"] = "tensor(3.)"
    f = validate_outputs(bad, case)
    assert messages(f) == [
        ("candidate returned no masks['full_attention']; expected [Q, T+Q] = [20, 60] bool, "
        "True = attend: attention mask of that layer type, True = attend"),
        ("candidate returned no logits; expected [1, Q, V_d] = [1, 20, 128] float32 (the case "
        "dtype): draft logits per slot"),
        "candidate context is a list; expected a torch.Tensor",
        ("candidate metrics: 1 value(s) are not numbers (first 'eal_sum' = 'tensor(3.)'); "
        "expected float")]
    assert [x.status for x in f] == ["fail", "fail", "fail", "fail"]  # missing cannot pass


def test_missing_loss_weights_of_another_term_warns_and_no_metrics_fail(good):
    case, out = good
    other = changed(out)
    other.tensors["loss_weights.rkl"] = other.tensors.pop("loss_weights.kl_div")
    assert [(x.key, x.status) for x in validate_outputs(other, case)] == [
        ("loss_weights.kl_div", "warn")]  # the loss check names the other loss
    none = changed(out)
    del none.tensors["loss_weights.kl_div"]
    none.metrics = {}
    assert [(x.key, x.status) for x in validate_outputs(none, case)] == [
        ("loss_weights.kl_div", "fail"), ("metrics", "fail")]


def test_aligned_loss_mask_values(good):
    case, out = good
    alm = out.tensors["aligned_loss_mask"].clone()
    q = int(alm[0].nonzero()[0])
    alm[0, q] = 0.5
    f = validate_outputs(changed(out, aligned_loss_mask=alm), case)
    assert len(f) == 1 and f[0].count == 1
    assert f[0].message.startswith("candidate aligned_loss_mask holds 1 values other than 0/1 "
                                   f"(first 0.5 at anchor {q // 4} slot {q % 4}")
    assert validate_outputs(changed(out, aligned_loss_mask=alm.bool()), case) == []


def test_nan_logits_counted_with_reference_coordinates(good):
    case, out = good
    logits = out.tensors["logits"].clone()
    logits[0, 14, 5:17] = float("nan")  # anchor 3 slot 2 (block size 4)
    logits[0, 19, 0] = float("inf")
    f = non_finite_findings(changed(out, logits=logits), case)
    assert len(f) == 1 and f[0].count == 13
    assert f[0].first["anchor"] == 3 and f[0].first["slot"] == 2 and f[0].first["vocab"] == 5
    assert f[0].message.startswith("candidate logits: 13 non-finite values (12 NaN, 1 inf) of "
                                   "2560, first at anchor 3 slot 2 (position ")


def test_all_nan_floats_and_metrics(good):
    case, out = good
    nan = {k: torch.full_like(v, float("nan")) for k, v in out.tensors.items()
           if v.is_floating_point()}
    bad = changed(out, **nan)
    bad.metrics = {k: float("nan") for k in out.metrics}
    f = non_finite_findings(bad, case, side="reference")
    by_key = {x.key: x for x in f}
    assert set(by_key) == {"context", "targets", "logits", "aligned_loss_mask", "loss",
                           "loss_weights.kl_div", "gradients", "metrics"}
    assert by_key["context"].message == ("reference context: 1280 non-finite values (1280 NaN) "
                                         "of 1280, first at position 0 document 0 feature 0")
    assert by_key["loss"].message == "reference loss: 1 non-finite values (1 NaN) of 1"
    n_grads = sum(1 for k in out.tensors if k.startswith("grad."))
    n_values = sum(v.numel() for k, v in out.tensors.items() if k.startswith("grad."))
    assert by_key["gradients"].message.startswith(
        f"reference gradients: {n_values} non-finite values ({n_values} NaN) in {n_grads} of "
        f"{n_grads} parameters, first in ")
    assert by_key["metrics"].count == len(out.metrics)
    assert math.isnan(bad.metrics["eal_sum"])
    assert by_key["metrics"].message.startswith(f"reference metrics: {len(out.metrics)} "
                                                f"non-finite values of {len(out.metrics)}, first")


# Where NaN slipped through the comparison before issue 9 (dflash_audit.audit.checks): NaN
# never compares as equal, within tolerance or as "no gradient".
def _nan_variant(out, metrics=False, frozen_grad=False):
    bad = changed(out)
    if metrics:
        bad.metrics = {k: float("nan") for k in out.metrics}
    if frozen_grad:
        bad.tensors["grad.verifier_lm_head.weight"] = torch.full((128, 32), float("nan"))
    return bad


def test_nan_metrics_do_not_pass(good):
    from dflash_audit.audit.checks.metrics import check_metrics

    case, out = good
    result = check_metrics(case, _nan_variant(out, metrics=True), out)
    assert result.status == "fail" and "nan" in result.summary


def test_nan_gradient_of_a_frozen_parameter_does_not_pass(good):
    from dflash_audit.audit.checks.gradients import check_gradients

    case, out = good
    assert check_gradients(case, _nan_variant(out, frozen_grad=True), out).status != "pass"


def test_the_real_reference_conforms(run_reference_cases):
    """The protocol is the reference's own output format: its outputs on the synthetic
    layouts (full, sliding, mixed) have no protocol or non-finite findings."""
    planned = plan_synthetic_cases(Profile.load("reference-model"), 3, seed=8)
    cases = [p.case for p in planned]
    refs = run_reference_cases(cases)
    for case in cases:
        assert output_findings(refs[case.name], case, "reference") == [], case.name


def test_run_checks_reports_protocol_first_and_does_not_compare_misread_keys(good):
    """An int64 0/1 mask and float16 logits: one failing ``protocol`` result (first) names
    both; the mask and logits checks say "not compared" instead of "differ at N entries"."""
    from dflash_audit.audit.checks import run_checks

    case, out = good
    bad = changed(out, **{"mask.full_attention": out.tensors["mask.full_attention"].long(),
                          "logits": out.tensors["logits"].half()})
    results = run_checks(case, bad, out)
    assert results[0].name == "protocol" and results[0].status == "fail"
    assert "int64 0/1" in results[0].summary and "float16" in results[0].summary
    by_name = {r.name: r for r in results}
    assert by_name["mask"].status == "warn" and by_name["mask"].summary.startswith(
        "not compared: masks['full_attention']")
    assert by_name["logits"].summary.startswith("not compared: logits")
    assert by_name["targets"].status == "pass"
    clean = run_checks(case, out, out)
    assert clean[0].name == "protocol" and clean[0].status == "pass"


def test_as_bool_mask_reads_int_masks_as_0_1(good):
    from dflash_audit.audit.slots import as_bool_mask

    _, out = good
    m = out.tensors["mask.full_attention"]
    assert torch.equal(as_bool_mask(m.long()), m)
    assert torch.equal(as_bool_mask(m.float()), m)  # float 0/1 with some 1: 0/1
    additive = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    assert torch.equal(as_bool_mask(additive), m)


def test_all_nan_outputs_are_named_as_nan(good):
    """All float outputs NaN: the comparison says NaN with a count and a finite max (0 over
    no finite pair), never "max abs inf"."""
    from dflash_audit.audit.checks.logits import check_logits

    case, out = good
    nan = {k: torch.full_like(v, float("nan")) for k, v in out.tensors.items()
           if v.is_floating_point() and not k.startswith("mask.")}
    result = check_logits(case, changed(out, **nan), out)
    assert result.status == "fail"
    assert "non-finite (candidate NaN" in result.summary and "inf" not in result.summary.split(
        "non-finite")[0]
    assert result.details["num_non_finite"] == result.details["num_compared"] > 0
    assert result.max_abs_diff == 0.0


def test_nan_in_the_aligned_loss_mask_fails(good):
    from dflash_audit.audit.checks.loss import check_loss

    case, out = good
    m = out.tensors["aligned_loss_mask"].float().clone()
    m[0, 0] = float("nan")
    result = check_loss(case, changed(out, aligned_loss_mask=m), out)
    assert result.status == "fail" and "non-finite" in result.summary


@pytest.mark.parametrize("value, shown", [("0.0068", "\"'0.0068'\""), (True, "'True'"),
                                          (torch.tensor([0.5, 0.5]), "'tensor([0.5000, 0.5000])'")])
def test_metrics_that_are_not_numbers_survive_the_file_round_trip(good, tmp_path, value, shown):
    """A metric written as a string, a bool or a 2-element tensor is not turned into a float by
    ``SideOutputs.write``: it reaches the protocol check as its repr and fails there."""
    case, out = good
    bad = changed(out)
    bad.metrics["acc_0"] = value
    bad.write(tmp_path)
    loaded = SideOutputs.read(tmp_path)
    assert loaded.metrics["acc_0"] == eval(shown)  # the repr, a str
    assert messages(f for f in validate_outputs(loaded, case) if f.key == "metrics") == [
        f"candidate metrics: 1 value(s) are not numbers (first 'acc_0' = {shown}); "
        "expected float"]
    good_copy = changed(out)
    good_copy.metrics["acc_0"] = torch.tensor(0.25, dtype=torch.float64)
    good_copy.write(tmp_path)
    assert SideOutputs.read(tmp_path).metrics["acc_0"] == 0.25


def test_outputs_outside_the_protocol_warn_and_are_bounded():
    """An output key the protocol does not know is a protocol warning (ignored); past 16 MiB
    of them, a failure."""
    import torch as _torch

    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.audit.protocol import MAX_EXTRA_OUTPUT_BYTES, extra_output_finding

    out = SideOutputs(tensors={"loss": _torch.zeros(()), "my_debug": _torch.zeros(3, 4)},
                      metrics={}, structure={})
    finding = extra_output_finding(out, "candidate")
    assert finding.status == "warn" and "'my_debug' [3, 4]" in finding.message
    out.tensors["huge"] = _torch.zeros(MAX_EXTRA_OUTPUT_BYTES // 4 + 1)
    assert extra_output_finding(out, "candidate").status == "fail"
    assert extra_output_finding(SideOutputs({"loss": _torch.zeros(())}, {}, {}), "x") is None
