"""The vLLM 0.33.0 probe of serve-check, run on the real installed wheel (no mocks of vLLM):
what vLLM's own code decides for drafter checkpoints made by tests/serve_support.py.

The probes run once per test run (whichever worker asks first), side by side (each imports
torch, transformers and vLLM's config stack, ~8 s)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from session_share import once_per_run

from dflash_audit.serve.engines import ENGINES, PROBES, install_engine, run_probe
from tests.serve_support import TINY, edit_config, make_checkpoint

LABEL = "vLLM 0.33.0"


def _no_rope_parameters(d):
    d["transformer_layer_config"].pop("rope_parameters")


def _no_window(d):
    d["transformer_layer_config"]["sliding_window"] = None


def _zlab(folder: Path) -> Path:
    """The same drafter with a z-lab config.json (plain Qwen3Config + dflash_config), its
    rope_parameters without rope_theta."""
    from dflash_audit.audit.frameworks.zlab_adapter import zlab_config
    from dflash_audit.model.config import DFlashConfig

    make_checkpoint(folder)
    d = zlab_config(DFlashConfig(**TINY)).to_dict()
    d["architectures"] = ["DFlashDraftModel"]
    d["rope_parameters"].pop("rope_theta")
    (folder / "config.json").write_text(json.dumps(d, indent=1))
    return folder


def _reordered_ids(d):
    d["aux_hidden_state_layer_ids"] = [4, 1, 3]


def _with_mask_embedding(folder: Path) -> Path:
    """A checkpoint that ships a mask_embedding.pt (as vLLM's _read_mask_embedding reads it)."""
    import torch

    torch.save({"embedding": torch.ones(TINY["hidden_size"]), "mask_token_id": 299},
               folder / "mask_embedding.pt")
    return folder


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return once_per_run(tmp_path_factory, "vllm-probe", _probe_all)


def _probe_all(base: Path) -> dict:
    site = install_engine(ENGINES["vllm"])
    ckpts = {
        "default": make_checkpoint(base / "default"),
        # every layer sliding, non-causal block, a draft vocabulary, no RoPE parameters at all
        "variant": edit_config(make_checkpoint(
            base / "variant", layer_types=("sliding_attention", "sliding_attention"),
            sliding_window_non_causal=True, draft_vocab_size=100,
            max_position_embeddings=777), _no_rope_parameters),
        "no_window": edit_config(make_checkpoint(base / "nowin"), _no_window),
        "zlab": _zlab(base / "zlab"),
        "mask_embedding": _with_mask_embedding(make_checkpoint(base / "maskemb")),
        "reordered": edit_config(make_checkpoint(base / "reordered"), _reordered_ids),
    }
    with ThreadPoolExecutor(len(ckpts)) as pool:
        futures = {k: pool.submit(run_probe, PROBES / ENGINES["vllm"].probe, c, site, LABEL)
                   for k, c in ckpts.items()}
        return {k: f.result() for k, f in futures.items()}


def test_default_checkpoint_every_layer_causal(records):
    """sliding_window_non_causal: false -> update_dflash sets dflash_config.causal = True,
    which _dflash_layer_causal applies to EVERY layer: the full-attention layer 0, trained
    bidirectional, is served block-causal (vLLM PR 56692 class)."""
    r = records["default"]
    assert r.refused is None and r.side == LABEL
    f = r.fields
    assert f["layers.0.attention"] == "full" and f["layers.0.sliding_window"] is None
    assert f["layers.0.block_causal"] is True
    assert f["layers.1.attention"] == "sliding" and f["layers.1.sliding_window"] == 8
    assert f["layers.1.block_causal"] is True
    assert f["layers.1.window_origin"] == "query"  # flex mask_mod: |q - kv| < W
    assert f["layers.0.window_origin"] is None
    assert r.sources["layers.0.block_causal"].endswith("qwen3_dflash.py:_dflash_layer_causal")
    assert "get_sliding_window_mask_mod" in r.sources["layers.1.window_origin"]


def test_a_shipped_mask_embedding_replaces_the_mask_slots_embedding(records):
    """vLLM's load_weights takes mask_embedding.pt of the checkpoint folder for every mask
    slot (qwen3_dflash.py:_read_mask_embedding -> has_separate_mask_embedding): a field, so a
    stray file is a difference (it was a note and the verdict passed)."""
    shipped = records["mask_embedding"]
    assert shipped.fields["mask_embedding.source"] == "mask_embedding.pt"
    assert "_read_mask_embedding" in shipped.sources["mask_embedding.source"]
    assert records["default"].fields["mask_embedding.source"] == "embed_tokens[mask_token_id]"


def test_target_layers_are_served_in_the_targets_layer_order(records):
    """vLLM's target appends a layer's state in its own layer loop when the layer is listed
    (interfaces.py:EagleModelMixin._maybe_add_hidden_state): ids [4, 1, 3] reach fc as
    [1, 3, 4], which the reference (its config order) trains differently; it said "same"."""
    r = records["reordered"]
    assert r.refused is None, r.refused
    assert r.fields["target_layer_ids"] == [1, 3, 4]
    assert "_maybe_add_hidden_state" in r.sources["target_layer_ids"]


def test_the_layer_order_is_read_without_walking_every_layer():
    """An id of 2e8 (a broken config) is answered at once: only the listed layers and their
    neighbours go through the engine's _maybe_add_hidden_state (it walked every layer up to
    the largest id: the probe hung until its timeout)."""
    import torch

    from dflash_audit.serve.probes.vllm_runtime import captured_order

    site = install_engine(ENGINES["vllm"])
    ids, source = captured_order(site, [3, 1, 200_000_000, -1], torch)
    assert ids == [1, 3, 200_000_000] and "_maybe_add_hidden_state (line " in source
    assert captured_order(site, [], torch)[0] is None


def test_default_checkpoint_mixed_layers_need_v2_runner(records):
    f = records["default"].fields
    assert f["runner.v1_model_runner"].startswith("refused: NotImplementedError")
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in f["runner.v1_model_runner"]
    assert any("Model Runner V1 does not support" in n for n in records["default"].notes)
    # every layer sliding: one KV group, V1 runs it
    assert records["variant"].fields["runner.v1_model_runner"] == "runs"


def test_default_checkpoint_ids_sizes_vocab(records):
    r = records["default"]
    f = r.fields
    assert f["target_layer_ids"] == list(TINY["target_layer_ids"])  # aux - 1, then + 1 back
    assert f["fc.in_features"] == 3 * TINY["hidden_size"]
    assert f["mask_token_id"] == 299
    assert f["num_speculative_tokens"] == 3 and f["block_size"] == 4
    assert f["sample_from_anchor"] is False
    assert f["draft_vocab_size"] == 300 and f["draft_vocab.mapping"] == "none"
    # the checkpoint ships neither: vLLM takes the target's
    assert f["lm_head.source"] == "target" and f["embed_tokens.source"] == "target"
    assert f["norm.one_plus_weight"] is False
    assert (f["hidden_size"], f["num_attention_heads"], f["num_key_value_heads"],
            f["head_dim"], f["num_hidden_layers"]) == (32, 4, 2, 8, 2)
    assert f["rms_norm_eps"] == 1e-6
    assert all(k in r.sources for k in f)
    assert any("Speculators verifier must name a remote model repository" in n
               for n in r.notes)  # `vllm serve CHECKPOINT` with verifier null


def test_rope(records):
    f = records["default"].fields
    assert (f["rope.theta"], f["rope.type"], f["rope.scaling"]) == (10000.0, "default", None)
    assert f["rope.rotary_dim"] == 8 and f["rope.neox_style"] is True
    assert f["rope.max_positions"] == 1024  # config.max_position_embeddings
    assert f["rope.max_positions_raised_to_target"] is True
    v = records["variant"]
    # no rope_parameters at all: vLLM's set_default_rope_theta(default_theta=1000000)
    assert v.fields["rope.theta"] == 1000000.0
    assert "set_default_rope_theta" in v.sources["rope.theta"]
    assert v.fields["rope.max_positions"] == 777
    # rope_parameters without rope_theta: transformers' default_theta fills it first
    t = records["zlab"]
    assert t.fields["rope.theta"] == 10000.0
    assert "convert_rope_params_to_dict" in t.sources["rope.theta"]


def test_variant_non_causal_sliding_and_draft_vocab(records):
    f = records["variant"].fields
    assert records["variant"].refused is None
    for i in (0, 1):
        assert f[f"layers.{i}.attention"] == "sliding"
        assert f[f"layers.{i}.block_causal"] is False
        assert f[f"layers.{i}.window_origin"] == "query"
    assert f["draft_vocab_size"] == 100 and f["draft_vocab.mapping"] == "d2t offsets"
    assert f["lm_head.source"] == "checkpoint"  # [100, H] differs from the target's head


def test_refused_sliding_layer_without_window(records):
    r = records["no_window"]
    assert r.refused is not None and r.refused.startswith("ValueError: DFlash sliding attention "
                                                          "requires a window size")
    assert "\n" not in r.refused


def test_zlab_format(records):
    r = records["zlab"]
    assert r.refused is None
    f = r.fields
    # no dflash_config.causal: layer types decide (full bidirectional, sliding causal)
    assert f["layers.0.block_causal"] is False and f["layers.1.block_causal"] is True
    assert f["target_layer_ids"] == list(TINY["target_layer_ids"])  # z-lab ids + 1
    assert "num_speculative_tokens" in r.not_run and "block_size" in r.not_run
