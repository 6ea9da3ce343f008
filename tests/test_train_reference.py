"""Training against the real reference (speculators 0.9.0): our checkpoints load in its
``DFlashDraftModel.from_pretrained`` with the same logits, and its model trained in our loop
follows our loss curve (benchmarks/bench_trajectory.py on the tiny setup)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import train_tiny as tt
from safetensors.torch import load_file, save_file

from dflash_audit.data.batch import Batch
from dflash_audit.model.anchors import select_anchors
from dflash_audit.model.checkpoint import load_pretrained
from dflash_audit.train.loop import train

pytestmark = pytest.mark.reference
REPO = Path(__file__).resolve().parents[1]
ROUNDTRIP = REPO / "tests" / "reference_scripts" / "checkpoint_roundtrip.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_trajectory",
                                                  REPO / "benchmarks" / "bench_trajectory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_training_checkpoint_loads_in_reference_from_pretrained(tmp_path, reference_zygote,
                                                                draft_vocab):
    changes = {"draft_vocab_size": draft_vocab} if draft_vocab else {}
    paths = tt.setup_run(tmp_path, rows=2, **changes)
    summary = train(tt.tiny_config(paths, tmp_path / "run", steps=3),
                    reference_identity=tt.REFERENCE)
    work = tmp_path / "work"
    shutil.copytree(summary.checkpoint, work / "ours")
    ours = load_pretrained(summary.checkpoint).eval()  # verifier from config.json

    batch = Batch.load(sorted(paths["batches"].glob("batch_*.safetensors"))[0])
    anchors, valid = select_anchors(batch.loss_mask, 6, ours.config.block_size,
                                    torch.Generator().manual_seed(1))
    inputs = {**batch.tensors(), "anchor_positions": anchors, "anchor_valid": valid}
    save_file(inputs, work / "inputs.safetensors")
    (work / "profile.json").write_text(json.dumps({"drafter": ours.config.to_dict()}))
    (work / "verifier.txt").write_text(str(paths["verifier"]))
    proc = reference_zygote.run(ROUNDTRIP, [work], work, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]

    with torch.no_grad():
        logits = ours(**inputs).logits
    ref_logits = load_file(work / "logits_ref_loading_ours.safetensors")["logits"]
    assert ref_logits.shape == logits.shape == (1, 6 * 4, draft_vocab or 102)
    torch.testing.assert_close(ref_logits, logits, atol=1e-5, rtol=1e-5)


def test_reference_trained_in_our_loop_follows_our_loss(tmp_path, reference_identity):
    bench = _bench()
    setup = bench.tiny_setup(tmp_path / "tiny")
    case = tmp_path / "case"
    ours = bench.prepare_and_run_ours(case, setup["verifier"], setup["batches"],
                                      setup["profile"], steps=10, seed=0, lr=3e-3,
                                      warmup_steps=3)
    ref = bench.run_reference_side(case, reference_identity.spec)
    assert ref["load_unexpected"] == []
    assert sorted(ref["trainable"]) == sorted(
        n for n in load_file(case / "weights.safetensors")
        if n.startswith(("fc.", "hidden_norm.", "layers.", "norm.")))
    result = bench.compare_curves(ours["losses"], ref["losses"], rtol=1e-5)
    assert result["within_tolerance"], result["rows"]
    assert ours["losses"][-1] < 0.6 * ours["losses"][0]  # it did train
