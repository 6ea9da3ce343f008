"""The training loop on a tiny verifier: exact resume, checkpoint contents, gate, online
capture, draft vocabulary, evaluation at the ends of training."""

from __future__ import annotations

import json

import pytest
import torch
import train_tiny as tt
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_audit.model.checkpoint import load_pretrained
from dflash_audit.train.gate import GateError
from dflash_audit.train.loop import TrainError, train
from dflash_audit.train.state import ResumeError, load_training_state
from dflash_audit.train.track import loss_curve


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tt.setup_run(tmp_path_factory.mktemp("tiny"))


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(f"{checkpoint}/model.safetensors")


def _losses(out) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["kind"] == "train"]


def test_resume_continues_exactly(paths, tmp_path):
    straight = train(tt.tiny_config(paths, tmp_path / "a", steps=6, save_every=2),
                     reference_identity=tt.REFERENCE)
    assert straight.step == 6 and straight.stopped_by is None
    first = train(tt.tiny_config(paths, tmp_path / "b", steps=6, stop_at=3),
                  reference_identity=tt.REFERENCE)
    assert first.step == 3 and first.stopped_by == "stop_at" and first.exit_code == 0
    resumed = train(tt.tiny_config(paths, tmp_path / "b", steps=6, resume="latest"),
                    reference_identity=tt.REFERENCE)
    assert resumed.step == 6 and resumed.checkpoint.endswith("step-00000006")

    a, b = _weights(straight.checkpoint), _weights(resumed.checkpoint)
    assert a.keys() == b.keys() and "fc.weight" in a and "layers.0.mlp.up_proj.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa = load_training_state(straight.checkpoint)
    sb = load_training_state(resumed.checkpoint)
    for oa, ob in zip(sa["optimizers"], sb["optimizers"]):
        for k, st in oa["state"].items():
            assert torch.equal(st["exp_avg"], ob["state"][k]["exp_avg"])
            assert torch.equal(st["exp_avg_sq"], ob["state"][k]["exp_avg_sq"])
    assert sa["schedulers"] == sb["schedulers"]
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")  # steps 1-3, then 4-6
    # the resumed run's loss curve spans the whole run, steps 1-6, like the straight one
    assert resumed.loss_curve == straight.loss_curve
    assert [(w["first_step"], w["loss"]) for w in straight.loss_curve] == \
        list(zip(range(1, 7), _losses(tmp_path / "a")))
    # save_every=2, keep 2: steps 4 and 6 remain
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step-*")) == \
        ["step-00000004", "step-00000006"]
    assert (tmp_path / "a" / "checkpoints" / "latest").read_text().strip() == "step-00000006"


