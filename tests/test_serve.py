"""serve-check's own parts on real inputs: the attention rule of one drafting step, the
reference's reading of a checkpoint (``reference/serve_probe.py`` in the real reference's
process) against our drafter's, the field comparison and its wording, the report files, and
the bad inputs of the command (one line, exit 2)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from cli_zygote import run_cli
from serve_support import edit_config, make_checkpoint

from dflash_audit.serve.attention import rule_differences, rule_of, serving_mask, window_origin
from dflash_audit.serve.checkpoint import read_checkpoint
from dflash_audit.serve.differences import (
    DIFFERS,
    SAME,
    WARN,
    compare,
    complete_from_masks,
    layer_rules,
)
from dflash_audit.serve.fields import SideRecord
from dflash_audit.serve.report import ServeReport, write_report
from dflash_audit.serve.trained import ours, probe_block

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ attention rule
def test_serving_mask_counts_the_window_from_the_anchor_or_from_each_query():
    B, W = 4, 8
    anchor, T = probe_block(B, W)
    row, at = torch.zeros(T, dtype=torch.long), torch.tensor([anchor])
    by_anchor = rule_of(serving_mask(row, at, B, W, True, "anchor"), anchor, T)
    by_query = rule_of(serving_mask(row, at, B, W, True, "query"), anchor, T)
    assert by_anchor["context"] == [[-8, -1]] * 4
    assert by_query["context"] == [[-7, -1], [-6, -1], [-5, -1], [-4, -1]]
    assert window_origin(by_anchor, W) == "anchor" and window_origin(by_query, W) == "query"
    assert by_anchor["slots"] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert by_anchor["block_causal"] is True
    full = rule_of(serving_mask(row, at, B, None, False, None), anchor, T)
    assert full["context"] == [["start", -1]] * 4 and full["block_causal"] is False
    with pytest.raises(ValueError, match="window_origin"):
        serving_mask(row, at, B, W, True, "middle")
    # a block of 6 trained, 4 served (the reference read another config file): the slots both
    # have are compared, the block size is its field's row (it crashed, zip strict)
    anchor6, T6 = probe_block(6, W)
    six = rule_of(serving_mask(torch.zeros(T6, dtype=torch.long), torch.tensor([anchor6]), 6, W,
                               True, "query"), anchor6, T6)
    assert len(six["context"]) == 6 and rule_differences(six, by_query) == []
    assert rule_differences(six, by_anchor) == rule_differences(by_query, by_anchor) != []


# ------------------------------------------------- the reference's reading vs ours
VARIANTS = {
    "mixed": {},
    "non-causal window": {"sliding_window_non_causal": True},
    "draft vocab": {"draft_vocab_size": 64},
    "sample from anchor": {"sample_from_anchor": True, "layer_types": None,
                           "sliding_window": None},
    # a Qwen3-size head: float32 frequencies read back as theta gave 999997 for 1e6 (every
    # engine "differed"); a scaled type rescales them (yarn read back as 31604.9)
    "head_dim 128": {"head_dim": 128, "rope_theta": 1e6},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 256}},
}


@pytest.fixture(scope="module")
def reference_readings(reference_zygote, tmp_path_factory):
    """``{variant: (reference record, our record)}`` of each variant's checkpoint."""
    out = {}
    for name, changes in VARIANTS.items():
        folder = make_checkpoint(tmp_path_factory.mktemp("ckpt"), **changes)
        probe = folder.parent / "probe.json"
        done = reference_zygote.run(ROOT / "reference" / "serve_probe.py", [folder, probe],
                                    folder.parent)
        assert done.returncode == 0, done.stdout[-3000:]
        ref = SideRecord.from_dict(json.loads(probe.read_text()))
        mine = ours(read_checkpoint(folder))
        for record in (ref, mine):
            complete_from_masks(record)
        out[name] = (ref, mine)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_reference_and_our_drafter_read_a_checkpoint_alike(reference_readings, variant):
    ref, mine = reference_readings[variant]
    assert ref.refused is None and mine.refused is None
    assert set(ref.fields) == set(mine.fields) - {"dtype"}  # the saved dtype: ours only
    for key, value in ref.fields.items():
        assert json.dumps(mine.fields[key]) == json.dumps(value), key
    for layer, m in ref.masks.items():
        assert mine.masks[layer]["rows"] == m["rows"], layer


