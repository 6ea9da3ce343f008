"""Profiles: the built-ins carry the reference's documented defaults, build drafter configs
and loss specs, fingerprint their semantics, and bad files fail naming the field."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from dflash_audit.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    default_target_layer_ids,
)
from dflash_audit.model.loss import LossSpec
from dflash_audit.profile import Profile, ProfileError, builtin_profiles

if TYPE_CHECKING:
    from transformers import LlamaConfig

VALID = """
name = "mine"
block_size = 8
gamma = 4.0
loss = "kl_div"
weighting = "fixed-exp-decay"
dpace_alpha = 0.5
max_anchors = 64
target_layers = [1, 3]
num_draft_layers = 2
layer_layout = ["sliding", "full"]
sliding_window = 16
sliding_window_non_causal = false
sample_from_anchor = false
"""


def verifier(layers: int = 30) -> LlamaConfig:
    from transformers import LlamaConfig  # not at collection: ~3 s

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=layers, vocab_size=300)


def write(tmp_path, text: str, name: str = "p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_builtins_are_packaged():
    assert builtin_profiles() == ["reference-model", "reference-train-cli", "zlab"]


def test_reference_model_defaults():
    p = Profile.load("reference-model")
    assert (p.block_size, p.gamma, p.loss, p.weighting, p.dpace_alpha, p.max_anchors) == (
        8, 4.0, "kl_div", "fixed-exp-decay", 0.5, 512)
    assert (p.target_layers, p.num_draft_layers, p.layer_types) == (
        "speculators", 1, (FULL_ATTENTION,))
    assert (p.sliding_window, p.sliding_window_non_causal, p.sample_from_anchor,
            p.draft_vocab_size) == (None, False, False, None)
    cfg = p.to_drafter_config(verifier(30), mask_token_id=299)
    assert cfg.target_layer_ids == (2, 15, 27)  # [2, N//2, N-3]
    assert cfg.layer_types is None and cfg.effective_layer_types == (FULL_ATTENTION,)
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.mask_token_id, cfg.hidden_size) == (
        8, 1, 299, 64)
    assert p.loss_spec() == LossSpec("kl_div", "fixed-exp-decay", 4.0, 0.5)


def test_reference_train_cli_defaults():
    p = Profile.load("reference-train-cli")
    assert (p.block_size, p.loss, p.weighting, p.num_draft_layers, p.optimizer) == (
        16, "ce", "dpace", 5, "muon")
    cfg = p.to_drafter_config(verifier(30), mask_token_id=5)
    assert cfg.layer_types == (SLIDING_ATTENTION,) * 5
    assert (cfg.sliding_window, cfg.sliding_window_non_causal) == (2048, False)
    assert cfg.target_layer_ids == (2, 15, 27)
    assert p.loss_spec() == LossSpec("ce", "dpace", 4.0, 0.5)


def test_zlab_profile():
    p = Profile.load("zlab")
    cfg = p.to_drafter_config(verifier(30), mask_token_id=5)
    assert list(cfg.target_layer_ids) == default_target_layer_ids(30, "zlab")
    assert len(cfg.target_layer_ids) == 5 and cfg.num_hidden_layers == 5
    assert cfg.effective_layer_types == (FULL_ATTENTION,) * 5 and cfg.block_size == 16
    assert p.loss_spec() == LossSpec("ce", "fixed-exp-decay", 7.0, 0.5)


def test_file_profile_and_explicit_layout(tmp_path):
    p = Profile.load(write(tmp_path, VALID))
    assert p.name == "mine" and p.source.endswith("p.toml")
    cfg = p.to_drafter_config(verifier(6), mask_token_id=7)
    assert cfg.target_layer_ids == (1, 3)
    assert cfg.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) and cfg.sliding_window == 16
    override = p.to_drafter_config(verifier(6), mask_token_id=7, target_layer_ids=[2, 4])
    assert override.target_layer_ids == (2, 4)


def test_fingerprint_is_semantic():
    p = Profile.load("reference-train-cli")
    assert p.fingerprint() == Profile.load("reference-train-cli").fingerprint()
    assert len(p.fingerprint()) == 64
    renamed = p.replace(name="other", description="same semantics")
    assert renamed.fingerprint() == p.fingerprint()
    spelled_out = p.replace(layer_layout=["sliding"] * 5)
    assert spelled_out.fingerprint() == p.fingerprint()
    assert p.replace(gamma=7.0).fingerprint() != p.fingerprint()
    assert p.replace(sliding_window=1024).fingerprint() != p.fingerprint()


@pytest.mark.parametrize("edit, field", [
    ("block_size = 1", "block_size"),
    ("gamma = 0", "gamma"),
    ('loss = "kl"', "loss"),
    ('weighting = "linear"', "weighting"),
    ("dpace_alpha = 1.5", "dpace_alpha"),
    ("max_anchors = 0", "max_anchors"),
    ('target_layers = "middle"', "target_layers"),
    ("target_layers = [3, 1]", "target_layers"),
    ("num_draft_layers = 3", "layer_layout"),  # 2 layout entries for 3 layers
    ('layer_layout = ["sliding", "local"]', "layer_layout"),
    ("sliding_window = -4", "sliding_window"),
    ("sample_from_anchor = 1", "sample_from_anchor"),
    ("draft_vocab_size = 0", "draft_vocab_size"),
])
def test_bad_field_is_named(tmp_path, edit, field):
    key = edit.split("=")[0].strip()
    lines = [ln for ln in VALID.splitlines() if not ln.startswith(key + " ")]
    path = write(tmp_path, "\n".join(lines + [edit]) + "\n")
    with pytest.raises(ProfileError, match=f"field '{field}'") as err:
        Profile.load(path)
    assert str(path) in str(err.value)


def test_sliding_layout_needs_a_window(tmp_path):
    text = VALID.replace("sliding_window = 16\n", "")
    with pytest.raises(ProfileError, match="'sliding_window'.*required"):
        Profile.load(write(tmp_path, text))


def test_unknown_and_missing_fields(tmp_path):
    with pytest.raises(ProfileError, match=r"unknown field\(s\) 'gama' \(did you mean 'gamma'\?\)"):
        Profile.load(write(tmp_path, VALID + "gama = 3.0\n"))
    with pytest.raises(ProfileError, match=r"missing field\(s\) gamma"):
        Profile.load(write(tmp_path, VALID.replace("gamma = 4.0\n", "")))


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ProfileError, match="not valid TOML"):
        Profile.load(write(tmp_path, "block_size = = 8\n"))
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "absent.toml")
    with pytest.raises(ProfileError, match=r"unknown profile 'zlb' \(did you mean 'zlab'\?\).*"
                                           "reference-model, reference-train-cli, zlab"):
        Profile.load("zlb")


def test_profile_that_does_not_fit_the_verifier(tmp_path):
    p = Profile.load(write(tmp_path, VALID.replace("[1, 3]", "[1, 40]")))
    with pytest.raises(ProfileError, match=r"'target_layers'.*\[40\] do not exist.*6 layers"):
        p.to_drafter_config(verifier(6), mask_token_id=7)
    big = p.replace(target_layers=[1, 3], draft_vocab_size=10_000)
    with pytest.raises(ProfileError, match="draft_vocab_size"):
        big.to_drafter_config(verifier(6), mask_token_id=7)


#: A z-lab DFlash drafter config.json (z-lab/Qwen3-8B-DFlash-b16 style: a Qwen3 config with a
#: dflash_config; 36-layer verifier, five draft layers, z-lab target ids read hidden_states[id+1]).
ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "num_hidden_layers": 5, "num_target_layers": 36, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "layer_types": ["full_attention"] * 5,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}


def test_profile_from_a_zlab_drafter_config(tmp_path):
    path = tmp_path / "Qwen3-8B-DFlash-b16" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(ZLAB_CONFIG))
    profile = Profile.load(str(path))
    assert profile.block_size == 16 and profile.num_draft_layers == 5
    assert profile.target_layers == (2, 10, 18, 26, 34)  # z-lab id + 1
    assert profile.mask_token_id == 151669 and profile.layout_name == "full"
    assert profile.loss == "ce" and profile.gamma == 7.0  # the zlab recipe
    assert profile.name == "Qwen3-8B-DFlash-b16" and profile.source == str(path)


def test_profile_from_a_speculators_checkpoint_config(tmp_path):
    from dflash_audit.data.families import family_config
    from dflash_audit.model.checkpoint import reference_config
    from dflash_audit.model.config import DFlashConfig

    config = DFlashConfig.from_verifier_config(
        family_config("qwen3", num_hidden_layers=12), target_layer_ids=[2, 6, 9],
        mask_token_id=127, num_hidden_layers=3, block_size=4, draft_vocab_size=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=32, sliding_window_non_causal=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(reference_config(config, "verifier")))
    profile = Profile.load(str(path))
    assert (profile.block_size, profile.target_layers, profile.mask_token_id) == (4, (2, 6, 9),
                                                                                 127)
    assert profile.layer_layout == ("sliding", "full", "sliding")
    assert profile.sliding_window == 32 and profile.sliding_window_non_causal
    assert profile.draft_vocab_size == 64 and profile.weighting == "dpace"  # train-cli recipe
    # the profile rebuilds the same drafter config from the same verifier
    again = profile.to_drafter_config(family_config("qwen3", num_hidden_layers=12), 5)
    assert again.mask_token_id == 127 and again.layer_types == config.layer_types
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ProfileError, match="neither a speculators DFlash checkpoint config"):
        Profile.load(str(tmp_path / "bad.json"))


def _speculators_config() -> dict:
    from dflash_audit.data.families import family_config
    from dflash_audit.model.checkpoint import reference_config
    from dflash_audit.model.config import DFlashConfig

    config = DFlashConfig.from_verifier_config(
        family_config("qwen3", num_hidden_layers=12), target_layer_ids=[2, 6, 9],
        mask_token_id=127, num_hidden_layers=1, block_size=4)
    return reference_config(config, "verifier")


def _edit(d: dict, path: str, value) -> dict:
    d = json.loads(json.dumps(d))
    *parents, last = path.split(".")
    inner = d
    for p in parents:
        inner = inner[p]
    inner[last] = value
    return d


@pytest.mark.parametrize("path,value,message", [
    ("aux_hidden_state_layer_ids", [2.5, 6, 9], "aux_hidden_state_layer_ids = 2.5 is not"),
    ("aux_hidden_state_layer_ids", [True, 6, 9], "aux_hidden_state_layer_ids = True is not"),
    ("mask_token_id", "x", "mask_token_id = 'x' is not an integer"),
    ("draft_vocab_size", 1000, "draft_vocab_size = 1000 is larger than the transformer's"),
    ("transformer_layer_config.layer_types", ["linear_attention"],
     "layer_types ['linear_attention'] are not DFlash draft layer types"),
    ("transformer_layer_config.layer_types", ["full_attention"] * 3,
     "3 layer_types for num_hidden_layers = 1; give one per draft layer"),
])
def test_a_drafter_config_is_refused_never_truncated(tmp_path, path, value, message):
    """What used to be read as something else (2.5 -> 2, a too large draft vocabulary dropped,
    linear_attention read as full, extra layer_types cut) is a ProfileError naming the file."""
    file = tmp_path / "config.json"
    file.write_text(json.dumps(_edit(_speculators_config(), path, value)))
    with pytest.raises(ProfileError) as err:
        Profile.load(str(file))
    assert message in str(err.value) and str(file) in str(err.value)


def test_zlab_block_size_zero_is_not_replaced_by_the_inner_one(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**ZLAB_CONFIG, "block_size": 0}))
    with pytest.raises(ProfileError, match="'block_size' = 0: must be an integer >= 2"):
        Profile.load(str(file))
    # given twice and disagreeing: z-lab serves dflash_config's, a trainer may read the top
    # level's: refused, naming the key (never one silently preferred)
    file.write_text(json.dumps({**ZLAB_CONFIG, "block_size": 0,
                                "dflash_config": {**ZLAB_CONFIG["dflash_config"],
                                                  "block_size": 8}}))
    with pytest.raises(ProfileError, match="block_size is 8 in dflash_config and 0 at the "
                                           "top level"):
        Profile.load(str(file))
    inner_only = {k: v for k, v in ZLAB_CONFIG.items() if k != "block_size"}
    file.write_text(json.dumps({**inner_only, "dflash_config": {
        **ZLAB_CONFIG["dflash_config"], "block_size": 8}}))
    assert Profile.load(str(file)).block_size == 8


def test_mask_token_outside_a_real_verifiers_vocabulary_is_refused():
    profile = Profile.load("reference-model").replace(mask_token_id=60000)
    with pytest.raises(ProfileError, match="mask_token_id 60000 is outside verifier "
                                           "smollm2-135m's vocabulary \\(49152 ids\\)"):
        profile.check_mask_token(49152, "smollm2-135m")
    profile.check_mask_token(60001, "smollm2-135m")  # inside: accepted
    profile.check_mask_token(49152, "proxy:Qwen3.6-27B/config.json")  # a proxy's: gives way