def test_checkpoint_carries_report_fingerprint_and_loads(paths, tmp_path):
    summary = train(tt.tiny_config(paths, tmp_path / "run", steps=2, tensorboard=True),
                    reference_identity=tt.REFERENCE)
    report = json.loads(next(paths["reports"].glob("*/report.json")).read_text())
    assert summary.report_fingerprint == report["fingerprint"]
    with safe_open(f"{summary.checkpoint}/model.safetensors", framework="pt") as f:
        meta = f.metadata()
    assert meta["dflash_audit_report_fingerprint"] == report["fingerprint"]
    assert meta["dflash_audit_step"] == "2"
    state = load_training_state(summary.checkpoint)
    assert state["report_fingerprint"] == report["fingerprint"]
    assert state["step"] == 2 and state["run"]["seed"] == 0
    config = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" /
                         "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["speculators_config"]["verifier"]["name_or_path"] == \
        str(paths["verifier"].resolve())
    assert config["aux_hidden_state_layer_ids"] == tt.TARGET_LAYERS
    assert config["block_size"] == 4
    model = load_pretrained(summary.checkpoint)  # verifier from config.json
    saved = _weights(summary.checkpoint)
    for name, value in saved.items():
        assert torch.equal(model.state_dict()[name], value)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert {"loss", "acc_1", "acc_2", "acc_3", "full_acc", "eal", "eal_product", "grad_norm",
            "lr"} <= records[0].keys()
    assert 1.0 <= records[0]["eal"] <= 4.0
    assert records[0]["lr"] == [pytest.approx(3e-3 / 2)]  # warmup step 1 of 2
    assert any((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_refuses_a_different_run(paths, tmp_path):
    train(tt.tiny_config(paths, tmp_path / "r", steps=4, stop_at=1),
          reference_identity=tt.REFERENCE)
    with pytest.raises(ResumeError, match=r"lr: checkpoint 0.003, now 0.001"):
        train(tt.tiny_config(paths, tmp_path / "r", steps=4, lr=1e-3, resume="latest"),
              reference_identity=tt.REFERENCE)
    with pytest.raises(ResumeError, match="no checkpoint"):
        train(tt.tiny_config(paths, tmp_path / "empty", resume="latest"),
              reference_identity=tt.REFERENCE)
    # a v1 training state (anchors from a per-rank generator) is named, not misread
    state = load_training_state(tmp_path / "r" / "checkpoints" / "step-00000001")
    (tmp_path / "v1").mkdir()
    torch.save({**state, "version": 1}, tmp_path / "v1" / "training_state.pt")
    with pytest.raises(ResumeError, match="older dflash-audit .training state v1: anchors"):
        load_training_state(tmp_path / "v1")


def test_gate_refuses_before_any_work(paths, tmp_path):
    cfg = tt.tiny_config(paths, tmp_path / "out", reports_dir=str(tmp_path / "no-reports"))
    with pytest.raises(GateError) as err:
        train(cfg, reference_identity=tt.REFERENCE)
    assert err.value.exit_code == 2
    assert (f"dflash-audit compare --profile {paths['profile']} --verifier {paths['verifier']}"
            " --out ") in str(err.value)
    assert not (tmp_path / "out").exists()
    other = tt.write_profile(tmp_path / "other.toml", block_size=5)
    cfg = tt.tiny_config(paths, tmp_path / "out", profile=str(other))
    with pytest.raises(GateError, match="profile differs"):
        train(cfg, reference_identity=tt.REFERENCE)


def test_loss_goes_down_and_evaluation_runs(paths, tmp_path):
    summary = train(tt.tiny_config(paths, tmp_path / "e", steps=12, eval_at_end=True,
                                   eval_untrained=True, eval_data=str(paths["conversations"])),
                    reference_identity=tt.REFERENCE)
    losses = _losses(tmp_path / "e")
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0]
    for name in ("untrained", "trained"):
        result = summary.eval[name]
        assert result["prompts"] == 4 and result["verify_steps"] > 0
        assert 1.0 <= result["acceptance_length"] <= 4.0
    evals = [json.loads(x) for x in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in x]
    assert [(e["name"], e["step"]) for e in evals] == [("untrained", 0), ("trained", 12)]
    assert json.loads((tmp_path / "e" / "summary.json").read_text())["step"] == 12
    # curves.png: the two panels of the run, drawn with its own numbers
    from PIL import Image

    from dflash_audit.train.plot import running_mean

    assert summary.plot == str(tmp_path / "e" / "curves.png")
    with Image.open(summary.plot) as image:
        assert image.format == "PNG" and image.size == (800, 640)
        colors = {c for _, c in image.convert("RGB").getcolors(1 << 20)}
    assert (31, 119, 180) in colors and (255, 127, 14) in colors  # loss, acceptance lines
    assert (44, 160, 44) in colors  # the held-out evaluation points
    assert running_mean([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]


def test_ctrl_c_during_the_final_evaluation_keeps_the_checkpoint_and_summary(paths, tmp_path,
                                                                              monkeypatch):
    """SIGINT while the trained drafter is evaluated (minutes on 2 busy cores): the run ends
    as stopped by SIGINT (exit code 130), its last checkpoint and summary.json are written,
    and no evaluation result is claimed (a newcomer got a blank line and no summary)."""
    import dflash_audit.train.loop as loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate_drafter", interrupted)
    out = tmp_path / "i"
    summary = train(tt.tiny_config(paths, out, steps=2, eval_at_end=True,
                                   eval_data=str(paths["conversations"])),
                    reference_identity=tt.REFERENCE)
    assert (summary.stopped_by, summary.exit_code, summary.step) == ("SIGINT", 130, 2)
    assert summary.checkpoint and (out / "checkpoints" / "latest").exists()
    saved = json.loads((out / "summary.json").read_text())
    assert saved["stopped_by"] == "SIGINT" and saved["eval"] == {}


def test_online_capture_with_muon(paths, tmp_path):
    cfg = tt.tiny_config(paths, tmp_path / "o", batches=None, data=str(paths["conversations"]),
                         seq_len=128, steps=3, optimizer="muon", online_chunk=8,
                         eval_conversations=10)
    summary = train(cfg, reference_identity=tt.REFERENCE)
    assert summary.step == 3 and summary.last_loss is not None
    state = load_training_state(summary.checkpoint)
    assert state["ranks"][0]["data"]["kind"] == "online"
    assert state["run"]["optimizer"] == "muon" and len(state["optimizers"]) == 2
    with pytest.raises(ResumeError, match="steps: checkpoint 3, now 4"):
        train(tt.tiny_config(paths, tmp_path / "o", batches=None,
                             data=str(paths["conversations"]), seq_len=128, steps=4,
                             optimizer="muon", online_chunk=8, eval_conversations=10,
                             resume="latest"), reference_identity=tt.REFERENCE)


def test_draft_vocabulary_profile(tmp_path):
    paths = tt.setup_run(tmp_path, rows=2, draft_vocab_size=40)
    summary = train(tt.tiny_config(paths, tmp_path / "dv", steps=2),
                    reference_identity=tt.REFERENCE)
    saved = _weights(summary.checkpoint)
    assert saved["t2d"].sum() == 40 and saved["d2t"].shape == (40,)
    assert saved["lm_head.weight"].shape == (40, 32)
    ids = torch.arange(40) + saved["d2t"]
    assert torch.equal(saved["t2d"].nonzero().flatten(), ids)


def test_exactly_one_data_source(paths, tmp_path):
    with pytest.raises(TrainError, match="exactly one of --batches"):
        train(tt.tiny_config(paths, tmp_path / "x", data="chitchat"),
              reference_identity=tt.REFERENCE)


def test_loss_curve_means_windows_and_takes_the_last_line_of_a_relogged_step(tmp_path):
    lines = [{"kind": "train", "step": s, "loss": float(s)} for s in range(1, 8)]
    lines.insert(3, {"kind": "eval", "step": 3, "name": "untrained", "acceptance_length": 1.0})
    lines.append({"kind": "train", "step": 7, "loss": 70.0})  # step 7 again after a resume
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"kind": "tra'  # cut by a kill
    (tmp_path / "metrics.jsonl").write_text(text)
    curve = loss_curve(tmp_path / "metrics.jsonl", windows=3)
    assert curve == [{"first_step": 1, "last_step": 2, "loss": 1.5},
                     {"first_step": 3, "last_step": 4, "loss": 3.5},
                     {"first_step": 5, "last_step": 7, "loss": (5 + 6 + 70) / 3}]
    assert loss_curve(tmp_path / "missing.jsonl") == []


def test_a_damaged_metrics_file_is_read_not_raised(tmp_path):
    # an edited or damaged metrics.jsonl (JSON that is not an object, a byte cut inside a
    # character, a step that is a string, a bool or null, NaN / inf losses) must not turn
    # the end of a finished run into a traceback: loss_curve and curves.png skip such lines
    from dflash_audit.train.plot import plot_run

    good = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s, "eal": 1.5})
            for s in range(1, 5)]
    bad = ["[1, 2]", "3", "null", '"text"', json.dumps({"kind": "train", "step": "5"}),
           json.dumps({"kind": "train", "step": True, "loss": 99.0}),
           '{"kind": "train", "step": 6, "loss": NaN, "eal": Infinity}',
           json.dumps({"kind": "eval", "step": None, "acceptance_length": 2.0}),
           json.dumps({"kind": "eval", "step": "4", "acceptance_length": 2.0})]
    (tmp_path / "metrics.jsonl").write_bytes(
        ("\n".join(good + bad) + "\n").encode() + b'{"kind": "train", "step": 7, "x": "\xe2\x82')
    curve = loss_curve(tmp_path / "metrics.jsonl", windows=1)
    assert curve[0]["first_step"] == 1 and curve[0]["last_step"] == 6  # True is not step 1
    assert plot_run(tmp_path) == tmp_path / "curves.png"


