"""`dflash-audit compare` end to end against the real reference (speculators 0.9.0): a tiny
random verifier + a JSONL file for the real batch, synthetic cases, exit codes 0 / 1 / 2 and
the report files. The exit-0 run clones the reference offline from a local git repository
built from the release source (branch main, tag v0.9.0)."""

from __future__ import annotations

import json
import os
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from cache_support import copy_of_cache, release_repo
from data_support import shared_conversations, shared_tiny_verifier
from torch import nn
from typer.testing import CliRunner

from dflash_audit.audit import compare as cmp
from dflash_audit.audit.compare import run_compare
from dflash_audit.audit.compare_cli import main
from dflash_audit.audit.sides.run_sides import REFERENCE_NOT_RUN
from dflash_audit.audit.options import CompareOptions
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.cli import app
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.report import REPORT_FILES

pytestmark = pytest.mark.reference


# ------------------------------------------------------------------ a buggy candidate
class FcNMinusOneDrafter(DFlashDrafter):
    """fc over the first n-1 target layers (Linear((n-1)*H, H)); loads the matching columns."""

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear((config.num_target_layers - 1) * H, H, bias=False)

    def context(self, hidden_states):
        return self.hidden_norm(self.fc(hidden_states[..., : self.fc.in_features]))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        state_dict = {**state_dict, "fc.weight": state_dict["fc.weight"][:, : self.fc.in_features]}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class FcNMinusOne(DrafterCandidate):
    name = "fc reads n-1 target layers"

    def build(self, config):
        return FcNMinusOneDrafter(config)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_verifier() -> Path:
    return shared_tiny_verifier(layers=8)


@pytest.fixture(scope="module")
def conversations() -> Path:
    return shared_conversations()


@pytest.fixture(scope="module")
def origin(reference_identity, tmp_path_factory) -> dict:
    """A local git repository of the 0.9.0 source: tag v0.9.0, branch main one commit ahead."""
    path = tmp_path_factory.mktemp("origin") / "speculators"
    repo = release_repo(reference_identity.source_dir, path)
    tag = repo.head.commit.hexsha
    (path / "AFTER_0.9.0.txt").write_text("a commit after the release\n")
    repo.git.add(A=True)
    repo.index.commit("after 0.9.0")
    return {"path": path, "tag_commit": tag}


@pytest.fixture(scope="module")
def shared_cache() -> Path:
    """Batch cache + import-check marker shared by the tests that do not test caching: the
    suite's cache (its import check passed: no import check process of their own)."""
    return Path(os.environ["DFLASH_AUDIT_CACHE"])


def options(tmp_path, tiny_verifier, conversations, **kw) -> CompareOptions:
    base = dict(verifier=str(tiny_verifier), data=str(conversations), seq_len=96, rows=1,
                anchors=6, cases=4, seed=0, out=tmp_path / "reports",
                cache_dir=tmp_path / "cache", progress=False)
    return CompareOptions(**{**base, **kw})


def read_report(folder: Path) -> dict:
    names = sorted(p.name for p in folder.iterdir())
    assert [n for n in names if n != "canary"] == sorted(REPORT_FILES)
    report = json.loads((folder / "report.json").read_text())
    assert ("canary" in names) == (report["verdict"] == "pass" and "canary" in report[
        "candidate"])  # a passing report carries the canary train reruns
    data = json.loads((folder / "report.json").read_text())
    junit = ET.parse(folder / "junit.xml").getroot()
    testcases = junit.findall("./testsuite/testcase")
    assert len(testcases) == sum(len(c["results"]) for c in data["cases"])
    failures = [tc for tc in testcases if tc.find("failure") is not None]
    assert len(failures) == sum(r["status"] == "fail" for c in data["cases"]
                                for r in c["results"])
    md = (folder / "report.md").read_text()
    assert md.splitlines()[0] == ("## dflash-audit compare: "
                                  + ("✅ PASS" if data["verdict"] == "pass" else "❌ FAIL"))
    assert "<h1>dflash-audit compare" in (folder / "report.html").read_text()
    return data