def test_the_reference_probe_reads_each_fact_off_the_built_model(reference_readings):
    ref, _ = reference_readings["mixed"]
    f = ref.fields
    assert (f["layers.0.attention"], f["layers.1.attention"]) == ("full", "sliding")
    assert f["layers.0.block_causal"] is False and f["layers.1.block_causal"] is True
    assert f["layers.1.window_origin"] == "anchor" and f["layers.0.window_origin"] is None
    assert f["rope.theta"] == 10000.0 and f["rope.rotary_dim"] == 8
    assert f["fc.in_features"] == 3 * 32 and f["target_layer_ids"] == [1, 3, 4]
    assert f["num_speculative_tokens"] == 3 and f["lm_head.source"] == "target"
    assert reference_readings["non-causal window"][0].fields["layers.1.block_causal"] is False
    wide = reference_readings["head_dim 128"][0].fields
    assert (wide["rope.theta"], wide["rope.rotary_dim"]) == (1e6, 128)
    yarn = reference_readings["yarn"][0].fields
    assert (yarn["rope.type"], yarn["rope.theta"]) == ("yarn", 10000.0)
    assert yarn["rope.scaling"]["factor"] == 4.0
    vocab = reference_readings["draft vocab"][0].fields
    assert vocab["draft_vocab_size"] == 64 and vocab["lm_head.source"] == "checkpoint"
    assert vocab["draft_vocab.mapping"] == "d2t offsets"
    assert reference_readings["sample from anchor"][0].fields["num_speculative_tokens"] == 4


# ------------------------------------------------------- the comparison, worded
def _served_from(trained: SideRecord, **changes) -> SideRecord:
    served = SideRecord("engine X", dict(trained.fields), {k: "engine.py:resolve" for k in
                                                             trained.fields})
    served.fields.update(changes)
    return served


def test_each_changed_field_is_a_named_difference(reference_readings):
    ref, mine = reference_readings["mixed"]
    served = _served_from(ref, **{"rope.theta": 1000000.0, "layers.0.block_causal": True,
                                  "layers.1.window_origin": "query", "rope.max_positions": 1024,
                                  "num_speculative_tokens": 2,
                                  "mask_embedding.source": "mask_embedding.pt"})
    rows = {r.key: r for r in compare(ref, mine, served, "engine X", 4096)}
    stray = rows["mask_embedding.source"]
    assert (stray.status, stray.name) == (DIFFERS, "mask slot embedding replaced")
    assert stray.fix.startswith("remove mask_embedding.pt from the checkpoint folder")
    assert rows["rope.theta"].status == DIFFERS and rows["rope.theta"].name == "RoPE theta"
    assert "1000000.0" in rows["rope.theta"].message and "10000.0" in rows["rope.theta"].message
    assert rows["layers.0.block_causal"].name == "causality inside the block"
    assert rows["rope.max_positions"].status == DIFFERS  # 1024 < the target's 4096
    assert rows["num_speculative_tokens"].status == WARN  # fewer slots: no wrong token
    assert rows["hidden_size"].status == SAME
    covered = compare(ref, mine, served, "engine X", 1024)
    assert {r.key: r for r in covered}["rope.max_positions"].status == SAME
    rules = {r.layer: r for r in layer_rules(ref, served, "engine X")}
    assert rules[0].differences == [f"slot {s} sees block slots {list(range(s + 1))} at "
                                    f"serving, [0, 1, 2, 3] in training" for s in range(3)]
    assert rules[1].differences[0] == "slot 0 sees context a-7..a-1 at serving, a-8..a-1 in " \
                                      "training"