def test_a_full_disk_at_the_picture_is_a_warning_not_the_runs_failure(paths, tmp_path,
                                                                      monkeypatch, capsys):
    # curves.png is drawn from metrics.jsonl after the last checkpoint: ENOSPC there must not
    # turn a finished run into exit 2 without summary.json
    import errno

    import matplotlib.figure

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    summary = train(tt.tiny_config(paths, tmp_path / "full", steps=2),
                    reference_identity=tt.REFERENCE)
    assert summary.exit_code == 0 and summary.step == 2 and summary.plot is None
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["step"] == 2
    assert not list((tmp_path / "full").glob("*curves.png*"))
    assert f"{tmp_path / 'full' / 'curves.png'} not written (No space left" in (
        capsys.readouterr().err)


def test_metrics_lines_that_parse_but_are_not_records_are_skipped(tmp_path):
    """A damaged metrics.jsonl (a line that parses as a list or a number, a step that is a
    string or a boolean, bytes that are not UTF-8) is read around, not a traceback at the
    end of train; curves.png draws the good lines only."""
    from dflash_audit.train.plot import plot_run
    from dflash_audit.train.track import read_metrics

    good = [{"kind": "train", "step": s, "loss": 4.0 / s, "eal": 1.0 + s / 10}
            for s in range(1, 5)]
    bad = ["[1, 2, 3]", "7", '"text"', "null",
           json.dumps({"kind": "train", "step": "2", "loss": 99.0}),
           json.dumps({"kind": "train", "step": True, "loss": 99.0}),
           json.dumps({"kind": "eval", "step": "abc", "name": "x", "acceptance_length": 1.5})]
    data = "\n".join([json.dumps(good[0]), *bad, *(json.dumps(g) for g in good[1:])]) + "\n"
    (tmp_path / "metrics.jsonl").write_bytes(data.encode() + b"\xff\xfe{\n")
    train, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert sorted(train) == [1, 2, 3, 4] and train[1]["loss"] == 4.0 and train[2]["loss"] == 2.0
    assert evals == []
    assert [w["loss"] for w in loss_curve(tmp_path / "metrics.jsonl", windows=4)] == \
        [4.0, 2.0, 4.0 / 3, 1.0]
    assert plot_run(tmp_path) == tmp_path / "curves.png"
