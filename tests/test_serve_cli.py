"""``dflash-audit serve-check`` end to end, one run per engine on the real engine code
installed by the tool and the real reference: the exit code, the findings on the terminal
and the four report files. The engines' field values are in ``test_serve_<engine>.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_zygote import run_cli
from serve_support import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """TINY (layer 0 full, layer 1 sliding W=8, causal block) over a tiny verifier."""
    from data_support import shared_tiny_verifier

    base = tmp_path_factory.mktemp("serve-cli")
    verifier = shared_tiny_verifier(layers=6)
    return make_checkpoint(base / "ckpt", verifier=str(verifier))


def _serve_check(checkpoint: Path, engine: str, tmp: Path, *extra: str):
    """serve-check run in ``tmp`` on ``checkpoint`` named relative to it, as a user names
    ``runs/...`` (the engines' probes run in folders of their own: it once failed there)."""
    result = run_cli(["serve-check", os.path.relpath(checkpoint, tmp), "--engine", engine,
                      "--out", str(tmp), *extra], tmp)
    folders = sorted(tmp.glob(f"*-serve-check-{engine}"))
    report = json.loads((folders[-1] / "report.json").read_text()) if folders else None
    return result, report, folders[-1] if folders else None


def test_zlab_names_its_window_and_drafts_beside_the_training_forward(checkpoint, tmp_path):
    result, report, folder = _serve_check(checkpoint, "zlab", tmp_path, "--prompts", "1",
                                          "--max-new-tokens", "8")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "DIFFERS [where the window is counted from]" in result.stdout
    assert "acceptance length on 1 held-out prompts" in result.stdout
    assert report["verdict"] == "fail" and "where the window is counted from" in \
        report["findings"]
    layer1 = report["attention"][1]
    assert layer1["trained"]["context"][0] == [-8, -1]
    assert layer1["served"]["context"][0] == [-7, -1]
    drafting = report["drafting"]
    assert drafting["differs"] is True and "window_origin" in drafting["message"]
    assert sorted(p.name for p in folder.iterdir()) == ["junit.xml", "report.html",
                                                         "report.json", "report.md"]


def test_sglang_cannot_load_the_speculators_format_and_is_shown_the_conversion(checkpoint,
                                                                              tmp_path):
    result, report, _ = _serve_check(checkpoint, "sglang", tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    rows = {r["key"]: r for r in report["rows"]}
    assert rows["checkpoint_format"]["status"] == "differs"
    assert "Unrecognized model" in rows["checkpoint_format"]["message"]
    assert rows["layers.1.window_origin"]["served"] == "query"
    assert rows["layers.0.block_causal"]["status"] == "same"


def test_vllm_serves_the_full_layer_causal_and_counts_the_window_from_each_query(checkpoint,
                                                                                tmp_path):
    result, report, _ = _serve_check(checkpoint, "vllm", tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "DIFFERS [causality inside the block]" in result.stdout
    rows = {r["key"]: r for r in report["rows"]}
    assert rows["layers.0.block_causal"]["served"] is True
    assert rows["layers.0.block_causal"]["trained"] is False
    assert "_dflash_layer_causal" in rows["layers.0.block_causal"]["served_source"]
    assert rows["rope.max_positions"]["status"] == "same"  # raised to the target's context
    assert rows["attention_backend"]["status"] == "not run"
    assert report["attention"][0]["served"]["slots"][0] == [0]
