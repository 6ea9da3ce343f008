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


@pytest.mark.parametrize("positions", ["continue", "restart"])
def test_a_capture_over_the_packed_row_names_its_positions(smol, good, tmp_path, positions):
    """On a real verifier the two captures over the packed row differ (positions matter
    across documents: 2-14 % apart per layer, tolerances 0.6-9 %): the finding names the one
    the files hold, never both."""
    from dflash_audit.batch_audit.recompute import PACKED_CONTINUE, PACKED_RESTART

    out = broken_script("cross_document_capture").make(good, tmp_path / positions, smol,
                                                       positions=positions)
    report = run_check_batches(out, smol, rows_to_check=1, progress=False)
    assert {c.finding for c in report.failures} == {"cross-document attention"}
    assert len(report.failures) == 6  # five target slices and the last state
    plan = {"continue": PACKED_CONTINUE, "restart": PACKED_RESTART}[positions]
    words = {"continue": "positions counting on across the row, as one plain "
                         "model(input_ids=row) forward computes them",
             "restart": "positions restarting per document, but one causal mask over the "
                        "row"}[positions]
    for c in report.failures:
        assert c.details["capture"] == [plan], (c.name, c.details["packed_recomputes"])
        assert f"(cross-document attention in the capture; {words})" in c.message


def test_positions_counting_on_with_attention_per_document_changes_no_state(smol, good,
                                                                            tmp_path):
    """The sibling the evidence cannot show: positions offset per document while attention
    stays within it. RoPE is relative, so the states equal the per-document ones within noise
    and check-batches passes (nothing a drafter learns from them differs)."""
    import torch

    from dflash_audit.data.capture import LayerCapture

    rows = broken_script("_batches").read_folder(good)
    decoder = smol.model.get_decoder()
    for _, t, _ in rows:
        docs = t["document_ids"][0]
        with torch.inference_mode(), LayerCapture(smol.model, [smol.num_layers]) as cap:
            for k in range(int(docs.max()) + 1):
                pos = (docs == k).nonzero().flatten()
                s, e = int(pos[0]), int(pos[-1]) + 1
                decoder(input_ids=t["input_ids"][:, s:e],
                        position_ids=torch.arange(s, e).unsqueeze(0), use_cache=False)
                t["verifier_last_hidden_states"][0, s:e] = cap.captured["last"][0]
    out = broken_script("_batches").write_folder(rows, tmp_path / "offset")
    report = run_check_batches(out, smol, rows_to_check=1, progress=False)
    assert report.exit_code == 0, failed(report)
    last = [c for c in report.checks if c.name == "verifier_last_hidden_states"][0]
    assert last.details["error"] < last.details["tolerance"] / 100
