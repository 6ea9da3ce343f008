"""Framework audits end to end against the real reference (speculators 0.9.0):

- the speculators adapter's self-test: ``framework:speculators==0.9.0`` against the reference
  0.9.0 passes with nothing but passes (the adapter adds nothing), and
  ``framework:speculators@v0.9.0`` from a local git clone against ``--ref path:`` too;
- an adapter in development (``$DFLASH_AUDIT_ADAPTER_PATH``) whose framework is installed from
  a real wheel into the tool's cache, with a declared adapter-computed loss and capabilities
  (one document per row, three verifier families): the loss check says so without failing,
  every case is one the framework supports, every report format shows it;
- hard labels (``target_ids``): the data tokens named, the verifier's argmax passing.

One compare per scenario (module-scoped) shared by the assertions."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from cache_support import copy_of_cache, release_repo
from data_support import make_tiny_verifier, shared_conversations
from framework_support import build_wheel, write_adapter
from session_share import once_per_run
from typer.testing import CliRunner

from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.compare import run_compare
from dflash_audit.audit.frameworks import registry
from dflash_audit.audit.hard_labels import DATA_TOKENS_CAUSE, data_tokens
from dflash_audit.audit.judge import check_case
from dflash_audit.audit.options import CompareOptions
from dflash_audit.audit.result import is_downstream
from dflash_audit.audit.sides.run_sides import run_candidate
from dflash_audit.candidate import DrafterCandidate, side_outputs
from dflash_audit.cli import app
from dflash_audit.model.loss import LossSpec
from dflash_audit.profile import Profile

pytestmark = pytest.mark.reference


def _statuses(report) -> set[tuple[str, str]]:
    return {(r.name, r.status) for r in report.results}


# ------------------------------------------------------------- speculators self-test
@pytest.fixture(scope="module")
def self_test(tmp_path_factory):
    """framework:speculators==0.9.0 vs --ref speculators==0.9.0 on a real row of a tiny
    verifier (its tokenizer resolves the mask token on both sides) + 2 synthetic cases."""
    return once_per_run(tmp_path_factory, "self-test", _self_test)


def _self_test(tmp: Path):
    # a verifier under /tmp (bound into the candidate's sandbox); the suite's conversations and
    # cache: the reference's outputs come from its records on a warm run
    verifier = make_tiny_verifier(tmp / "verifier", layers=8)
    return run_compare(CompareOptions(
        candidate="framework:speculators==0.9.0", ref="speculators==0.9.0",
        verifier=str(verifier), data=str(shared_conversations()), seq_len=96, rows=1,
        anchors=6, cases=2, seed=0, out=tmp / "reports", progress=False, offline=True))


def test_speculators_self_test_passes_with_nothing_but_passes(self_test):
    assert self_test.exit_code == 0
    assert {s for _, s in _statuses(self_test.report)} == {"pass"}
    names = {n for n, _ in _statuses(self_test.report)}
    assert {"derivation", "targets", "loss", "gradients", "metrics", "anchors"} <= names


def test_self_test_report_names_the_framework(self_test):
    fw = json.loads((self_test.folder / "report.json").read_text())["candidate"]["framework"]
    assert fw["label"] == "speculators 0.9.0" and fw["provenance"] == {}
    assert fw["source"]["kind"] == "sdist" and fw["capabilities"]["packed_rows"] is True
    md = (self_test.folder / "report.md").read_text()
    assert "Framework audited: speculators 0.9.0" in md
    assert "Outputs computed by the adapter, not the framework: none." in md
    assert self_test.report.candidate["name"] == "speculators 0.9.0 (framework:speculators)"


@pytest.fixture(scope="module")
def tagged_clone(reference_identity, tmp_path_factory):
    """A local git repository of the 0.9.0 source with tag v0.9.0."""
    path = tmp_path_factory.mktemp("origin") / "speculators"
    release_repo(reference_identity.source_dir, path)
    return path


def test_speculators_git_tag_against_a_path_reference(tagged_clone, reference_identity,
                                                      tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(copy_of_cache(tmp_path / "cache", releases=False))
                       )  # the clone goes here
    outcome = run_compare(CompareOptions(
        candidate="framework:speculators@v0.9.0", ref=f"path:{reference_identity.source_dir}",
        ref_url=str(tagged_clone), rows=0, cases=1, seed=0, out=tmp_path / "reports",
        cache_dir=tmp_path / "compare-cache", progress=False))
    assert outcome.exit_code == 0, [(r.name, r.summary) for r in outcome.report.results
                                    if r.status != "pass"]
    fw = outcome.report.candidate["framework"]
    assert fw["source"]["kind"] == "git" and fw["source"]["ref"] == "v0.9.0"
    assert fw["version"].startswith("v0.9.0@") and fw["version"].endswith("(0.9.0)")
    assert any((tmp_path / "cache" / "reference" / "git" / "mirrors").iterdir())


# ------------------------------------------------- an adapter in development (TestFW)
CAPS = '{"packed_rows": False, "verifier_families": ["llama", "qwen3", "mistral"]}'


@pytest.fixture(scope="module")
def testfw(reference_identity, tmp_path_factory):
    """`dflash-audit compare --candidate framework:testfw` (CLI) with the adapter folder on
    $DFLASH_AUDIT_ADAPTER_PATH and the tool's cache in a temporary folder."""
    tmp = tmp_path_factory.mktemp("testfw")
    wheel = build_wheel(tmp / "wheels")
    write_adapter(tmp / "adapters", wheel, CAPS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_AUDIT_ADAPTER_PATH", str(tmp / "adapters"))
        mp.setenv("DFLASH_AUDIT_CACHE", str(copy_of_cache(tmp / "cache", releases=False)))
        result = CliRunner().invoke(app, [
            "compare", "--candidate", "framework:testfw==1.0", "--ref",
            f"path:{reference_identity.source_dir}", "--rows", "0", "--cases", "4",
            "--seed", "0", "--out", str(tmp / "reports")])
    folder = Path(result.output.rsplit("report: ", 1)[1].split()[0])
    return {"result": result, "folder": folder, "cache": tmp / "cache",
            "report": json.loads((folder / "report.json").read_text())}


def test_testfw_is_installed_into_the_tools_cache(testfw):
    site = testfw["cache"] / "frameworks" / "testfw-1.0" / "site"
    assert (site / "demo_fw_pkg" / "__init__.py").is_file()
    report = testfw["report"]
    assert report["candidate"]["name"] == "testfw (package 1.0)"  # imported from there
    assert report["candidate"]["framework"]["install"] == str(site)


def test_adapter_computed_loss_warns_and_does_not_fail(testfw):
    result, report = testfw["result"], testfw["report"]
    assert result.exit_code == 0 and report["verdict"] == "pass"
    loss = [r for c in report["cases"] for r in c["results"] if r["name"] == "loss"]
    assert loss and all(r["status"] == "warn" for r in loss)
    assert all(r["summary"].startswith("loss: computed by the adapter, not audited as TestFW "
                                       "1.0's (loss, ") for r in loss)
    others = {r["status"] for c in report["cases"] for r in c["results"] if r["name"] in (
        "logits", "targets", "gradients", "mask")}
    assert others == {"pass"}
    assert "computed by the adapter, not audited: loss" in result.output
    assert "\n  warning: " in result.output  # a PASS says what its warnings are  # the terminal line
    # what it lacks and does not describe (no LATENT) is listed, a warning: the exit stays 0
    assert [(d["capability"], d["declared"]) for d in report["latent"]] == [
        ("packed_rows", False), ("verifier_families", False)]
    assert report["latent"][0]["cases"] and report["latent"][1]["cases"]
    assert ("\n  warning (latent): TestFW 1.0 cannot express packed rows (CAPABILITIES "
            "packed_rows); what it would do on such input is not declared by its adapter "
            "(LATENT)") in result.output


def test_testfw_cases_are_ones_it_supports(testfw):
    report = testfw["report"]
    assert len(report["cases"]) == 4
    layouts = [c["layout"] for c in report["cases"]]
    assert all(lay["documents"] == 1 and lay["padding"] == 0 for lay in layouts)
    assert {lay["verifier_model_type"] for lay in layouts} == {"llama", "qwen3", "mistral"}
    assert any(n.startswith("not supported by TestFW 1.0: verifier family 'qwen3_5")
               for n in report["notes"])


def test_every_report_format_shows_the_adapter_mark(testfw):
    folder = testfw["folder"]
    md, html = (folder / "report.md").read_text(), (folder / "report.html").read_text()
    assert "### Framework" in md and "Outputs computed by the adapter, not the framework: " \
        "loss, loss_weights." in md
    assert "not supported by TestFW 1.0" in md and "not supported by TestFW 1.0" in html
    assert "loss: computed by the adapter, not audited as TestFW 1.0&#x27;s" in html
    junit = ET.parse(folder / "junit.xml").getroot()
    outs = [tc.find("system-out").text for tc in junit.iter("testcase")
            if tc.get("classname") == "dflash_audit.loss"]
    assert outs and all(o.startswith("WARN: loss: computed by the adapter") for o in outs)
    assert not any(tc.find("failure") is not None for tc in junit.iter("testcase"))


# ------------------------------------- a framework that cannot import: setup, never a FAIL
MISSING_ADAPTER = '''"""A test adapter whose framework code imports a module its REQUIREMENTS lack."""
from dflash_audit.candidate import DrafterCandidate

NAME = "TestFW"
VERSION = "1.0"
REQUIREMENTS = [{wheel!r}]
{modules}

class Candidate(DrafterCandidate):
    name = "testfw"

    def run_case(self, *args):
        import demo_fw_core  # noqa: F401 - the "framework", lazily, as real adapters do
        return super().run_case(*args)


candidate = Candidate()
'''


@pytest.mark.parametrize("when", ["load", "case", "plain"])
def test_a_framework_that_cannot_import_is_a_setup_error(when, reference_identity, tmp_path):
    """The framework's module imports demo_fw_missing_dep, which no REQUIREMENTS install:
    declared in FRAMEWORK_MODULES, the load step fails before any case; undeclared, the first
    case does; both exit 2 naming the module, who imports it and the fix. The same file as a
    plain candidate (user code, not a framework) is a conformance FAIL, exit 1."""
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "demo_fw_core.py").write_text("import demo_fw_missing_dep  # noqa: F401\n")
    modules = 'FRAMEWORK_MODULES = ["demo_fw_pkg", "demo_fw_core"]' if when == "load" else ""
    wheel = build_wheel(tmp_path / "wheels")
    (folder / "testfw_adapter.py").write_text(MISSING_ADAPTER.format(
        wheel=str(wheel), modules=modules))
    spec = (f"{folder / 'testfw_adapter.py'}:candidate" if when == "plain" else
            "framework:testfw==1.0")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_AUDIT_ADAPTER_PATH", str(folder))
        mp.setenv("DFLASH_AUDIT_CACHE", str(copy_of_cache(tmp_path / "cache", releases=False)))
        result = CliRunner().invoke(app, [
            "compare", "--candidate", spec, "--ref", f"path:{reference_identity.source_dir}",
            "--rows", "0", "--cases", "1", "--seed", "0", "--out", str(tmp_path / "reports")])
    out = " ".join(result.output.split())
    if when == "plain":
        assert result.exit_code == 1, result.output
        folder = Path(result.output.rsplit("report: ", 1)[1].split()[0])
        report = json.loads((folder / "report.json").read_text())
        runs = [r for c in report["cases"] for r in c["results"] if r["name"] == "run"]
        assert report["verdict"] == "fail" and runs and all(
            r["status"] == "fail" and r["summary"] == "the candidate's run_case raised "
            "ModuleNotFoundError: No module named 'demo_fw_missing_dep'" for r in runs)
        return
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not (tmp_path / "reports").exists()
    assert "framework:testfw (TestFW 1.0) cannot import 'demo_fw_missing_dep' (" in out
    assert f"{folder / 'demo_fw_core.py'}:1 imports it)" in out
    assert ("when its candidate loaded, before any case" if when == "load" else
            " in case ") in out
    assert "not a conformance finding" in out
    assert f"lack it. Add the pinned distribution that provides 'demo_fw_missing_dep' to " \
           f"REQUIREMENTS in {folder / 'testfw_adapter.py'}" in out
    assert "-m pip install demo_fw_missing_dep" in out and "--candidate-python PATH" in out