# ------------------------------------------------------------------------------- tests
def test_conformant_drafter_passes_via_git_clone(tmp_path, tiny_verifier, conversations,
                                                 origin, monkeypatch):
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(copy_of_cache(tmp_path / "user-cache",
                                                             releases=False)))  # fresh git cache
    opts = options(tmp_path, tiny_verifier, conversations, ref="speculators@v0.9.0",
                   ref_url=origin["path"].as_uri(), profile="reference-train-cli", cases=5)
    outcome = run_compare(opts)
    assert outcome.exit_code == 0, [(r.case, r.name, r.summary) for r in outcome.report.results
                                    if r.status == "fail"]
    data = read_report(outcome.folder)
    assert data["verdict"] == "pass" and data["exit_code"] == 0
    ref = data["reference"]
    assert (ref["kind"], ref["ref"], ref["commit"]) == ("git", "v0.9.0", origin["tag_commit"])
    assert ref["url"] == origin["path"].as_uri() and ref["commit_date"]
    assert ref["module_file"].startswith(ref["source_dir"])
    assert outcome.folder.name.endswith("-" + origin["tag_commit"][:12])
    names = [c["name"] for c in data["cases"]]
    assert names[:2] == ["real-00-sliding", "real-00-full"]  # profile layout, then the other
    assert {c["layout"]["layout"] for c in data["cases"]} == {"full", "sliding", "mixed"}
    real = data["cases"][0]["layout"]
    assert (real["block_size"], real["layer_types"], real["sliding_window"]) == (
        16, ["sliding_attention"] * 5, 2048)
    assert real["hidden_size"] == 32 and real["vocab_size"] == 300 and real["anchors"] == 6
    assert data["profile"]["name"] == "reference-train-cli"
    assert data["profile"]["fields"]["weighting"] == "dpace"
    assert {c["name"] for c in data["checks"]} >= {"structure", "mask", "context", "targets",
                                                  "logits", "loss", "gradients", "metrics"}
    assert data["inputs"]["batch_cache"]["hit"] is False
    assert data["inputs"]["verifier"]["path"] == str(tiny_verifier.resolve())
    assert "data:image/png;base64," in (outcome.folder / "report.html").read_text()

    # warm: the captured batch comes from the cache, the verdict and fingerprints are stable
    again = run_compare(options(tmp_path, tiny_verifier, conversations, ref="speculators@v0.9.0",
                                ref_url=origin["path"].as_uri(), profile="reference-train-cli",
                                cases=0, offline=True))
    assert again.exit_code == 0 and again.report.inputs["batch_cache"]["hit"] is True
    assert again.report.candidate["fingerprint"] == data["candidate"]["fingerprint"]
    # without synthetic cases the warm audit covers only the real verifier; every other part
    # of the fingerprint is the cold report's
    from dflash_audit.report.fingerprint import report_fingerprint

    assert len(again.report.verifiers) == 1 and set(again.report.verifiers) < set(
        data["verifiers"])
    assert again.report.fingerprint == report_fingerprint(
        data["verdict"], data["reference"], data["candidate"]["fingerprint"],
        data["profile"]["fingerprint"], sorted(again.report.verifiers),
        again.report.candidate.get("canary"))
    # the canary is the real case both times: the same files
    assert again.report.candidate["canary"]["files"] == data["candidate"]["canary"]["files"]


def test_buggy_candidate_fails_with_exit_1(tmp_path, tiny_verifier, conversations, capsys,
                                           shared_cache):
    spec = f"{Path(__file__).resolve()}:FcNMinusOne"
    rc = main(options(tmp_path, tiny_verifier, conversations, candidate=spec,
                      cache_dir=shared_cache))
    out = capsys.readouterr().out
    assert rc == 1 and "verdict: FAIL" in out
    # after the causes, what to do (no train command: train's gate refuses a FAIL)
    assert "\nnext: fix the cause(s) above in the candidate" in out
    assert "next: dflash-audit train" not in out
    folder = Path(out.split("report: ")[1].strip())
    data = read_report(folder)
    assert data["verdict"] == "fail" and data["candidate"]["name"] == "fc reads n-1 target layers"
    assert "test_compare.py" in data["candidate"]["files"]
    assert data["reference"]["kind"] == "sdist" and data["reference"]["version"] == "0.9.0"
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["structure"]["status"] == "fail" and checks["context"]["status"] == "fail"
    assert checks["mask"]["status"] == "pass"
    assert any("fc fed 2 of 3 target layers" in d for d in checks["structure"]["diagnosis"])
    junit = ET.parse(folder / "junit.xml").getroot()
    failure = next(tc.find("failure") for tc in junit.iter("testcase")
                   if tc.get("name") == "structure[real-00-full]")
    assert "fc fed 2 of 3" in failure.text


