"""The SGLang 0.5.23 probe of serve-check, run on the real engine (installed into the suite's
cache once): what SGLang's own code makes of a drafter checkpoint.

Every expected value below was read off SGLang 0.5.23's source first (file:line in the
comments); a change of the engine's code changes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_audit.serve.engines import ENGINES, PROBES, install_engine, run_probe
from dflash_audit.serve.fields import layer_key
from tests.serve_support import TINY, edit_config, make_checkpoint

LABEL = "SGLang 0.5.23"


@pytest.fixture(scope="module")
def site() -> Path:
    return install_engine(ENGINES["sglang"])


def probe(site: Path, ckpt: Path):
    return run_probe(PROBES / "sglang_probe.py", ckpt, site, LABEL)


def to_zlab(d: dict) -> None:
    """The same drafter in z-lab's layout: a Qwen3Config with ``dflash_config``, target
    layer ids one lower (z-lab id k = speculators id k + 1)."""
    layer = d.pop("transformer_layer_config")
    ids = d["aux_hidden_state_layer_ids"]
    flat = {**layer, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "block_size": d["block_size"], "num_target_layers": TINY["num_verifier_layers"],
            "dflash_config": {"mask_token_id": d["mask_token_id"],
                              "target_layer_ids": [k - 1 for k in ids]}}
    d.clear()
    d.update(flat)


@pytest.fixture(scope="module")
def zlab(site, tmp_path_factory) -> Path:
    return edit_config(make_checkpoint(tmp_path_factory.mktemp("zl") / "ckpt"), to_zlab)


def test_speculators_format_is_refused(site, tmp_path):
    # no file of the wheel reads speculators_model_type / transformer_layer_config: get_config
    # (hf_transformers/config.py:378) hands the folder to AutoConfig, which needs model_type
    rec = probe(site, make_checkpoint(tmp_path / "ckpt"))
    assert rec.side == LABEL
    assert rec.refused.startswith("ValueError: Unrecognized model in ")
    assert "Should have a `model_type` key" in rec.refused
    assert "hf_transformers/config.py:get_config" in rec.refused
    assert rec.fields == {}
    assert any("no reader for the speculators format" in n for n in rec.notes)


def test_zlab_layout_per_layer(site, zlab):
    rec = probe(site, zlab)
    assert rec.refused is None, rec.refused
    f = rec.fields
    # layer 0 full: -1, ENCODER_ONLY (models/dflash.py:179-182)
    assert (f[layer_key(0, "attention")], f[layer_key(0, "sliding_window")],
            f[layer_key(0, "block_causal")], f[layer_key(0, "window_origin")]) == (
        "full", None, False, None)
    # layer 1 sliding: window_left = 8 - 1 (dflash_utils.py:417), DECODER (dflash.py:183-188),
    # the torch-native mask counts back from each query (torch_native_backend.py:48)
    assert (f[layer_key(1, "attention")], f[layer_key(1, "sliding_window")],
            f[layer_key(1, "block_causal")], f[layer_key(1, "window_origin")]) == (
        "sliding", 8, True, "query")
    assert "_make_sliding_window_mask" in rec.sources[layer_key(1, "window_origin")]
    # z-lab ids [0, 2, 3] captured before layer k + 1 (models/qwen3.py:805)
    assert f["target_layer_ids"] == [1, 3, 4]
    assert f["fc.in_features"] == 3 * TINY["hidden_size"]
    assert (f["block_size"], f["num_speculative_tokens"], f["mask_token_id"]) == (4, 3, 299)
    assert f["sample_from_anchor"] is False
    assert (f["lm_head.source"], f["embed_tokens.source"]) == ("target", "target")
    assert (f["draft_vocab_size"], f["draft_vocab.mapping"]) == (300, "none")
    assert (f["rope.theta"], f["rope.type"], f["rope.scaling"]) == (10000.0, "default", None)
    assert (f["rope.rotary_dim"], f["rope.neox_style"], f["rope.max_positions"]) == (
        8, True, 1024)
    assert f["norm.one_plus_weight"] is False
    assert (f["num_hidden_layers"], f["hidden_size"], f["num_attention_heads"],
            f["num_key_value_heads"], f["head_dim"], f["rms_norm_eps"]) == (
        2, 32, 4, 2, 8, 1e-6)
    assert set(rec.sources) == set(f)
    assert rec.not_run == {}


def test_zlab_without_rope_theta_block_size_ids_and_is_causal_false(site, tmp_path):
    def edit(d):
        to_zlab(d)
        d["is_causal"] = False
        d.pop("rope_parameters")
        d.pop("block_size")
        d["dflash_config"].pop("target_layer_ids")
        d.pop("max_position_embeddings")

    rec = probe(site, edit_config(make_checkpoint(tmp_path / "ckpt"), edit))
    assert rec.refused is None, rec.refused
    f = rec.fields
    assert f["rope.theta"] == 10000.0  # transformers' Qwen3Config default, read by get_rope_config
    assert f["block_size"] == 16  # DFlashDraftModel.__init__: resolve_block_size(default=16)
    assert f["num_speculative_tokens"] == 15
    assert f["rope.max_positions"] == 32768  # Qwen3Config's default max_position_embeddings
    # without ids SGLang picks them from the served target (dflash_utils.py:571)
    assert "target_layer_ids" not in f
    assert rec.not_run["target_layer_ids"].startswith("not run here")
    assert f["fc.in_features"] == 2 * TINY["hidden_size"]  # one feature per draft layer
    # _get_dflash_attention_type: is_causal False -> ENCODER_ONLY for every layer, sliding too
    assert f[layer_key(1, "block_causal")] is False
    assert f[layer_key(1, "sliding_window")] == 8
    assert any("drops its window" in n for n in rec.notes)


def test_a_yarn_drafter_is_read_by_sglangs_own_scaled_rope(site, tmp_path):
    """get_rope's yarn path calls the factory's _get_rope_param (factory.py:312): the probe
    compiles the helpers get_rope calls from the same file (a NameError, exit 2, before)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    rec = probe(site, edit_config(ckpt, to_zlab))
    assert rec.refused is None, rec.refused
    f = rec.fields
    assert (f["rope.type"], f["rope.theta"]) == ("yarn", 10000.0)
    assert f["rope.scaling"]["factor"] == 4.0
    assert f["rope.scaling"]["original_max_position_embeddings"] == 256