def test_every_built_in_framework_adapter_declares_its_framework_modules():
    """A built-in adapter that installs a framework names the modules it imports, so the
    candidate's load step imports them before any case (see test above)."""
    for key, constants in registry.available_adapters().items():
        if constants.get("folder") is None and constants.get("REQUIREMENTS"):
            modules = constants.get("FRAMEWORK_MODULES")
            assert modules and all(isinstance(m, str) for m in modules), key


# --------------------------------------------------------------------------- hard labels
class DataTokenLabels(DrafterCandidate):
    """Trains on the data tokens input_ids[a+s] (a one-hot target) and returns them as
    target_ids: the SpecForge-style hard labels."""

    def run_case(self, config, loss, weights, inputs):
        model = self.build(config).float()
        model.load_state_dict(weights, strict=True)
        out = model(**{k: inputs[k] for k in (
            "hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
            "document_ids", "position_ids", "anchor_positions", "anchor_valid")})
        ids = inputs["input_ids"][0, out.block_indices % inputs["input_ids"].shape[-1]]
        onehot = 30.0 * torch.nn.functional.one_hot(ids, out.targets.shape[-1]).float()[None]
        result = side_outputs(model, config, dataclasses.replace(out, targets=onehot), loss)
        result.tensors["target_ids"] = ids[None].long()
        del result.tensors["targets"]
        return result


