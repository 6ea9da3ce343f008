"""`dflash-audit train` / `eval` end to end, exit codes, and SIGINT/SIGTERM checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import train_tiny as tt
from typer.testing import CliRunner

from dflash_audit.cli import app
from dflash_audit.limits import limit_s
from dflash_audit.train.state import load_training_state

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def paths(tiny_run):
    return tiny_run


def _args(paths, out, *extra):
    return ["train", "--out", str(out), "--verifier", str(paths["verifier"]), "--batches",
            str(paths["batches"]), "--profile", str(paths["profile"]), "--reports-dir",
            str(paths["reports"]), "--lr", "3e-3", "--warmup-steps", "2", "--no-progress",
            "--no-tensorboard", *extra]


def test_train_refused_without_report_exit_2(paths, tmp_path):
    args = _args(paths, tmp_path / "out", "--steps", "2")
    args[args.index("--reports-dir") + 1] = str(tmp_path / "none")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "training refused" in result.output and "dflash-audit compare" in result.output
    assert not (tmp_path / "out").exists()


def test_train_then_eval_through_the_cli(paths, tmp_path, reference_identity):
    reports = tmp_path / "reports"
    tt.write_report(reports, paths["profile"], reference=reference_identity.to_dict(),
                    canary_from=(paths["verifier"], paths["batches"]))
    args = _args(paths, tmp_path / "run", "--steps", "3", "--no-eval")
    args[args.index("--reports-dir") + 1] = str(reports)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert (checkpoint / "model.safetensors").is_file()

    def evaluate(path):
        out = tmp_path / "eval.json"
        result = CliRunner().invoke(app, ["eval", "--checkpoint", str(path), "--data",
                                          str(paths["conversations"]), "--exclude-batches",
                                          str(paths["batches"]), "--prompts", "3",
                                          "--max-new-tokens", "8", "--out", str(out)])
        assert result.exit_code == 0, result.output
        return result, json.loads(out.read_text())

    result, evaluated = evaluate(checkpoint)
    assert evaluated["prompts"] == 3 and evaluated["generated_tokens"] == 24
    assert 1.0 <= evaluated["acceptance_length"] <= 4.0
    assert "acceptance length" in result.output
    # progress on a non-TTY: a line (at most every 10 s, and at the end) with tokens done,
    # prompts, the running acceptance length and tokens/s
    assert "eval: tokens: 24/24" in result.output and "3/3 prompts, acceptance" in result.output
    # the latest pointer, and the run folder, mean the checkpoint it names
    for pointer in (tmp_path / "run" / "checkpoints" / "latest", tmp_path / "run"):
        _, again = evaluate(pointer)
        assert again["drafter"] == evaluated["drafter"] == str(checkpoint)
        assert again["acceptance_length"] == evaluated["acceptance_length"]
    result = CliRunner().invoke(app, ["eval", "--untrained", "--profile", str(paths["profile"]),
                                      "--verifier", str(paths["verifier"]), "--data",
                                      str(paths["conversations"]), "--exclude-batches",
                                      str(paths["batches"]), "--prompts", "2",
                                      "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["eval"])
    assert result.exit_code == 2 and "exactly one of --checkpoint" in result.output


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import train_tiny as tt
    from dflash_audit.train.loop import train
    paths = {{k: Path(v) for k, v in {paths!r}.items()}}
    cfg = tt.tiny_config(paths, {out!r}, steps=100000, save_every=100000)
    summary = train(cfg, reference_identity=tt.REFERENCE)
    sys.exit(summary.exit_code)
""")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_checkpoint_before_exiting(paths, tmp_path, sig, code):
    out = tmp_path / "sig"
    script = SCRIPT.format(tests=str(TESTS), paths={k: str(v) for k, v in paths.items()},
                           out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0]
    os.kill(proc.pid, sig)
    output, _ = proc.communicate(timeout=limit_s(120))
    assert proc.returncode == code, output
    steps = len(metrics.read_text().splitlines())
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{steps:08d}"
    state = load_training_state(out / "checkpoints" / latest)
    assert state["step"] == steps >= 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == sig.name and summary["step"] == steps