class Crashes(DrafterCandidate):
    name = "raises"

    def run_case(self, config, loss, weights, inputs):
        raise RuntimeError("size mismatch for fc.weight")


def test_crashing_candidate_is_a_conformance_failure(tmp_path, tiny_verifier, conversations,
                                                     shared_cache):
    spec = f"{Path(__file__).resolve()}:Crashes"
    outcome = run_compare(options(tmp_path, tiny_verifier, conversations, candidate=spec,
                                  rows=0, cases=1, cache_dir=shared_cache))
    assert outcome.exit_code == 1
    assert {(r.name, r.status) for r in outcome.report.results} == {("run", "fail")}
    assert "RuntimeError: size mismatch" in outcome.report.results[0].summary
    assert "state dict" in outcome.report.results[0].diagnosis[0]
    # nothing to compare: the reference is not run, and the report says why
    assert REFERENCE_NOT_RUN in outcome.report.notes
    assert "reference" not in outcome.report.timing


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "candidates"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(args: list[str]):
    return CliRunner().invoke(app, ["compare", *args])


def test_unreachable_remote_exits_2(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{_closed_port()}/speculators.git"
    result = _cli(["--ref", "speculators@main", "--ref-url", url, "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unreachable" in result.output and "--ref speculators==0.9.0" in result.output
    assert "path:DIR" in result.output and "Traceback" not in result.output
    assert not any(tmp_path.glob("*/report.json"))


@pytest.mark.parametrize("args, message", [
    (["--ref", "speculators-main"], "unrecognised reference spec"),
    (["--ref", "path:/nonexistent/speculators"],
     "is not a directory; point path: at the root of a speculators checkout"),
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--candidate", "/nonexistent/cand.py:x"],
     "does not exist (a relative path is read from the working folder"),
    (["--candidate", "dflash_audit.candidate:NoSuchThing"], "has no attribute 'NoSuchThing'"),
    (["--candidate", f"{EXAMPLES}/gamma7.py:wrong"],
     f"has no attribute 'wrong'; it offers {EXAMPLES}/gamma7.py:candidate, "
     f"{EXAMPLES}/gamma7.py:Gamma7Candidate\n"),  # not the DrafterCandidate it imports
    (["--cases", "-1"], "--cases must be >= 0"),
])
def test_usage_errors_exit_2(tmp_path, args, message):
    result = _cli([*args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("columns", [80, 200])
def test_help_shows_every_option_whole_at_any_width(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    result = _cli(["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "…" not in result.output and max(map(len, result.output.splitlines())) <= columns
    for whole in ("speculators@<branch|tag|sha>", "framework:speculators@REF|==X.Y.Z|:path:DIR",
                  "--require-sandbox / --no-require-sandbox"):
        assert whole in text


def test_bad_profile_file_names_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    text = (Path(cmp.__file__).parents[1] / "profiles" / "reference-model.toml").read_text()
    bad.write_text(text.replace("block_size = 8", "block_size = 1"))
    result = _cli(["--profile", str(bad), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "field 'block_size' = 1" in result.output


def test_bad_data_exits_2(tmp_path, tiny_verifier):
    result = _cli(["--verifier", str(tiny_verifier), "--data", str(tmp_path / "none.jsonl"),
                   "--cases", "0", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "none.jsonl" in result.output
    assert "Traceback" not in result.output


# ----------------------------------------------------------------- planning (no reference)
def test_synthetic_spread_covers_both_layouts_and_is_seeded():
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.profile import Profile

    profile = Profile.load("reference-model")
    two = plan_synthetic_cases(profile, 2, seed=3)
    assert [p.layout["layout"] for p in two] == ["full", "sliding"]
    cases = plan_synthetic_cases(profile, 30, seed=3)
    again = plan_synthetic_cases(profile, 30, seed=3)
    assert [p.case.description for p in cases] == [p.case.description for p in again]
    assert all(torch.equal(a.case.inputs["hidden_states"], b.case.inputs["hidden_states"])
               for a, b in zip(cases, again))
    layouts = [p.layout for p in cases]
    assert {x["layout"] for x in layouts} == {"full", "sliding", "mixed"}
    assert len({x["block_size"] for x in layouts}) >= 4 and layouts[0]["block_size"] == 8
    assert any(x["documents"] >= 3 for x in layouts) and any(x["padding"] > 0 for x in layouts)
    assert any(x["sliding_window"] is not None and x["sliding_window"] < x["seq_len"] // 2
               for x in layouts)
    assert any(x["valid_anchors"] < x["anchors"] for x in layouts)  # padding anchors
    # one long document last (positions past 256 and 2048); none in a short spread
    from dflash_audit.audit.cases.plan import LONG_SEQ_LEN

    assert [x["seq_len"] for x in layouts].index(LONG_SEQ_LEN) == len(layouts) - 1
    assert int(cases[-1].case.inputs["position_ids"].max()) > 2048
    long_inputs = cases[-1].case.inputs  # and a block reads them: its anchor is past 2048
    assert int(long_inputs["anchor_positions"][long_inputs["anchor_valid"]].max()) > 2048
    assert all(x["seq_len"] < LONG_SEQ_LEN for x in (p.layout for p in two))
    # every commonly hard-coded verifier constant is some case's verifier value
    assert {x["rope_theta"] for x in layouts} >= {1e4, 1e5, 5e5, 1e6}
    assert {x["rms_norm_eps"] for x in layouts} >= {1e-5, 1e-6}
    # the first pass covers every verifier family with its own conventions
    from dflash_audit.data.families import FAMILIES

    first = layouts[:len(FAMILIES)]
    assert [x["verifier_model_type"] for x in first] == [
        "llama", "qwen3", "qwen3_5_text", "gemma3_text", "mistral", "gpt_oss", "olmo3", "glm4"]
    gemma = first[3]  # nested per-layer-type rope: the drafter takes the sliding entry
    assert gemma["rope_theta"] == 1e4 and gemma["verifier_norm"] == "x*(1+w)"
    assert gemma["hidden_act"] == "gelu_pytorch_tanh" and gemma["head_dim"] == 16
    assert first[5]["rope_parameters"]["rope_type"] == "yarn" and first[7]["rms_norm_eps"] < 1e-6
    for p in cases:  # the profile's semantics are kept
        assert p.case.loss == profile.loss_spec()
        assert p.case.config.target_layer_ids == (2, 6, 9)  # [2, N//2, N-3] for N=12
        # lm_head and verifier_lm_head are both the verifier's head in training
        assert torch.equal(p.case.weights["lm_head.weight"],
                           p.case.weights["verifier_lm_head.weight"])
    assert plan_synthetic_cases(profile, 3, seed=4)[2].case.description != \
        plan_synthetic_cases(profile, 3, seed=3)[2].case.description


def test_real_cases_share_weights_anchors_and_a_draft_vocabulary(tiny_verifier, conversations,
                                                                   tmp_path):
    from dflash_audit.audit.cases.plan import plan_real_cases
    from dflash_audit.audit.cases.real_inputs import load_real_inputs
    from dflash_audit.data.verifier import resolve_verifier
    from dflash_audit.profile import Profile

    profile = Profile.load("reference-model").replace(draft_vocab_size=40)
    real = load_real_inputs(resolve_verifier(str(tiny_verifier)), str(conversations), 96, 1, "speculators",
                            cache_root=tmp_path)
    full, sliding = plan_real_cases(profile, real, anchors=5, seed=1)
    assert (full.case.name, sliding.case.name) == ("real-00-full", "real-00-sliding")
    assert sliding.case.config.sliding_window == 2048 and full.case.config.layer_types is None
    assert full.case.weights is sliding.case.weights
    assert torch.equal(full.case.inputs["anchor_positions"], sliding.case.inputs[
        "anchor_positions"]) and full.case.inputs["anchor_positions"].numel() == 5
    w, batch = full.case.weights, real.batches[0]
    assert w["t2d"].sum() == 40 and w["lm_head.weight"].shape == (40, 32)
    assert torch.equal(w["lm_head.weight"], real.frozen["lm_head.weight"][w["t2d"]])
    assert torch.equal(w["verifier_norm.weight"], real.frozen["verifier_norm.weight"])
    supervised = batch.input_ids[batch.loss_mask.bool()]
    assert bool(w["t2d"][supervised].all())  # < 40 distinct supervised bytes: all kept
    assert torch.equal(torch.arange(40) + w["d2t"], w["t2d"].nonzero().squeeze(-1))


@pytest.mark.parametrize("kw", [
    {},
    {"candidate": "my drafter.py:candidate", "ref": "speculators@main", "out": Path("my reports"),
     "verifier": "/models/my verifier", "profile": "p.toml", "data": "chats.jsonl"},
])
def test_a_pass_names_the_train_command_its_gate_accepts(kw):
    """The printed ``dflash-audit train`` carries the flags the gate matches the report by:
    read back, they give the compare command the gate itself would ask for."""
    import shlex

    from dflash_audit.audit.compare_cli import TRAIN_OUT, train_command
    from dflash_audit.train.gate import compare_command

    opts = CompareOptions(**kw)
    words = shlex.split(train_command(opts))
    assert words[:2] == ["dflash-audit", "train"]
    flags = dict(zip(words[2::2], words[3::2], strict=True))
    assert flags["--out"] == TRAIN_OUT and flags["--data"] == opts.data
    back = compare_command(flags.get("--ref"), flags["--profile"], flags.get("--candidate"),
                           Path(flags.get("--reports-dir", "reports")), flags.get("--verifier"))
    assert back == compare_command(opts.ref, opts.profile, opts.candidate, opts.out,
                                   opts.verifier)
    assert ("--reports-dir" in flags) == bool(kw) and ("--verifier" in flags) == bool(kw)
    assert train_command(CompareOptions(candidate="framework:specforge")) is None


def test_exit_0_needs_a_written_pass_verdict(tmp_path, capsys):
    """The last guard of the gate: 0 only when report.json exists and says pass."""
    import json

    from dflash_audit.audit.compare_cli import guarded_exit_code

    assert guarded_exit_code(0, tmp_path) == 2
    assert "no PASS verdict" in capsys.readouterr().err
    (tmp_path / "report.json").write_text(json.dumps({"verdict": "fail"}))
    assert guarded_exit_code(0, tmp_path) == 2
    (tmp_path / "report.json").write_text(json.dumps({"verdict": "pass"}))
    assert guarded_exit_code(0, tmp_path) == 0
    assert guarded_exit_code(1, tmp_path) == 1


def test_an_unreadable_reference_json_is_a_setup_error_not_a_traceback(tmp_path,
                                                                        reference_identity):
    """reference.json (the reference process's import facts) replaced by another process: exit 2
    with one line, never an internal error."""
    from dflash_audit.audit.compare import _reference_info
    from dflash_audit.audit.setup_error import CompareSetupError

    identity = reference_identity
    (tmp_path / "reference.json").write_text("{not json")
    with pytest.raises(CompareSetupError, match="reference.json, written by the reference "
                                                "process, is unreadable"):
        _reference_info(identity, tmp_path)
    (tmp_path / "reference.json").write_text('{"module_file": "/x/speculators/__init__.py"}')
    assert _reference_info(identity, tmp_path)["module_file"] == "/x/speculators/__init__.py"
