"""check-batches with the built-in verifier SmolLM2-135M (30 layers, H=576) on chitchat rows
at T=256: our files and their reference-format copy pass; the six shipped broken-batch
scripts each fail with their name. One row recomputed per case (~5 s each on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_support import smollm2
from test_batch_audit import broken_script, failed

from dflash_audit.batch_audit.run import run_check_batches
from dflash_audit.data.pipeline import build_batches, write_batches

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    return smollm2()


@pytest.fixture(scope="module")
def good(smol, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol") / "ours"
    batches = build_batches(smol, "chitchat", seq_len=256, rows=1, seed=0, progress=False)
    assert batches[0].num_documents >= 2  # packed, so positions must restart
    write_batches(batches, folder, reference_format=True)
    return folder


def test_our_files_and_reference_format_pass(smol, good):
    ours = run_check_batches(good, smol, rows_to_check=1, progress=False, profile="zlab")
    assert ours.exit_code == 0, failed(ours)
    assert ours.context["files_precision"] == "float32"
    noise = ours.context["noise_per_layer"]
    assert len(noise) == 32 and all(0 < x < 0.05 for x in noise)  # measured, documented
    ref = run_check_batches(good / "reference", smol, rows_to_check=1, progress=False)
    assert ref.format == "reference-offline" and ref.exit_code == 0, failed(ref)


@pytest.mark.parametrize("script, check, finding, drafter", [
    ("last_layer_two_short", "verifier_last_hidden_states", "layer N-2", False),
    ("post_norm_last_state", "verifier_last_hidden_states", "post-norm", False),
    ("loss_mask_shifted", "loss_mask", "shift +1", False),
    ("mask_on_user_turns", "loss_mask", "user turns", False),
    ("positions_not_restarting", "position_ids", "positions continue", False),
    ("zlab_ids_as_speculators", "target_layer_ids", "zlab ids read as speculators ids", True),
])
def test_broken_batches_fail_with_the_right_name(smol, good, tmp_path, script, check,
                                                 finding, drafter):
    out = Path(broken_script(script).make(good, tmp_path / script, smol))
    report = run_check_batches(out, smol, rows_to_check=1, progress=False,
                               drafter_config=out / "drafter_config.json" if drafter else None)
    assert failed(report) == {(check, finding)}
    if finding == "layer N-2":
        (c,) = report.failures
        assert "equals layer 28's output" in c.message and "L = N-2" in c.message