def test_a_shipped_mask_embedding_is_merged_into_the_mask_row(site, zlab, tmp_path):
    """SGLang's worker writes mask_embedding.pt into the target's mask_token_id row
    (dflash_worker_v2.py:_maybe_merge_trained_mask_embedding)."""
    import shutil

    import torch

    assert probe(site, zlab).fields["mask_embedding.source"] == "embed_tokens[mask_token_id]"
    ckpt = shutil.copytree(zlab, tmp_path / "ckpt")
    torch.save({"embedding": torch.ones(TINY["hidden_size"]), "mask_token_id": 299},
               ckpt / "mask_embedding.pt")
    rec = probe(site, ckpt)
    assert rec.fields["mask_embedding.source"] == "mask_embedding.pt"
    assert "_maybe_merge_trained_mask_embedding" in rec.sources["mask_embedding.source"]


def test_sliding_layer_without_window_is_refused(site, tmp_path):
    # Qwen3Config drops sliding_window unless use_sliding_window; SGLang then raises
    # (dflash_utils.py:411-414)
    def edit(d):
        to_zlab(d)
        d["use_sliding_window"] = False

    rec = probe(site, edit_config(make_checkpoint(tmp_path / "ckpt"), edit))
    assert rec.refused == ("ValueError: DFLASH sliding_attention layers require "
                           "config.sliding_window. (raised in sglang/srt/models/dflash.py:"
                           "DFlashDraftModel.__init__)")
    assert rec.fields == {}
