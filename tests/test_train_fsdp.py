"""`train --fsdp` under `torchrun --nproc_per_node=2` on CPU (gloo): two processes train with
FSDP2, checkpoint, are killed (SIGKILL, both workers and torchrun), resume bit-identically,
and follow the single-process run (rows_per_step=2: the same rows and anchors per step) within
fp32 reduction noise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import train_tiny as tt
from safetensors.torch import load_file

from dflash_audit.limits import limit_s
from dflash_audit.train.loop import TrainError, train
from dflash_audit.train.state import load_training_state

TESTS = Path(__file__).resolve().parent
STEPS = 1000  # the schedule's length; every run stops earlier (killed, or --stop-at)

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import train_tiny as tt
    from dflash_audit.train.loop import train
    paths = {{k: Path(v) for k, v in {paths!r}.items()}}
    train(tt.tiny_config(paths, sys.argv[1], **json.loads(sys.argv[2])),
          reference_identity=tt.REFERENCE)
""")


def _torchrun(script: Path, out: Path, **changes) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(out), json.dumps({"steps": STEPS, "fsdp": True, **changes})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(proc: subprocess.Popen) -> None:
    output, _ = proc.communicate(timeout=limit_s(300))
    assert proc.returncode == 0, output[-4000:]


def _losses(out: Path) -> dict[int, float]:
    """Step -> loss, the last line of a step winning (a resumed run re-logs steps)."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r["loss"] for r in lines if r.get("kind") == "train"}


def test_fsdp_two_ranks_killed_resume_exactly_and_follow_one_process(tmp_path):
    paths = tt.setup_run(tmp_path, rows=8)
    script = tmp_path / "run_fsdp.py"
    script.write_text(SCRIPT.format(tests=str(TESTS),
                                    paths={k: str(v) for k, v in paths.items()}))
    killed = tmp_path / "killed"
    proc = _torchrun(script, killed, save_every=3)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # torchrun and both workers, mid-run (torch's launcher starts each worker in a session
    # of its own, so the process group would miss them)
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.kill()
    output, _ = proc.communicate(timeout=limit_s(60))
    assert latest.is_file(), output[-4000:]
    resumed_from = int(latest.read_text().strip().split("-")[1])
    assert 3 <= resumed_from < STEPS and resumed_from % 3 == 0
    stop = resumed_from + 3

    _finish(_torchrun(script, killed, save_every=3, resume="latest", stop_at=stop))
    straight = tmp_path / "straight"
    _finish(_torchrun(script, straight, save_every=3, stop_at=stop))
    single = train(tt.tiny_config(paths, tmp_path / "single", steps=STEPS, rows_per_step=2,
                                  save_every=3, stop_at=stop), reference_identity=tt.REFERENCE)
    assert single.step == stop

    name = f"step-{stop:08d}"
    a = load_file(killed / "checkpoints" / name / "model.safetensors")
    b = load_file(straight / "checkpoints" / name / "model.safetensors")
    c = load_file(tmp_path / "single" / "checkpoints" / name / "model.safetensors")
    # full (unsharded) state dicts in the reference's format, the single process's keys
    assert a.keys() == b.keys() == c.keys() and "layers.0.self_attn.q_proj.weight" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key  # killed + resumed == uninterrupted, bitwise
        assert a[key].shape == c[key].shape
        torch.testing.assert_close(a[key], c[key], rtol=1e-5, atol=1e-6)  # reduction noise
    state_a = load_training_state(killed / "checkpoints" / name)
    state_b = load_training_state(straight / "checkpoints" / name)
    assert state_a["world_size"] == 2 and state_a["run"]["fsdp"] is True
    assert state_a["step"] == stop and state_a["schedulers"] == state_b["schedulers"]
    moments = [(k, v) for k, v in state_a["optimizers"][0]["state"].items()]
    assert moments and all(torch.equal(v["exp_avg"], state_b["optimizers"][0]["state"][k]
                                       ["exp_avg"]) for k, v in moments)
    # the loss curves: killed + resumed == uninterrupted, and == one process within noise
    la, lb, lc = _losses(killed), _losses(straight), _losses(tmp_path / "single")
    assert sorted(la) == sorted(lb) == sorted(lc) == list(range(1, stop + 1))
    assert la == lb
    assert all(abs(la[s] - lc[s]) <= 1e-5 * max(1.0, abs(lc[s])) for s in lc), (la, lc)
    assert lc[stop] < lc[1]  # it trained
    summary = json.loads((straight / "summary.json").read_text())
    assert (summary["parallel"], summary["world_size"]) == ("fsdp", 2)


def test_fsdp_without_torchrun_is_refused(tmp_path):
    paths = tt.setup_run(tmp_path, rows=2)
    with pytest.raises(TrainError, match="torchrun --nproc_per_node"):
        train(tt.tiny_config(paths, tmp_path / "run", fsdp=True),
              reference_identity=tt.REFERENCE)


def test_fsdp_without_torchrun_is_refused_before_overwrite_removes_the_old_run(tmp_path):
    """The refusal comes before anything is read or removed: `--fsdp --overwrite` outside
    torchrun keeps the run already in --out (it used to delete its checkpoints and metrics
    first, then refuse)."""
    paths = tt.setup_run(tmp_path, rows=2)
    out = tmp_path / "run"
    (out / "checkpoints" / "step-00000004").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000004\n")
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    with pytest.raises(TrainError, match="torchrun --nproc_per_node"):
        train(tt.tiny_config(paths, out, fsdp=True, overwrite=True),
              reference_identity=tt.REFERENCE)
    assert (out / "checkpoints" / "latest").is_file() and (out / "metrics.jsonl").is_file()


def test_overwrite_removes_the_old_runs_curves(tmp_path):
    from dflash_audit.train.state import check_run_folder

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "curves.png").write_bytes(b"old picture")
    check_run_folder(tmp_path, None, overwrite=True)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "curves.png").exists()
