"""Data-parallel training on CPU: `torchrun --nproc_per_node=2` with DDP on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import train_tiny as tt
from safetensors.torch import load_file

from dflash_audit.candidate import load_candidate
from dflash_audit.limits import limit_s
from dflash_audit.model.checkpoint import config_from_reference
from dflash_audit.train.loop import build_drafter, train
from dflash_audit.train.state import load_training_state

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import train_tiny as tt
    from dflash_audit.train.loop import train
    paths = {{k: Path(v) for k, v in {paths!r}.items()}}
    summary = train(tt.tiny_config(paths, {out!r}, steps=2), reference_identity=tt.REFERENCE)
    # one file per rank: two ranks printing to one stdout interleave their lines
    Path({out!r}, "rank-" + os.environ["RANK"]).write_text(str(summary.step))
""")


def torchrun_two_ranks(tmp_path: Path, template: str) -> tuple[dict[str, Path], Path]:
    """``template`` (formatted with tests, out, paths) run by torchrun on 2 CPU ranks over a
    tiny run's data; returns (the run's paths, its out folder). Fails on a non-zero exit."""
    paths = tt.setup_run(tmp_path, rows=4)
    out = tmp_path / "ddp"
    script = tmp_path / "run_ddp.py"
    script.write_text(template.format(tests=str(TESTS), out=str(out),
                                      paths={k: str(v) for k, v in paths.items()}))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script)], capture_output=True, text=True, timeout=limit_s(300),
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return paths, out


def test_torchrun_two_ranks_agree_on_weights(tmp_path):
    paths, out = torchrun_two_ranks(tmp_path, SCRIPT)
    assert [(out / f"rank-{r}").read_text() for r in (0, 1)] == ["2", "2"]

    checkpoint = out / "checkpoints" / "step-00000002"
    state = load_training_state(checkpoint)
    assert state["world_size"] == 2 and state["run"]["world_size"] == 2
    digests = state["weights_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # both ranks hold the same weights
    r0, r1 = state["ranks"]
    assert r0["data"]["step"] == r1["data"]["step"] == 2
    # one metrics line per step, written by rank 0 only
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["supervised"] > 0
    # training moved the weights away from the seeded initialization
    from transformers import AutoModelForCausalLM  # not at collection: ~3 s

    verifier = AutoModelForCausalLM.from_pretrained(paths["verifier"])
    config = config_from_reference(json.loads((checkpoint / "config.json").read_text()), 4)
    init = build_drafter(load_candidate(None), config, verifier, seed=0)
    saved = load_file(checkpoint / "model.safetensors")
    assert not torch.equal(saved["fc.weight"], init.fc.weight)
    # each row's anchors come from the row's own key: one process reading both ranks' rows
    # per step (rows_per_step=2) trains the same drafter, up to fp32 reduction order
    single = train(tt.tiny_config(paths, tmp_path / "single", steps=2, rows_per_step=2),
                   reference_identity=tt.REFERENCE)
    alone = load_file(Path(single.checkpoint) / "model.safetensors")
    assert alone.keys() == saved.keys()
    for key in saved:
        torch.testing.assert_close(alone[key], saved[key], rtol=1e-5, atol=1e-6)
    assert [json.loads(x)["loss"] for x in (tmp_path / "single" / "metrics.jsonl").read_text()
            .splitlines()] == pytest.approx([r["loss"] for r in lines], rel=1e-5)


RAISES_AFTER_DDP = textwrap.dedent("""
    import gc, os, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import train_tiny as tt
    from dflash_audit.train import loop
    paths = {{k: Path(v) for k, v in {paths!r}.items()}}
    destroy = dist.destroy_process_group

    def counted(*args, **kwargs):  # the DDP wrappers still alive when the group goes
        gc.collect()
        live = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        Path({out!r}, "live-" + os.environ["RANK"]).write_text(str(live))
        destroy(*args, **kwargs)

    def tracker(*args, **kwargs):  # fails after the DDP wrapper exists, before the loop
        raise OSError("tensorboard folder not writable")

    dist.destroy_process_group, loop.Tracker = counted, tracker
    Path({out!r}).mkdir(parents=True, exist_ok=True)
    try:
        loop.train(tt.tiny_config(paths, {out!r}, steps=2), reference_identity=tt.REFERENCE)
    except OSError:
        pass
""")


def test_ddp_wrapper_is_released_before_the_group_on_an_early_error(tmp_path):
    """A run that fails after the DDP wrapper is built but before its loop (the canary's
    refusal, an unwritable tensorboard folder) still releases the wrapper before
    destroy_process_group: its reducer, alive there, holds the group into interpreter exit,
    where a gloo rank can abort ("terminate called without an active exception")."""
    _, out = torchrun_two_ranks(tmp_path, RAISES_AFTER_DDP)
    assert [(out / f"live-{r}").read_text() for r in (0, 1)] == ["0", "0"]