class ArgmaxLabels(DrafterCandidate):
    """The reference's targets, returned as their argmax token per slot (and trained soft)."""

    def run_case(self, config, loss, weights, inputs):
        result = super().run_case(config, loss, weights, inputs)
        result.tensors["target_ids"] = result.tensors.pop("targets")[0].argmax(-1)[None]
        return result


@pytest.fixture(scope="module")
def label_cases(run_reference_cases):
    """One synthetic case under the reference-model profile and its D-PACE twin (the training
    CLI's ce + dpace: SpecForge's D-PACE run), run by the reference in one process."""
    case = plan_synthetic_cases(Profile.load("reference-model"), 1, seed=3)[0].case
    dpace = dataclasses.replace(case, name=f"{case.name}-dpace", loss=LossSpec("ce", "dpace"))
    refs = run_reference_cases([case, dpace])
    return {"plain": (case, refs[case.name]), "dpace": (dpace, refs[dpace.name])}


@pytest.fixture(scope="module")
def label_case(label_cases):
    return label_cases["plain"]


def test_data_token_labels_are_named(label_case):
    case, ref = label_case
    cand, failure = run_candidate(DataTokenLabels(), case)
    assert failure is None
    assert torch.equal(cand.tensors["target_ids"][0], data_tokens(case))
    results = {r.name: r for r in check_case(case, cand, ref)}
    assert results["protocol"].status == "pass"
    assert results["targets"].status == "fail"
    assert "target_ids differ from the reference's argmax target" in results["targets"].summary
    assert results["targets"].diagnosis == [DATA_TOKENS_CAUSE]
    assert results["loss"].status == "fail"
    # its loss replayed on its own labels: ce-data, the reference's denominator; training on
    # the labels the targets check names is a consequence of that, not a cause of its own
    assert results["loss"].diagnosis == [
        f"follows from the targets difference ({DATA_TOKENS_CAUSE}): the loss is "
        "cross-entropy against those labels ('ce-data' where the profile says 'kl_div')"]