def test_an_unchanged_served_record_is_a_pass_and_every_format_is_written(reference_readings,
                                                                         tmp_path):
    ref, mine = reference_readings["mixed"]
    served = _served_from(ref)
    report = ServeReport("ckpt", "speculators", {"key": "x", "label": "engine X"},
                         compare(ref, mine, served, "engine X", 1024),
                         layer_rules(ref, served, "engine X"))
    assert report.verdict == "pass" and report.exit_code == 0
    folder = write_report(report, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["junit.xml", "report.html",
                                                         "report.json", "report.md"]
    changed = _served_from(ref, **{"layers.1.window_origin": "query"})
    bad = ServeReport("ckpt", "speculators", {"key": "x", "label": "engine X"},
                      compare(ref, mine, changed, "engine X", 1024),
                      layer_rules(ref, changed, "engine X"))
    assert bad.verdict == "fail" and bad.exit_code == 1
    folder = write_report(bad, tmp_path)
    html = (folder / "report.html").read_text()
    assert html.count("<img") == 3 * 2 and "only served" in html
    junit = (folder / "junit.xml").read_text()
    assert 'failures="2"' in junit  # the window_origin field and layer 1's attention
    assert "where the window is counted from" in (folder / "report.md").read_text()


def test_loaders_that_disagree_are_a_warning(reference_readings):
    ref, mine = reference_readings["mixed"]
    other = SideRecord(mine.side, {**mine.fields, "rope.theta": 5.0}, dict(mine.sources))
    rows = [r for r in compare(ref, other, _served_from(ref), "engine X", None)
            if r.name == "loaders disagree"]
    assert [r.key for r in rows] == ["rope.theta (our drafter)"] and rows[0].status == WARN


# ------------------------------------------------------------------ bad inputs
def _no_config(tmp: Path) -> Path:
    folder = make_checkpoint(tmp / "c")
    (folder / "config.json").unlink()
    return folder


BAD = {
    "missing folder": (lambda tmp: tmp / "nowhere", "does not exist"),
    "a file": (lambda tmp: _write(tmp, "file", "x") / "file", "is not a folder"),
    "no config": (_no_config, "has no config.json"),
    "config not JSON": (lambda tmp: _write(make_checkpoint(tmp / "c"), "config.json", "{oops"),
                        "is not JSON"),
    "not a drafter": (lambda tmp: edit_config(make_checkpoint(tmp / "c"),
                                              lambda d: d.pop("speculators_model_type")),
                      "is not a DFlash drafter config"),
    "no weights": (lambda tmp: _unlink(make_checkpoint(tmp / "c"), "model.safetensors"),
                   "has no *.safetensors"),
    "broken weights": (lambda tmp: _write(make_checkpoint(tmp / "c"), "model.safetensors",
                                          "garbage"), "is not a readable safetensors"),
    "config nested too deeply": (lambda tmp: _write(make_checkpoint(tmp / "c"), "config.json",
                                                    "[" * 100_000 + "]" * 100_000),
                                 "nested deeper than 100 levels"),
    "speculators_config a string": (lambda tmp: edit_config(
        make_checkpoint(tmp / "c"), lambda d: d.update(speculators_config="x")),
        "speculators_config is a str, not an object"),
    "transformer_layer_config a list": (lambda tmp: edit_config(
        make_checkpoint(tmp / "c"), lambda d: d.update(transformer_layer_config=[1])),
        "transformer_layer_config is a list, not an object"),
    "config a link loop": (lambda tmp: _link_loop(make_checkpoint(tmp / "c")),
                           "is a link that leads to no file"),
}


def _link_loop(folder: Path) -> Path:
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("config.json")
    return folder


def _write(folder: Path, name: str, text: str) -> Path:
    (folder / name).write_text(text)
    return folder


def _unlink(folder: Path, name: str) -> Path:
    (folder / name).unlink()
    return folder


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_folder_is_one_line_and_exit_2(case, tmp_path):
    make, words = BAD[case]
    folder = make(tmp_path)
    result = run_cli(["serve-check", str(folder), "--engine", "zlab", "--out", str(tmp_path)],
                     tmp_path)
    assert result.returncode == 2, result.stdout
    assert words in result.stdout and "Traceback" not in result.stdout


@pytest.mark.parametrize("engine, words", [("tensorrt", "unknown engine"),
                                           ("vllm==0.30.0", "audits vLLM 0.33.0 only")])
def test_an_unknown_engine_or_version_is_one_line_and_exit_2(engine, words, tmp_path):
    folder = make_checkpoint(tmp_path / "c")
    result = run_cli(["serve-check", str(folder), "--engine", engine], tmp_path)
    assert result.returncode == 2 and words in result.stdout, result.stdout
    assert "Traceback" not in result.stdout


def test_a_verifier_that_is_not_a_model_folder_is_one_line_and_exit_2(tmp_path):
    folder = make_checkpoint(tmp_path / "c")
    result = run_cli(["serve-check", str(folder), "--engine", "zlab", "--verifier",
                      str(tmp_path / "no-model"), "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 2 and "--verifier" in result.stdout, result.stdout
    assert "no config.json there" in result.stdout and "Traceback" not in result.stdout


def test_a_report_that_cannot_be_written_leaves_no_half_folder(reference_readings, tmp_path,
                                                               monkeypatch):
    import dflash_audit.serve.report as report_module

    ref, mine = reference_readings["mixed"]
    served = _served_from(ref)
    report = ServeReport("ckpt", "speculators", {"key": "x", "label": "engine X"},
                         compare(ref, mine, served, "engine X", 1024),
                         layer_rules(ref, served, "engine X"))
    real_write = Path.write_text

    def full_disk(self, text, *a, **k):
        if self.name == "junit.xml":
            raise OSError(28, "No space left on device")  # as a full disk does: no file
        return real_write(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match=str(tmp_path / "out")):
        report_module.write_report(report, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.undo()
    folder = report_module.write_report(report, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == [folder.name]
    assert not folder.name.startswith(".") and (folder / "junit.xml").is_file()


def _children(pid: int, running: str = "") -> list[int]:
    """The child processes of ``pid`` whose command line holds ``running``."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(x) for x in path.read_text().split()] if path.is_file() else []
    out = []
    for kid in kids:
        try:
            if running.encode() in Path(f"/proc/{kid}/cmdline").read_bytes():
                out.append(kid)
        except OSError:
            continue
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_serve_check_leaves_no_probe_running(tmp_path):
    import os
    import signal
    import subprocess
    import time

    folder = make_checkpoint(tmp_path / "c")
    proc = subprocess.Popen([sys.executable, "-m", "dflash_audit.cli", "serve-check", str(folder),
                             "--engine", "zlab", "--no-drafting", "--no-reference-cache",
                             "--out", str(tmp_path / "out")],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (kids := _children(proc.pid, "serve_probe")) and time.monotonic() < deadline:
        assert proc.poll() is None, "serve-check ended before starting the reference's probe"
        time.sleep(0.05)
    assert kids, "no probe started"
    time.sleep(1.0)  # the probe is past its start-up
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{k}").exists() and "zombie" not in _state(k) for k in kids) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and "zombie" not in _state(k)]
    assert not (tmp_path / "out").exists()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0]
    except (OSError, IndexError):
        return "zombie"


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan"])
def test_a_bad_probe_timeout_is_one_line_and_exit_2(value, tmp_path):
    folder = make_checkpoint(tmp_path / "c")
    result = run_cli(["serve-check", str(folder), "--engine", "zlab", "--out", str(tmp_path)],
                     tmp_path, env={"DFLASH_AUDIT_PROBE_TIMEOUT": value})
    assert result.returncode == 2 and "give seconds above 0" in result.stdout, result.stdout
    assert "reading it" not in result.stdout


def test_a_reference_past_the_probe_timeout_names_the_variable(tmp_path):
    from dflash_audit.serve.engines import ENGINES, install_engine

    install_engine(ENGINES["zlab"])  # --offline below needs the install; in random order no
    folder = make_checkpoint(tmp_path / "c")  # other test need have made it yet
    result = run_cli(["serve-check", str(folder), "--engine", "zlab", "--offline",
                      "--no-reference-cache", "--out", str(tmp_path)], tmp_path,
                     env={"DFLASH_AUDIT_PROBE_TIMEOUT": "0.5"})
    assert result.returncode == 2, result.stdout
    assert "raise the limit with DFLASH_AUDIT_PROBE_TIMEOUT=1" in result.stdout
    assert "Traceback" not in result.stdout


def test_an_out_that_is_a_file_is_one_line_and_exit_2_before_any_work(tmp_path):
    folder = make_checkpoint(tmp_path / "c")
    (tmp_path / "afile").write_text("x")
    result = run_cli(["serve-check", str(folder), "--engine", "zlab", "--out",
                      str(tmp_path / "afile")], tmp_path)
    assert result.returncode == 2 and "is a file" in result.stdout, result.stdout
    assert "reading it" not in result.stdout


# ------------------------------------------------- the reference's reading, cached
def test_the_references_reading_is_kept_and_never_trusted_when_changed(tmp_path, monkeypatch):
    """A second reading of the same config.json comes from the signed record the first run
    kept (the same fields and masks, a note naming the record), without the reference's
    process; a record with a changed byte, or another config's record moved into place, is
    not trusted and removed (the next reading runs the probe)."""
    from dflash_audit.reference_source.spec import resolve_reference
    from dflash_audit.report.fingerprint import report_key
    from dflash_audit.serve import reference_record as rr
    from dflash_audit.serve import trained

    monkeypatch.setattr(rr, "records_root", lambda kind: tmp_path / "records" / kind)
    folder = read_checkpoint(make_checkpoint(tmp_path / "c"))
    first = trained.reference(folder)
    (stored,) = (tmp_path / "records" / rr.KIND).iterdir()
    assert not [n for n in first.notes if "from the cache" in n]
    second = trained.reference(folder)
    assert [n for n in second.notes if "from the cache" in n] == [
        f"its reading of this config.json came from the cache (record {stored.name[:12]}, "
        "verified; --no-reference-cache runs it again)"]
    assert (second.fields, second.masks, second.side) == (first.fields, first.masks, first.side)

    key, signing = stored.name, report_key()
    data = json.loads((stored / rr.PROBE_FILE).read_text())
    data["fields"]["block_size"] = 99  # a changed byte: its sha256 is not the signed one
    (stored / rr.PROBE_FILE).write_text(json.dumps(data))
    assert rr.read_probe(key, signing)[0] is None and not stored.exists()  # removed
    other = read_checkpoint(edit_config(make_checkpoint(tmp_path / "d"),
                                        lambda d: d.update(block_size=8)))
    other_key = rr.probe_key(resolve_reference(None), other.path)
    assert other_key != key
    rr.store_probe(key, data, signing)
    stored.rename(stored.with_name(other_key))  # another config's record moved into place
    found, why = rr.read_probe(other_key, signing)
    assert found is None and "its key differs" in why, why
    assert rr.read_probe(key, signing) == (None, "")  # gone from its own place

    # a linked config.json (a Hugging Face snapshot) is keyed by what it links to; one that
    # names configuration_files (transformers then reads another config.*.json) is not cached
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").symlink_to(folder.path / "config.json")
    assert rr.probe_key(resolve_reference(None), linked) == key
    versioned = edit_config(make_checkpoint(tmp_path / "e"),
                            lambda d: d.update(configuration_files=["config.4.0.0.json"]))
    assert rr.probe_key(resolve_reference(None), versioned) is None

    # past MAX_BYTES the least recently used records go: room for one, the newer one stays
    rr.store_probe(key, data, signing)
    (older,) = (tmp_path / "records" / rr.KIND).iterdir()
    monkeypatch.setattr(rr, "MAX_BYTES", sum(p.stat().st_size for p in older.iterdir()) + 64)
    os.utime(older / "record.json", (1, 1))  # used long ago
    rr.store_probe(other_key, data, signing)
    assert [p.name for p in (tmp_path / "records" / rr.KIND).iterdir()] == [other_key]


def test_a_converted_folder_keeps_the_checkpoints_mask_embedding(tmp_path):
    """SGLang's probe reads the adapter's z-lab conversion of a speculators checkpoint (it
    refuses the original): the conversion keeps mask_embedding.pt, file or not, so the
    engine's substitution is seen (hostile review: the field read "same")."""
    from dflash_audit.serve.probes.zlab_probe import write_zlab_folder

    ckpt = make_checkpoint(tmp_path / "ckpt")
    torch.save({"embedding": torch.ones(32), "mask_token_id": 299}, ckpt / "mask_embedding.pt")
    write_zlab_folder(ckpt, tmp_path / "zlab")
    assert (tmp_path / "zlab" / "mask_embedding.pt").read_bytes() == (
        ckpt / "mask_embedding.pt").read_bytes()
    (ckpt / "mask_embedding.pt").unlink()
    (ckpt / "mask_embedding.pt").mkdir()  # SGLang checks os.path.exists (then fails loading)
    write_zlab_folder(ckpt, tmp_path / "zlab2")
    assert (tmp_path / "zlab2" / "mask_embedding.pt").is_dir()
