"""check-batches on a tiny random Llama (8 layers, H=32, byte-level ChatML tokenizer): our
files and the reference offline format pass; every shipped broken-batch script makes a
folder that fails with the right finding; setup errors exit 2 with one line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from data_support import SAMPLE_CONVERSATIONS, make_tiny_verifier, write_jsonl
from typer.testing import CliRunner

from dflash_audit.batch_audit.run import run_check_batches, sample_rows
from dflash_audit.batch_audit.recompute import file_precision
from dflash_audit.data.pipeline import build_batches, write_batches
from dflash_audit.data.verifier import load_verifier

BROKEN = Path(__file__).resolve().parents[1] / "examples" / "broken_batches"
pytestmark = pytest.mark.usefixtures("single_thread")


def broken_script(name: str):
    """Import ``examples/broken_batches/<name>.py`` (its folder on sys.path for _batches)."""
    if str(BROKEN) not in sys.path:
        sys.path.insert(0, str(BROKEN))
    spec = importlib.util.spec_from_file_location(f"broken_{name}", BROKEN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny") / "verifier", layers=8)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_verifier(str(tiny_dir))


@pytest.fixture(scope="module")
def good(tiny, tmp_path_factory):
    """Two packed rows (T=256, several documents each) + the reference offline copy."""
    folder = tmp_path_factory.mktemp("good")
    data = write_jsonl(folder / "conv.jsonl", SAMPLE_CONVERSATIONS * 6)
    batches = build_batches(tiny, str(data), seq_len=256, rows=2, progress=False)
    write_batches(batches, folder / "ours", reference_format=True)
    return folder / "ours"


def failed(report):
    return {(c.name, c.finding) for c in report.failures}


def test_our_files_pass(tiny, good):
    report = run_check_batches(good, tiny, rows_to_check=2, progress=False, profile="zlab")
    assert report.exit_code == 0, failed(report)
    by_name = {c.name: c for c in report.checks}
    assert by_name["target_layer_ids"].status == "pass"
    assert by_name["mask_token_id"].status == "pass"
    assert by_name["loss_mask"].status == "pass"
    assert by_name["position_ids"].status == "pass"
    assert by_name["verifier_last_hidden_states"].details["matched"] == "layer 8"
    assert [c.details["matched"] for c in report.checks if c.name.startswith("hidden_states[")
            ][:5] == ["layer 2", "layer 3", "layer 4", "layer 5", "layer 6"]


def test_reference_offline_format_passes(tiny, good):
    report = run_check_batches(good / "reference", tiny, rows_to_check=3, progress=False)
    assert report.format == "reference-offline"
    assert report.exit_code == 0, failed(report)
    assert len(report.rows_checked) == 3
    assert any(c.name == "loss_mask" and c.status == "pass" for c in report.checks)


def test_bf16_rounded_capture_passes_within_measured_noise(tiny, good, tmp_path):
    rows = broken_script("_batches").read_folder(good)
    for _, t, _ in rows:
        for k in ("hidden_states", "verifier_last_hidden_states"):
            t[k] = t[k].to(torch.bfloat16).float()
    out = broken_script("_batches").write_folder(rows, tmp_path / "bf16")
    report = run_check_batches(out, tiny, rows_to_check=1, progress=False)
    assert report.context["files_precision"] == "bfloat16"
    assert report.exit_code == 0, failed(report)
    assert all(0 < x < 0.05 for x in report.context["noise_per_layer"])


@pytest.mark.parametrize("script, check, finding, kwargs", [
    ("last_layer_two_short", "verifier_last_hidden_states", "layer N-2", {}),
    ("post_norm_last_state", "verifier_last_hidden_states", "post-norm", {}),
    ("loss_mask_shifted", "loss_mask", "shift +1", {}),
    ("mask_on_user_turns", "loss_mask", "user turns", {}),
    ("zlab_ids_as_speculators", "target_layer_ids", "zlab ids read as speculators ids",
     {"drafter_config": "drafter_config.json"}),
])
def test_broken_batches_fail_with_the_right_name(tiny, tiny_dir, good, tmp_path, script,
                                                 check, finding, kwargs):
    out = broken_script(script).make(good, tmp_path / script, str(tiny_dir))
    kwargs = {k: Path(out) / v for k, v in kwargs.items()}
    report = run_check_batches(out, tiny, rows_to_check=1, progress=False, **kwargs)
    assert report.exit_code == 1
    assert failed(report) == {(check, finding)}


def test_positions_counting_on_warn_unless_the_rope_depends_on_the_absolute_position(
        tiny, tiny_dir, good, tmp_path):
    """A per-document position offset keeps every RoPE distance inside a document, and
    attention stays per document: it cannot change training (compare passes such a drafter:
    test_diagnose's positions-not-restarting), so a warning, exit 0; with a verifier whose
    rope_type depends on the absolute position (dynamic NTK, longrope), a failure."""
    from dflash_audit.batch_audit.files import open_batch_folder
    from dflash_audit.batch_audit.layout import check_layout, rope_types

    out = broken_script("positions_not_restarting").make(good, tmp_path / "p", str(tiny_dir))
    report = run_check_batches(out, tiny, rows_to_check=1, progress=False)
    assert report.exit_code == 0 and report.verdict == "pass" and not report.failures
    assert {(c.name, c.finding) for c in report.warnings} == {("position_ids",
                                                              "positions continue")}
    assert "it cannot change what the drafter learns" in report.warnings[0].message
    from dflash_audit.cli import app

    cli = CliRunner().invoke(app, ["check-batches", str(out), "--verifier", str(tiny_dir),
                                   "--rows-to-check", "1", "--out", str(tmp_path / "r")])
    assert cli.exit_code == 0, cli.output
    text = " ".join(cli.output.split())
    assert "WARN [positions continue]" in text
    assert "0 failed, 1 warnings)" in text
    (folder,) = (tmp_path / "r").iterdir()
    assert "<system-out>WARN [positions continue]" in (folder / "junit.xml").read_text()
    assert f"- **positions continue** ({report.warnings[0].row}, warn): position_ids do not " \
           "restart" in (folder / "report.md").read_text()
    row = open_batch_folder(out).load(0)
    (pos,) = [c for c in check_layout(row, {"dynamic"}) if c.name == "position_ids"]
    assert pos.status == "fail" and "rope_type 'dynamic'" in pos.message
    assert rope_types(tiny.model.config) == {"default"}
    nested = type("C", (), {"rope_parameters": {"full_attention": {"rope_type": "linear"},
                                                "sliding_attention": {"rope_type": "default"}}})
    assert rope_types(nested()) == {"linear", "default"}


def test_zlab_ids_named_with_the_profile_alone(tiny, tiny_dir, good, tmp_path):
    out = broken_script("zlab_ids_as_speculators").make(good, tmp_path / "z", str(tiny_dir))
    report = run_check_batches(out, tiny, rows_to_check=1, progress=False, profile="zlab")
    assert failed(report) == {("target_layer_ids", "zlab ids read as speculators ids")}
    speculators = run_check_batches(out, tiny, rows_to_check=1, progress=False,
                                    profile="reference-model")
    assert failed(speculators) == {("target_layer_ids", "count mismatch")}


def test_cli_exit_codes_and_reports(tiny_dir, good, tmp_path):
    from dflash_audit.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["check-batches", str(good), "--verifier", str(tiny_dir),
                             "--rows-to-check", "1", "--out", str(tmp_path / "r")])
    assert ok.exit_code == 0, ok.output
    (folder,) = (tmp_path / "r").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["report.json", "report.md", "report.html", "junit.xml"])
    assert json.loads((folder / "report.json").read_text())["verdict"] == "pass"

    bad = broken_script("post_norm_last_state").make(good, tmp_path / "pn", str(tiny_dir))
    res = runner.invoke(app, ["check-batches", str(bad), "--verifier", str(tiny_dir),
                              "--rows-to-check", "1", "--out", str(tmp_path / "r2")])
    assert res.exit_code == 1 and "post-norm" in res.output
    (folder,) = (tmp_path / "r2").iterdir()
    assert "<failure message=\"post-norm\"" in (folder / "junit.xml").read_text()


def test_setup_errors_exit_2_with_one_line(tiny_dir, good, tmp_path):
    from dflash_audit.cli import app

    runner = CliRunner()
    shallow = make_tiny_verifier(tmp_path / "shallow", layers=4)
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    data = (good / "batch_00000.safetensors").read_bytes()
    (truncated / "batch_00000.safetensors").write_bytes(data[: len(data) // 2])
    for args, words in [
        ([str(tmp_path / "nope")], "batch folder not found"),
        ([str(good / "batch_00000.safetensors")], "is a file, not a batch folder"),
        ([str(tmp_path)], "not a dflash-audit or reference offline batch folder"),
        ([str(truncated)], "not a readable safetensors"),
        ([str(good), "--verifier", str(shallow)], "has 4 layers"),
        ([str(good), "--profile", "no-such-profile"], "--profile"),
    ]:
        if "--verifier" not in args:
            args = args + ["--verifier", str(tiny_dir)]
        res = runner.invoke(app, ["check-batches", *args, "--out", str(tmp_path / "r")])
        assert res.exit_code == 2, (args, res.output)
        assert words in res.output and "Traceback" not in res.output
        errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and words in errors[0]  # one line (besides HF load bars)


def test_file_precision_and_row_sampling():
    x = torch.randn(4, 8)
    assert file_precision(x) == torch.float32
    assert file_precision(x.to(torch.bfloat16).float()) == torch.bfloat16
    assert file_precision(x.to(torch.bfloat16)) == torch.bfloat16
    assert sample_rows(16, 4) == [0, 5, 10, 15]
    assert sample_rows(3, 10) == [0, 1, 2]


@pytest.mark.parametrize("variant, finding", [
    ("earlier", "shift -1"), ("no_eot", "end-of-turn excluded"), ("inverted", "inverted")])
def test_loss_mask_hypotheses(tiny, good, variant, finding):
    from dflash_audit.batch_audit.files import open_batch_folder
    from dflash_audit.batch_audit.loss_mask import check_loss_mask

    row = open_batch_folder(good).load(0)
    assert check_loss_mask(row, tiny.tokenizer).status == "pass"
    lm, valid = row.loss_mask, (row.document_ids >= 0).long()
    eot = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    row.loss_mask = {"earlier": torch.cat([lm[1:], lm.new_zeros(1)]),
                     "no_eot": lm * (row.input_ids != eot).long(),
                     "inverted": valid * (1 - lm)}[variant]
    check = check_loss_mask(row, tiny.tokenizer)
    assert (check.status, check.finding) == ("fail", finding)
    assert check.details["wrong_tokens"] > 0


def test_target_layer_id_hypotheses():
    from dflash_audit.batch_audit.ids import check_target_layer_ids, drafter_layer_ids

    def finding(measured, drafter):
        c = check_target_layer_ids(measured, measured, drafter, "test")
        return c.status, c.finding
    assert finding([2, 9, 15], [2, 9, 15]) == ("pass", "")
    assert finding([1, 8, 14], [2, 9, 15]) == ("fail", "zlab ids read as speculators ids")
    assert finding([3, 10, 16], [2, 9, 15]) == ("fail", "speculators ids read as zlab ids")
    assert finding([2, 15, 27], [2, 9, 15]) == ("fail", "count collision")
    assert finding([2, 15], [2, 9, 15]) == ("fail", "count mismatch")
    zlab = {"dflash_config": {"target_layer_ids": [1, 8, 14]}}
    assert drafter_layer_ids(zlab, None, 30)[0] == [2, 9, 15]
    assert drafter_layer_ids({"aux_hidden_state_layer_ids": [2, 9]}, None, 30)[0] == [2, 9]
    assert drafter_layer_ids(None, None, 30) == (None, "no --drafter-config or --profile", False)


def test_mask_token_hypotheses(tiny):
    from dflash_audit.batch_audit.ids import check_mask_token

    tok, rows = tiny.tokenizer, tiny.embedding_rows
    data = [torch.tensor([5, 6, 7, 270])]
    spare = len(tok)  # a spare embedding row: never produced by the tokenizer
    assert check_mask_token(spare, None, tok, rows, data).status == "pass"
    assert check_mask_token(None, None, tok, rows, data).status == "skip"
    assert check_mask_token(tok.eos_token_id, None, tok, rows, data).finding.startswith(
        "mask token is")
    assert check_mask_token(7, None, tok, rows, data).finding == "mask token in data"
    assert check_mask_token(rows, None, tok, rows, data).finding == "mask token out of range"
    assert check_mask_token(spare, spare + 1, tok, rows, data).finding == "mask token disagrees"


def test_bf16_reference_folder_is_compared_in_bf16(tiny, good, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    ref = tmp_path / "ref"
    shutil.copytree(good / "reference", ref)
    for f in (ref / "hidden_states").glob("hs_*.safetensors"):
        t = load_file(str(f))
        save_file({"hidden_states": t["hidden_states"].to(torch.bfloat16),
                   "token_ids": t["token_ids"]}, str(f))
    report = run_check_batches(ref, tiny, rows_to_check=2, progress=False)
    assert report.context["files_precision"] == "bfloat16"
    assert report.exit_code == 0, failed(report)
    layer = [c for c in report.checks if c.name == "verifier_last_hidden_states"][0]
    assert layer.details["dtype"] == "bfloat16" and 0 < layer.details["error"] < 0.05


@pytest.mark.parametrize("damage, finding", [("nan", "non-finite"), ("int32", "dtype int32")])
def test_nan_and_integer_hidden_states_are_named_before_layer_matching(tiny, good, tmp_path,
                                                                       damage, finding):
    """In the reference format (bf16 allowed there, train does not read it), NaN hidden states
    are not "layer 0" (a NaN distance), and int32 ones are named by their dtype: each fails on
    its own name, before any matching. In our format train refuses both: check-batches
    refuses them (exit 2) with train's very words."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_audit.data.batch import Batch
    from dflash_audit.data.errors import BatchFileError

    ref = tmp_path / "ref"
    shutil.copytree(good / "reference", ref)
    for f in (ref / "hidden_states").glob("hs_*.safetensors"):
        t = load_file(str(f))
        hs = t["hidden_states"]
        if damage == "nan":
            hs[5, 0, :] = float("nan")
        else:
            hs = hs.round().to(torch.int32)
        save_file({"hidden_states": hs, "token_ids": t["token_ids"]}, str(f))
    report = run_check_batches(ref, tiny, rows_to_check=1, progress=False)
    assert report.exit_code == 1
    bad = [c for c in report.failures if c.finding == finding]
    assert bad, failed(report)
    text = " ".join(c.message for c in bad)
    assert ("NaN" in text and "first at token 5" in text) if damage == "nan" else "int32" in text
    assert not any(c.finding.startswith("layer") for c in bad)

    rows = broken_script("_batches").read_folder(good)
    for _, t, _ in rows:
        if damage == "nan":
            t["hidden_states"][0, 5, :] = float("nan")
        else:
            t["verifier_last_hidden_states"] = t["verifier_last_hidden_states"].round().to(
                torch.int32)
    ours = broken_script("_batches").write_folder(rows, tmp_path / damage)
    with pytest.raises(BatchFileError) as train_refusal:
        Batch.load(ours / "batch_00000.safetensors")
    with pytest.raises(BatchFileError) as refused:
        run_check_batches(ours, tiny, rows_to_check=1, progress=False)
    assert str(refused.value) == str(train_refusal.value)
    assert ("NaN, 0 inf; first at position 5" in str(refused.value) if damage == "nan" else
            "dtype torch.int32, expected torch.float32" in str(refused.value))


def _tokens(row, k):
    s, e = row.documents[k]
    return f"tokens {s}-{e - 1}"


@pytest.mark.parametrize("positions", ["continue", "restart"])
def test_a_capture_over_the_packed_row_is_named_cross_document_attention(tiny, tiny_dir, good,
                                                                         tmp_path, positions):
    """One causal forward over the packed row (``model(input_ids=row)``, or the files'
    restarting positions with an all-ones attention mask): the first document equals each
    layer exactly, the later ones only when recomputed over the whole row. Every slice is
    named, and its layer is still measured (the layer-id check passes)."""
    from dflash_audit.batch_audit.files import open_batch_folder
    from dflash_audit.batch_audit.recompute import PACKED_CONTINUE, PACKED_RESTART

    out = broken_script("cross_document_capture").make(good, tmp_path / positions,
                                                       str(tiny_dir), positions=positions)
    report = run_check_batches(out, tiny, rows_to_check=1, progress=False, profile="zlab")
    assert report.exit_code == 1
    assert failed(report) == {(f"hidden_states[{j}]", "cross-document attention")
                              for j in range(5)} | {("verifier_last_hidden_states",
                                                     "cross-document attention")}
    by_name = {c.name: c for c in report.checks}
    assert by_name["target_layer_ids"].status == "pass"
    assert by_name["position_ids"].status == "pass"  # the files' layout is right
    row = open_batch_folder(good).load(0)
    last = by_name["verifier_last_hidden_states"]
    assert last.message.startswith(
        "verifier_last_hidden_states was captured over the packed row with a causal mask "
        "across documents (cross-document attention in the capture; ")
    assert (f"document 0 ({_tokens(row, 0)}) equals layer 8's output per document"
            in last.message)
    assert "later documents [1] do not" in last.message
    assert "each later document's states saw the documents packed before it" in last.message
    plan = {"continue": PACKED_CONTINUE, "restart": PACKED_RESTART}[positions]
    d = last.details
    assert plan in d["capture"] and d["matched"] == "layer 8"
    assert d["packed_recomputes"][plan]["error"] < 1e-6 and d["first_document_error"] < 1e-6
    assert min(d["document_errors_per_document"]) > d["tolerance"]
    # the tiny random model barely uses positions (the two recomputes are far closer than
    # the tolerance): the message says it cannot tell them apart instead of guessing
    # (SmolLM2 tells them apart: test_batch_audit_smollm2.py)
    assert len(d["capture"]) == 2 and "the evidence does not tell which" in last.message
    if positions == "continue":  # a second cause on the same slices is named too
        both = run_check_batches(out, tiny, rows_to_check=1, progress=False,
                                 target_layer_ids=[3, 4, 5, 6, 7])
        first = [c for c in both.failures if c.name == "hidden_states[0]"][0]
        assert first.finding == "cross-document attention"
        assert first.message.endswith("; and it is layer 2's output where the files say "
                                      "layer 3")


@pytest.mark.parametrize("damage", ["later documents", "every document"])
def test_no_layer_says_what_the_documents_showed_and_claims_no_cause(tiny, good, tmp_path,
                                                                     damage):
    """States that no capture over the row explains stay ``no layer``: the message gives the
    per-document evidence when the first document matches, and none when it does not."""
    from dflash_audit.batch_audit.files import open_batch_folder

    rows = broken_script("_batches").read_folder(good)
    for _, t, _ in rows:
        where = t["document_ids"][0] >= (1 if damage == "later documents" else 0)
        for k in ("hidden_states", "verifier_last_hidden_states"):
            t[k][0, where] *= 1.5
    out = broken_script("_batches").write_folder(rows, tmp_path / "scaled")
    report = run_check_batches(out, tiny, rows_to_check=1, progress=False)
    assert {c.finding for c in report.failures} == {"no layer"}
    last = [c for c in report.failures if c.name == "verifier_last_hidden_states"][0]
    row = open_batch_folder(good).load(0)
    evidence = (f"; document 0 ({_tokens(row, 0)}) equals layer 8's output per document")
    if damage == "later documents":
        assert evidence in last.message
        assert ("later documents [1] do not" in last.message and "nor over the packed row "
                "with a causal mask (positions counting on or restarting)" in last.message)
        assert "cross-document" not in last.message and "captured over" not in last.message
        assert "another verifier" not in last.message  # document 0 is this verifier's
    else:
        assert "document 0" not in last.message
        assert last.message.endswith("(another verifier or weights, wrong positions, or a "
                                     "different dtype)")


def _zlab_config(tmp_path, name, **top):
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
           "num_hidden_layers": 5, "num_target_layers": 8, "hidden_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "vocab_size": 300, "rms_norm_eps": 1e-6, "dflash_config": {"mask_token_id": 260}}
    cfg.update(top)
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


def test_check_batches_and_compare_read_a_drafter_configs_ids_alike(tmp_path):
    """One reading for both commands: ids in dflash_config or at the top level (z-lab + 1),
    none (z-lab's build_target_layer_ids, said as computed), speculators' own key."""
    from dflash_audit.batch_audit.ids import drafter_layer_ids
    from dflash_audit.profile import Profile

    configs = {
        "dflash_config": _zlab_config(tmp_path, "a", dflash_config={
            "mask_token_id": 260, "target_layer_ids": [1, 3, 5]}, num_hidden_layers=3),
        "top level": _zlab_config(tmp_path, "b", target_layer_ids=[1, 3, 5],
                                  num_hidden_layers=3),
        "computed": _zlab_config(tmp_path, "c", num_hidden_layers=1),
        "computed, five": _zlab_config(tmp_path, "d"),
    }
    expected = {"dflash_config": ([2, 4, 6], False), "top level": ([2, 4, 6], False),
                "computed": ([5], True), "computed, five": ([2, 3, 4, 5, 6], True)}
    for key, path in configs.items():
        ids, origin, computed = drafter_layer_ids(json.loads(path.read_text()), None, 8,
                                                  str(path))
        profile = Profile.load(str(path))
        assert (ids, computed) == expected[key], key
        assert list(profile.target_layers) == ids and profile.target_layers_origin == origin
        # --profile config.json in check-batches says the same origin
        assert drafter_layer_ids(None, profile, 8)[1:] == (f"profile {profile.name}: {origin}",
                                                           computed)
    origin = drafter_layer_ids(json.loads(configs["computed"].read_text()), None, 8,
                               str(configs["computed"]))[1]
    assert origin == (f"computed, not read: {configs['computed']} names no target_layer_ids, "
                      "so z-lab's rule build_target_layer_ids(num_target_layers=8, "
                      "num_hidden_layers=1) = [4] (z-lab ids), + 1")
    assert drafter_layer_ids(json.loads(configs["top level"].read_text()), None, 8, "x")[1] == (
        "read from x top-level target_layer_ids (z-lab ids [1, 3, 5], + 1)")
    # what one refuses, the other refuses in the same words (exit 2 in both commands)
    from dflash_audit.data.errors import DataError
    from dflash_audit.profile import ProfileError

    for bad, words in [({"target_layer_ids": 5}, "target_layer_ids = 5 is not a list of ids"),
                       ({"num_target_layers": None}, "neither target_layer_ids nor "
                                                     "num_target_layers")]:
        path = _zlab_config(tmp_path, f"bad{len(words)}", **bad)
        with pytest.raises(DataError, match=words):
            drafter_layer_ids(json.loads(path.read_text()), None, 8, str(path))
        with pytest.raises(ProfileError, match=words):
            Profile.load(str(path))


def test_computed_ids_are_said_by_check_batches_and_by_compare(tiny_dir, good, tmp_path,
                                                               capsys):
    """check-batches no longer skips a z-lab config without target_layer_ids: it checks the
    ids z-lab computes (one draft layer: [N//2] + 1 = [5], a count mismatch with the five
    slices) and says on the terminal and in every report that they were computed; compare's
    terminal and report.md say the same line for the same config."""
    from dflash_audit.audit.compare_cli import _say_computed_ids
    from dflash_audit.cli import app
    from dflash_audit.profile import Profile
    from dflash_audit.report.markdown import render_markdown
    from test_report import make_report

    path = _zlab_config(tmp_path, "one-layer", num_hidden_layers=1)
    note = (f"target layer ids [5]: computed, not read: {path} names no target_layer_ids, so "
            "z-lab's rule build_target_layer_ids(num_target_layers=8, num_hidden_layers=1) = "
            "[4] (z-lab ids), + 1")
    res = CliRunner().invoke(app, ["check-batches", str(good), "--verifier", str(tiny_dir),
                                   "--rows-to-check", "1", "--drafter-config", str(path),
                                   "--out", str(tmp_path / "r")])
    assert res.exit_code == 1, res.output
    assert f"note: {note}" in res.output
    assert "FAIL [count mismatch] folder: the drafter reads 1 target layers [5] (computed" \
        in res.output
    (folder,) = (tmp_path / "r").iterdir()
    report = json.loads((folder / "report.json").read_text())
    assert report["notes"] == [note] and report["findings"] == ["count mismatch"]
    assert f"- **note**: {note}" in (folder / "report.md").read_text()
    assert note in (folder / "report.html").read_text().replace("&#x27;", "'")
    assert f'name="note" value="{note}"' in (folder / "junit.xml").read_text().replace(
        "&#x27;", "'")

    fields = Profile.load(str(path)).to_dict()
    _say_computed_ids(fields)
    assert capsys.readouterr().out == f"  note: {note}\n"
    compare = make_report({})
    compare.profile["fields"] = fields
    assert f"Target layer ids [5]: {note.split(': ', 1)[1]}." in render_markdown(compare)
    _say_computed_ids(Profile.load("zlab").to_dict())  # a built-in profile: nothing to say
    assert capsys.readouterr().out == ""