def test_dpace_on_data_token_labels_is_a_consequence(label_cases):
    """D-PACE confidences from the cross-entropy of the candidate's own labels (SpecForge
    under D-PACE: exp(-CE) of the term it weights) follow from the labels: one root cause,
    the targets check's; the loss check names only consequences."""
    case, ref = label_cases["dpace"]
    cand, failure = run_candidate(DataTokenLabels(), case)
    assert failure is None
    results = {r.name: r for r in check_case(case, cand, ref)}
    assert results["targets"].diagnosis == [DATA_TOKENS_CAUSE]
    loss = results["loss"]
    assert loss.status == "fail"
    assert loss.details["parts"]["loss_weights.ce"]["status"] == "fail"
    assert loss.diagnosis == [
        f"follows from the targets difference ({DATA_TOKENS_CAUSE}): D-PACE weights depend on "
        "the per-slot loss, and the reference's D-PACE formula on the candidate's own logits "
        "and labels (target_ids) reproduces its weights",
        f"follows from the targets difference ({DATA_TOKENS_CAUSE}): the loss is "
        "cross-entropy against those labels ('ce-data' where the profile says 'ce')"]
    assert all(is_downstream(d) for d in loss.diagnosis)


def test_argmax_labels_pass(label_case):
    case, ref = label_case
    cand, _ = run_candidate(ArgmaxLabels(), case)
    results = {r.name: r for r in check_case(case, cand, ref)}
    assert results["targets"].status == "pass"
    assert results["targets"].summary.startswith("target_ids equal the reference's argmax")
    assert results["loss"].status == "pass"
