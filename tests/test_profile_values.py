"""Profile values the frameworks need: weighting ``none``, loss ``ce-data``, target layers
``per-draft-layer`` and target layer id N, on our drafter and on the real reference (which
runs what it has instead, and says so)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from data_support import (
    SAMPLE_CONVERSATIONS,
    shared_conversations,
    shared_tiny_verifier,
    write_jsonl,
)

from dflash_audit.audit.case import Case
from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.checks import run_checks
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.loss import LossSpec, slot_weights
from dflash_audit.profile import Profile, ProfileError

pytestmark = pytest.mark.usefixtures("single_thread")


def _cases(**changes) -> list[Case]:
    profile = Profile.load("reference-model").replace(block_size=4, **changes)
    return [p.case for p in plan_synthetic_cases(profile, 2, seed=5)]


@pytest.fixture(scope="module")
def cases_and_reference(run_reference_cases):
    """Synthetic cases under weighting none and under loss ce-data, run by the real
    reference in one process."""
    none = _cases(weighting="none", loss="kl_div")
    data = _cases(loss="ce-data")
    for c in none:
        c.name = f"none-{c.name}"
    for c in data:
        c.name = f"cedata-{c.name}"
    ref = run_reference_cases(none + data)
    return none, data, ref


def test_weighting_none_gives_one_on_every_trained_slot():
    w = slot_weights(LossSpec("kl_div", "none"), torch.zeros(1, 8), torch.ones(1, 8), 4)
    assert w.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]]
    w = slot_weights(LossSpec("kl_div", "none"), torch.zeros(1, 4), torch.ones(1, 4), 4,
                     sample_from_anchor=True)
    assert w.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert Profile.load("reference-model").replace(weighting="none").weighting == "none"


def test_reference_runs_gamma_inf_for_none_and_says_so(cases_and_reference):
    none, _, ref = cases_and_reference
    for case in none:
        ours = DrafterCandidate().run_case(case.config, case.loss, case.weights,
                                           dict(case.inputs))
        r = ref[case.name]
        assert torch.equal(r.tensors["loss_weights.kl_div"], ours.tensors["loss_weights.kl_div"])
        assert "gamma = inf" in r.defaults["runs_instead"]["weighting"]
        results = {x.name: x for x in run_checks(case, ours, r)}
        assert results["loss"].status == "pass" and results["gradients"].status == "pass"
        assert results["defaults"].status == "warn"
        assert "no weighting 'none'" in results["defaults"].summary


def test_ce_data_trains_on_the_data_tokens():
    case = _cases(loss="ce-data")[0]
    out = DrafterCandidate().run_case(case.config, case.loss, case.weights, dict(case.inputs))
    a, B = case.inputs["anchor_positions"], case.config.block_size
    idx = (a[:, None] + torch.arange(B)).reshape(-1)
    labels = case.inputs["input_ids"][0, idx]
    assert torch.equal(out.tensors["target_ids"][0], labels)
    m = out.tensors["aligned_loss_mask"][0]
    w = out.tensors["loss_weights.ce-data"][0]
    ce = F.cross_entropy(out.tensors["logits"][0], labels, reduction="none")
    expected = (ce * m * w).sum() / (m.sum() + 1e-5)
    torch.testing.assert_close(out.tensors["loss"], expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ProfileError, match="drop draft_vocab_size"):
        Profile.load("reference-model").replace(loss="ce-data", draft_vocab_size=64)
    with pytest.raises(ProfileError, match="mixes 'ce' and 'ce-data'"):
        Profile.load("reference-model").replace(loss='{"ce": 0.5, "ce-data": 0.5}')


def test_ce_data_against_the_reference_names_the_data_tokens(cases_and_reference):
    _, data, ref = cases_and_reference
    for case in data:
        ours = DrafterCandidate().run_case(case.config, case.loss, case.weights,
                                           dict(case.inputs))
        r = ref[case.name]
        assert "loss_weights.ce-data" in r.tensors  # named by the profile's term
        assert "ran its 'ce' against the argmax" in r.defaults["runs_instead"]["loss"]
        results = {x.name: x for x in run_checks(case, ours, r)}
        # the tokens each slot is taught (target_ids) are the data tokens, not the reference's
        # argmax of the verifier: the targets check fails on them, the loss follows
        assert results["targets"].status == "fail" and results["loss"].status == "fail"
        from dflash_audit.audit.diagnose import diagnose

        diagnose(case, ours, r, list(results.values()))
        assert any(d.startswith("targets are the data tokens input_ids[a+s]")
                   for d in results["targets"].diagnosis), results["targets"].diagnosis
        assert any("targets are the data tokens input_ids[a+s]" in d
                   for d in results["loss"].diagnosis), results["loss"].diagnosis


def test_a_candidate_on_data_tokens_under_a_ce_profile_is_named(cases_and_reference,
                                                                run_reference_cases):
    _, data, _ = cases_and_reference
    case = dataclasses.replace(data[0], name="ce-profile", loss=LossSpec("ce"))
    r = run_reference_cases([case])[case.name]
    ours = DrafterCandidate().run_case(case.config, LossSpec("ce-data"), case.weights,
                                       dict(case.inputs))
    ours.tensors["loss_weights.ce"] = ours.tensors.pop("loss_weights.ce-data")
    results = run_checks(case, ours, r)
    from dflash_audit.audit.diagnose import diagnose

    diagnose(case, ours, r, results)
    loss = next(x for x in results if x.name == "loss")
    assert loss.status == "fail"
    assert any("targets are the data tokens" in d and "where the profile says 'ce'" in d
               for d in loss.diagnosis), loss.diagnosis


# ------------------------------------------------------------------------ target id N
def test_target_id_n_is_accepted_by_profile_and_layer_ids():
    from dflash_audit.model.layer_ids import resolve_target_layer_ids

    profile = Profile.load("reference-model").replace(target_layers=[2, 15, 30])
    assert profile.resolve_target_layer_ids(30) == [2, 15, 30]
    with pytest.raises(ProfileError, match=r"\[31\] do not exist .* \[0, 30\]"):
        profile.replace(target_layers=[2, 31]).resolve_target_layer_ids(30)
    assert resolve_target_layer_ids(30, "2,15,30") == [2, 15, 30]


@pytest.fixture(scope="module")
def tiny_verifier():
    return shared_tiny_verifier(layers=6)


def test_data_captures_id_n_as_the_pre_norm_last_layer(tiny_verifier, tmp_path):
    from typer.testing import CliRunner

    from dflash_audit.cli import app
    from dflash_audit.data.pipeline import load_batches

    chats = write_jsonl(tmp_path / "chats.jsonl", SAMPLE_CONVERSATIONS)
    out = tmp_path / "batches"
    result = CliRunner().invoke(app, ["data", "--verifier", str(tiny_verifier), "--data",
                                      str(chats), "--seq-len", "96", "--rows", "1", "--out",
                                      str(out), "--target-layers", "1,3,6"])
    assert result.exit_code == 0, result.output
    batch = load_batches(out)[0]
    assert batch.target_layer_ids == [1, 3, 6]
    H = batch.verifier_last_hidden_states.shape[-1]
    last = batch.hidden_states[..., 2 * H:]
    assert torch.equal(last, batch.verifier_last_hidden_states)
    assert not torch.equal(batch.hidden_states[..., H:2 * H], last)
    # HF's own switch: output_hidden_states[6] of a 6-layer model is AFTER the final norm;
    # id 6 is the residual stream before it, so normed once it gives HF's last entry
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier).float().eval()
    doc = batch.document_ids[0]
    n0 = int((doc == 0).sum())
    with torch.no_grad():
        hf = model(batch.input_ids[:, :n0], output_hidden_states=True).hidden_states[-1]
        normed = model.model.norm(last[:, :n0])
    torch.testing.assert_close(normed, hf, atol=1e-5, rtol=1e-5)
    # check-batches locates the id-N slice as layer 6 and passes the files
    audit = CliRunner().invoke(app, ["check-batches", str(out), "--verifier", str(tiny_verifier),
                                     "--out", str(tmp_path / "audit")])
    assert audit.exit_code == 0, audit.output


def test_compare_with_id_n_against_the_reference(tiny_verifier, tmp_path, reference_identity):
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.audit.options import CompareOptions

    chats = shared_conversations()  # fixed paths and the suite's cache: its reference records
    text = (Profile.load("reference-model").to_dict())
    text.update(target_layers=[1, 3, 6], name="id-n")
    text = {k: v for k, v in text.items() if v is not None and k != "source"}
    toml = tmp_path / "id-n.toml"
    toml.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in text.items()) + "\n")
    outcome = run_compare(CompareOptions(
        verifier=str(tiny_verifier), data=str(chats), seq_len=96, rows=1, anchors=6, cases=0,
        seed=0, out=tmp_path / "reports", progress=False, profile=str(toml)))
    assert outcome.exit_code == 0, [(r.case, r.name, r.summary) for r in
                                    outcome.report.results if r.status == "fail"]
    data = json.loads((outcome.folder / "report.json").read_text())
    assert data["inputs"]["target_layer_ids"] == [1, 3, 6]
    structure = next(r for c in data["cases"] for r in c["results"] if r["name"] == "structure")
    assert structure["reference"]["target_layer_ids"] == [1, 3, 6]
