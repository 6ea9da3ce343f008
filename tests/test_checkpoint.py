"""Checkpoints in the reference's format: ours load in speculators' own
``DFlashDraftModel.from_pretrained`` with the same logits, and theirs load into ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_audit.audit.cases.synthetic import synthetic_batch
from dflash_audit.model.anchors import select_anchors
from dflash_audit.model.checkpoint import (
    CheckpointError,
    load_pretrained,
    save_pretrained,
)
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.verifier_weights import load_verifier_weights

SCRIPT = Path(__file__).parent / "reference_scripts" / "checkpoint_roundtrip.py"


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A tiny random Llama verifier saved as a local HF folder (untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # not at collection: ~3 s

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=False, rope_theta=10_000.0)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(folder)
    return model, folder


def drafter_config(verifier_model, **extra) -> DFlashConfig:
    return DFlashConfig.from_verifier_config(
        verifier_model.config, target_layer_ids=[1, 3, 5], mask_token_id=95,
        num_hidden_layers=2, block_size=4, layer_types=["sliding_attention", "full_attention"],
        sliding_window=6, **extra)


def forward_logits(model: DFlashDrafter, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.reference
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_checkpoints_cross_load_with_reference(verifier, tmp_path, reference_zygote,
                                               draft_vocab):
    vmodel, vdir = verifier
    config = drafter_config(vmodel, draft_vocab_size=draft_vocab)
    torch.manual_seed(3)
    ours = DFlashDrafter(config)
    if config.uses_draft_vocab:
        ids = torch.randperm(96)[:draft_vocab].sort().values
        ours.t2d[ids] = True
        ours.d2t.copy_(ids - torch.arange(draft_vocab))
    load_verifier_weights(ours, vmodel)
    save_pretrained(ours, tmp_path / "ours", verifier_name_or_path=str(vdir),
                    verifier_architectures=["LlamaForCausalLM"])

    g = torch.Generator().manual_seed(5)
    batch = synthetic_batch(config, 40, 2, 2, g)
    anchors, valid = select_anchors(batch["loss_mask"], 4, config.block_size, g)
    inputs = {**batch, "anchor_positions": anchors, "anchor_valid": valid}
    save_file(inputs, tmp_path / "inputs.safetensors")
    (tmp_path / "profile.json").write_text(json.dumps({"drafter": config.to_dict()}))
    (tmp_path / "verifier.txt").write_text(str(vdir))

    proc = reference_zygote.run(SCRIPT, [tmp_path], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]

    ref_loading_ours = load_file(tmp_path / "logits_ref_loading_ours.safetensors")["logits"]
    torch.testing.assert_close(ref_loading_ours, forward_logits(ours, inputs), atol=1e-5,
                               rtol=1e-5)
    theirs_in_ours = load_pretrained(tmp_path / "theirs", verifier=vmodel)
    theirs_logits = load_file(tmp_path / "logits_theirs.safetensors")["logits"]
    torch.testing.assert_close(forward_logits(theirs_in_ours, inputs), theirs_logits,
                               atol=1e-5, rtol=1e-5)


def test_round_trip_and_atomic_write(verifier, tmp_path):
    vmodel, vdir = verifier
    config = drafter_config(vmodel)
    model = DFlashDrafter(config)
    load_verifier_weights(model, vmodel)
    out = save_pretrained(model, tmp_path / "ckpt", verifier_name_or_path=str(vdir),
                          metadata={"audit_report": "abc123"})
    saved = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in saved and "verifier_lm_head.weight" not in saved
    assert "lm_head.weight" not in saved  # full vocabulary: the verifier's own head
    assert "fc.weight" in saved and saved["fc.weight"].shape == (32, 3 * 32)
    reloaded = load_pretrained(out)  # verifier found through config.json
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp folders left
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata()["audit_report"] == "abc123"


def test_incomplete_checkpoint_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(tmp_path, verifier=object())
