"""Verifier family proxies (dflash_audit.data.families) and the drafter-config derivation per
family: ours against the reference's own (reference/adapter.py --derive, run in the
reference's process on the pinned speculators release)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.data.capture import capture_row
from dflash_audit.data.families import (
    FAMILIES,
    FamilyError,
    build_proxy,
    family_config,
    proxy_config_from_json,
    resolve_verifier_spec,
)
from dflash_audit.model.checkpoint import reference_config
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.derivation import derivation_fields
from dflash_audit.model.drafter import DFlashDrafter

ADAPTER = Path(__file__).parents[1] / "reference" / "adapter.py"

#: The motivating verifier: a Qwen3.5/3.6-27B-style text config (64 layers, 3 linear-attention
#: layers per full one, head_dim 256 with H % heads != 0, partial rotary with an mrope section).
QWEN35_27B = {
    "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(64)],
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "eos_token_id": 248044, "pad_token_id": None}}

#: Hub-style (transformers 4 format) configs of a Gemma3-27B and a Llama-3.1-8B verifier:
#: transformers 5 turns rope_theta / rope_local_base_freq / rope_scaling into rope_parameters.
GEMMA3_27B = {
    "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "query_pre_attn_scalar": 168, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024, "vocab_size": 262208, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072}}
LLAMA31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "tie_word_embeddings": False}
REAL_CONFIGS = {"qwen35_27b": QWEN35_27B, "gemma3_27b": GEMMA3_27B, "llama31_8b": LLAMA31_8B}

#: Fields where a difference is not a derivation difference: the reference resolves the mask
#: token from a tokenizer (these folders hold none), ours takes it as an argument.
NOT_DERIVED = {"mask_token_id"}


def ours(verifier_config) -> DFlashConfig:
    vc = getattr(verifier_config, "text_config", None) or verifier_config
    return DFlashConfig.from_verifier_config(verifier_config, target_layer_ids=[1, 2],
                                             mask_token_id=int(vc.vocab_size) - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_proxy_builds_fast_and_capture_has_hf_semantics(family):
    build_proxy(family_config(family, num_hidden_layers=6))  # imports its modeling module
    start = time.perf_counter()
    model = build_proxy(family_config(family, num_hidden_layers=6), seed=1)
    assert time.perf_counter() - start < 5.0  # seconds, on a loaded 2-core machine
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    targets = [0, 2, 5]
    hidden, last = capture_row(model, ids, torch.zeros_like(ids), targets)
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True).hidden_states
    assert len(hf) == 7
    for j, layer_id in enumerate(targets):  # id L = HF output_hidden_states[L]
        torch.testing.assert_close(hidden[..., j * 32:(j + 1) * 32], hf[layer_id])
    # id N is the last layer's output BEFORE the final norm: normed once, it is HF's last entry
    with torch.no_grad():
        torch.testing.assert_close(model.get_decoder().norm(last), hf[-1])
    assert not torch.allclose(last, hf[-1], atol=1e-3)


def test_family_configs_keep_what_matters():
    gemma = family_config("gemma3_text", num_hidden_layers=12)
    assert set(gemma.rope_parameters) == {"sliding_attention", "full_attention"}
    assert gemma.layer_types.count("full_attention") == 2 and gemma.head_dim * 4 != 32
    qwen35 = family_config("qwen3_5", num_hidden_layers=8)
    assert qwen35.layer_types.count("linear_attention") == 6
    assert qwen35.rope_parameters["partial_rotary_factor"] == 0.25
    assert family_config("gpt_oss").rope_parameters["rope_type"] == "yarn"
    assert family_config("qwen3").tie_word_embeddings is True
    with pytest.raises(FamilyError, match="unknown verifier family 'falcon'.*llama"):
        family_config("falcon")


def test_proxy_from_user_config_keeps_depth_and_layer_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN35_27B))
    config = resolve_verifier_spec(str(tmp_path))
    assert config.model_type == "qwen3_5_text" and config.num_hidden_layers == 64
    assert config.layer_types == QWEN35_27B["text_config"]["layer_types"]
    assert config.hidden_size == 32 and config.head_dim == 16  # still != H / heads
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert sum(config.rope_parameters["mrope_section"]) == 16 * 0.25 / 2
    from transformers import Qwen3_5ForCausalLM  # noqa: F401 - import before timing the build

    start = time.perf_counter()
    model = build_proxy(config)
    assert time.perf_counter() - start < 10.0
    ids = torch.randint(0, 128, (1, 8))
    hidden, last = capture_row(model, ids, torch.zeros_like(ids), [2, 32, 61])
    assert hidden.shape == (1, 8, 96) and bool(torch.isfinite(last).all())
    with pytest.raises(FamilyError, match="cannot read verifier config"):
        proxy_config_from_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(FamilyError, match="unknown to this transformers"):
        proxy_config_from_json(tmp_path / "bad.json")


def test_nested_rope_takes_the_sliding_entry_and_the_saved_config_agrees():
    config = ours(family_config("gemma3_text"))
    assert config.rope_theta == 10000.0 and config.rope_parameters is None
    saved = reference_config(config, None)["transformer_layer_config"]["rope_parameters"]
    assert saved == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.verifier_norm_one_plus_weight and config.hidden_act == "gelu_pytorch_tanh"


def test_partial_rotary_factor_is_not_saved_for_a_whole_head_rotation():
    config = ours(family_config("glm4"))
    fields = derivation_fields(config)
    assert fields["rotary_dim"] == config.head_dim == 8
    assert "partial_rotary_factor" not in fields["saved.rope_parameters"]
    # a hand-made config carrying the factor: the drafter still rotates the whole head, and
    # the checkpoint must not tell an engine otherwise
    manual = config.replace(rope_parameters={"partial_rotary_factor": 0.5})
    assert derivation_fields(manual)["rotary_dim"] == 8
    assert "partial_rotary_factor" not in derivation_fields(manual)["saved.rope_parameters"]


def test_heads_follow_head_dim_when_hidden_size_is_not_a_multiple_of_heads():
    from transformers import AutoConfig

    vc = AutoConfig.for_model("qwen3_5", **{k: v for k, v in QWEN35_27B.items()
                                            if k != "model_type"})
    config = ours(vc)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        20, 4, 256)
    assert config.rope_parameters == {"mrope_section": [44, 44, 40],
                                      "partial_rotary_factor": 1.0}


@pytest.mark.reference
def test_derivation_matches_the_reference_for_every_family(tmp_path, reference_zygote):
    configs = {name: family_config(name, num_hidden_layers=8) for name in FAMILIES}
    folders = {}
    for name, config in configs.items():
        folders[name] = tmp_path / name
        config.save_pretrained(folders[name])
    from transformers import AutoConfig

    for name, real in REAL_CONFIGS.items():
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "config.json").write_text(json.dumps(real))
        configs[name] = AutoConfig.from_pretrained(folders[name])
    proc = reference_zygote.run(ADAPTER, ["--derive", *folders.values()], tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name, folder in folders.items():
        ref = json.loads((folder / "derivation.json").read_text())
        if name == "olmo3":  # the reference's CLI cannot derive it: Olmo3Config has no head_dim
            assert "head_dim" in ref["error"]
            continue
        assert "error" not in ref, (name, ref.get("error"))
        mine = derivation_fields(ours(configs[name]))
        diff = {k: (mine.get(k), ref.get(k)) for k in set(mine) | set(ref)
                if k not in NOT_DERIVED and mine.get(k) != ref.get(k)}
        assert diff == {}, name
    for name in ("gemma3_text", "gemma3_27b"):
        gemma = json.loads((folders[name] / "derivation.json").read_text())
        assert gemma["rope_theta"] == 10000.0 and gemma["verifier_norm"] == "x*(1+w)"
    glm = json.loads((folders["glm4"] / "derivation.json").read_text())
    assert glm["rotary_dim"] == 8 and "partial_rotary_factor" not in glm["saved.rope_parameters"]


class LlamaConventions(DrafterCandidate):
    """A drafter that hard-codes Llama conventions: x*w verifier norm, silu, theta 1e4."""

    name = "hard-coded Llama conventions"

    def build(self, config):
        return DFlashDrafter(config.replace(verifier_norm_one_plus_weight=False,
                                            hidden_act="silu", rope_theta=10000.0))


@pytest.mark.reference
@pytest.mark.usefixtures("single_thread")
def test_default_spread_fails_a_candidate_that_hard_codes_llama(run_reference_cases):
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.profile import Profile

    planned = plan_synthetic_cases(Profile.load("reference-model"), len(FAMILIES), seed=8)
    cases = [p.case for p in planned]
    reference = run_reference_cases(cases)
    differs = {}
    for case in cases:
        ref = reference[case.name].tensors
        mine = DrafterCandidate().run_case(case.config, case.loss, case.weights, case.inputs)
        torch.testing.assert_close(mine.tensors["logits"], ref["logits"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.tensors["targets"], ref["targets"], atol=1e-4, rtol=1e-4)
        bad = LlamaConventions().run_case(case.config, case.loss, case.weights, case.inputs)
        differs[case.name.split("-")[2]] = not (
            torch.allclose(bad.tensors["logits"], ref["logits"], atol=1e-4)
            and torch.allclose(bad.tensors["targets"], ref["targets"], atol=1e-4))
    # glm4 is the one family whose verifier has exactly these values (theta 1e4, silu, x*w)
    assert differs == {"llama": True, "qwen3": True, "qwen3_5": True, "gemma3_text": True,
                       "mistral": True, "gpt_oss": True, "olmo3": True, "glm4": False}


@pytest.mark.reference
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_reference_loading_our_checkpoint_runs_our_rope(family, tmp_path, reference_zygote):
    """Our saved config.json makes the reference run the RoPE we trained with (nested
    per-layer-type rope, partial rotary): same logits from the reference loading our
    checkpoint as from our drafter."""
    from safetensors.torch import load_file, save_file

    from dflash_audit.audit.cases.synthetic import synthetic_batch
    from dflash_audit.model.anchors import select_anchors
    from dflash_audit.model.checkpoint import save_pretrained
    from dflash_audit.model.verifier_weights import load_verifier_weights

    verifier = build_proxy(family_config(family, num_hidden_layers=6), seed=2)
    verifier.save_pretrained(tmp_path / "verifier")
    config = DFlashConfig.from_verifier_config(verifier.config, target_layer_ids=[1, 3, 5],
                                               mask_token_id=127, num_hidden_layers=2,
                                               block_size=4)
    torch.manual_seed(3)
    drafter = DFlashDrafter(config)
    load_verifier_weights(drafter, verifier)
    save_pretrained(drafter, tmp_path / "ours", verifier_name_or_path=str(tmp_path / "verifier"),
                    verifier_architectures=list(verifier.config.architectures or []))
    g = torch.Generator().manual_seed(5)
    batch = synthetic_batch(config, 40, 2, 2, g)
    anchors, valid = select_anchors(batch["loss_mask"], 4, config.block_size, g)
    inputs = {**batch, "anchor_positions": anchors, "anchor_valid": valid}
    save_file(inputs, tmp_path / "inputs.safetensors")
    (tmp_path / "profile.json").write_text(json.dumps({"drafter": config.to_dict()}))
    (tmp_path / "verifier.txt").write_text(str(tmp_path / "verifier"))
    script = Path(__file__).parent / "reference_scripts" / "checkpoint_roundtrip.py"
    proc = reference_zygote.run(script, [tmp_path], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    with torch.no_grad():
        ours_logits = drafter.eval()(**inputs).logits
    torch.testing.assert_close(load_file(tmp_path / "logits_ref_loading_ours.safetensors")
                               ["logits"], ours_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_proxy_of_a_hub_config_keeps_rope_layers_and_norm(name, tmp_path):
    real = REAL_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(real))
    proxy = proxy_config_from_json(tmp_path / "config.json")
    text = real.get("text_config", real)
    assert proxy.num_hidden_layers == text["num_hidden_layers"] and proxy.hidden_size == 32
    assert proxy.vocab_size == 128 and proxy.rms_norm_eps == text["rms_norm_eps"]
    mine = ours(proxy)
    if name == "gemma3_27b":  # legacy rope_local_base_freq became the sliding entry
        assert proxy.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert proxy.layer_types[5] == "full_attention"
        assert proxy.layer_types[6] == "sliding_attention"
        assert mine.rope_theta == 10000.0 and mine.verifier_norm_one_plus_weight
    if name == "llama31_8b":
        assert mine.rope_parameters["rope_type"] == "llama3" and mine.rope_theta == 500000.0
    if name == "qwen35_27b":
        assert mine.verifier_norm_one_plus_weight and mine.rope_parameters[
            "partial_rotary_factor"] == 1.0


class Gemma3RopeFallback(DrafterCandidate):
    """The derivation before the fix: a nested per-layer-type rope kept as is, theta 1e6."""

    name = "rope theta 1e6 fallback for nested rope_parameters"

    def derive_config(self, verifier_config, config):
        fields = super().derive_config(verifier_config, config)
        rope = dict(getattr(verifier_config, "rope_parameters", None) or {})
        if "sliding_attention" in rope:
            fields["rope_theta"] = 1e6
            fields["saved.rope_parameters"] = {**rope, "rope_theta": 1e6,
                                               "rope_type": "default"}
        return fields


class SavedPartialFactor(DrafterCandidate):
    """The checkpoint before the fix: it kept the verifier's partial_rotary_factor while the
    draft layers rotate the whole head."""

    name = "saved partial_rotary_factor"

    def derive_config(self, verifier_config, config):
        fields = super().derive_config(verifier_config, config)
        factor = (getattr(verifier_config, "rope_parameters", None) or {}).get(
            "partial_rotary_factor")
        if factor is not None:
            fields["saved.rope_parameters"] = {**fields["saved.rope_parameters"],
                                               "partial_rotary_factor": factor}
        return fields


@pytest.mark.reference
@pytest.mark.usefixtures("single_thread")
def test_derivation_check_names_the_reintroduced_rope_bugs(run_reference_cases):
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.audit.checks.derivation import check_derivation
    from dflash_audit.audit.sides.run_sides import run_candidate
    from dflash_audit.profile import Profile

    planned = plan_synthetic_cases(Profile.load("reference-model"), len(FAMILIES), seed=8)
    cases = {p.case.name.split("-")[2]: p.case for p in planned}
    cases = {k: cases[k] for k in ("gemma3_text", "glm4", "olmo3", "llama")}
    reference = run_reference_cases(list(cases.values()))

    def derivation(candidate, family):
        case = cases[family]
        out, failure = run_candidate(candidate, case)
        assert failure is None
        [result] = check_derivation(case, out, reference[case.name])
        return result

    for family in cases:  # ours: equal to the reference's own derivation
        result = derivation(DrafterCandidate(), family)
        assert result.status == ("warn" if family == "olmo3" else "pass"), result.summary
    assert "reference limitation" in derivation(DrafterCandidate(), "olmo3").summary
    gemma = derivation(Gemma3RopeFallback(), "gemma3_text")
    assert gemma.status == "fail"
    assert set(gemma.details["differing"]) == {"rope_theta", "saved.rope_parameters"}
    assert "rope theta 1e+06 where the verifier's sliding_attention rope_parameters give " \
           "10000" in gemma.summary
    assert derivation(Gemma3RopeFallback(), "llama").status == "pass"  # flat rope: unchanged
    glm = derivation(SavedPartialFactor(), "glm4")
    assert glm.status == "fail" and set(glm.details["differing"]) == {"saved.rope_parameters"}
    assert "a saved partial_rotary_factor 0.5 the draft layers do not apply" in glm.summary


#: Hub configs the proxy must read or refuse (transformers 4 format, as on the Hub).
PHI3_MINI_128K = {
    "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "vocab_size": 32064, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 10 for i in range(48)],
                     "short_factor": [1.0] * 48}, "tie_word_embeddings": False}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "vocab_size": 129280, "rope_theta": 10000}


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "not a JSON object"),
    ("null", "not a JSON object"),
    (json.dumps({**LLAMA31_8B, "num_hidden_layers": "32"}),
     "num_hidden_layers = '32'; it must be a positive integer"),
    (json.dumps({**LLAMA31_8B, "num_hidden_layers": -3}),
     "num_hidden_layers = -3; it must be a positive integer"),
    (json.dumps({**LLAMA31_8B, "num_hidden_layers": 20000}),
     "num_hidden_layers = 20000; a proxy is built at the real depth and dflash-audit takes up "
     "to 512 layers"),
    (json.dumps(DEEPSEEK_V3), "model_type 'deepseek_v3' uses multi-head latent attention"),
    (json.dumps({**QWEN35_27B["text_config"], "layer_types": ["full_attention"] * 2}),
     "refuses this config: Class validation error"),
])
def test_a_config_the_proxy_cannot_use_is_one_line(tmp_path, text, message):
    """Each was a traceback (AttributeError, StrictDataclassError, a RuntimeError in MLA's
    forward) or a proxy built with -3 layers; now a one-line FamilyError."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(FamilyError) as err:
        proxy_config_from_json(tmp_path / "config.json")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_longrope_proxy_builds_and_stays_covered_by_its_real_config(tmp_path):
    """Phi-3's per-frequency longrope factors (48 for head_dim 96) are resampled to the
    proxy's 4 rotated pairs (transformers refused the proxy before); the gate's architecture
    of the proxy equals the real model's."""
    from transformers import AutoConfig

    from dflash_audit.report.fingerprint import verifier_fingerprint

    (tmp_path / "config.json").write_text(json.dumps(PHI3_MINI_128K))
    proxy = proxy_config_from_json(tmp_path / "config.json")
    assert proxy.rope_parameters["long_factor"] == [1.0, 2.6, 4.1, 5.7]  # ids 0, 16, 31, 47 of 48
    assert proxy.rope_parameters["short_factor"] == [1.0] * 4
    ids = torch.randint(0, 128, (1, 6))
    assert torch.isfinite(build_proxy(proxy)(ids).logits).all()
    real = AutoConfig.from_pretrained(tmp_path)
    assert verifier_fingerprint(proxy) == verifier_fingerprint(real)
    assert ours(proxy).rope_parameters["rope_type"] == "longrope"


def test_longrope_with_a_partial_rotation_is_a_named_config_error():
    """Phi-4-mini: longrope factors for 3/4 of the head while the draft layers rotate the whole
    head (the reference's own derivation raises a shape RuntimeError)."""
    from transformers import AutoConfig

    from dflash_audit.model.config import ConfigError

    phi4 = {**copy.deepcopy(PHI3_MINI_128K), "partial_rotary_factor": 0.75,  # transformers
            "num_attention_heads": 24, "num_key_value_heads": 8}  # edits nested rope dicts
    vc = AutoConfig.for_model("phi3", **{k: v for k, v in phi4.items() if k != "model_type"})
    with pytest.raises(ConfigError, match="has 48 short_factor entries for "
                                          "partial_rotary_factor 0.75.*64 pairs"):
        ours(vc)


def test_a_proxy_that_cannot_run_is_refused_before_it_is_cached(tmp_path, monkeypatch):
    """A model_type transformers knows but whose shrunk proxy does not build (dots1: a MoE
    config without n_shared_experts) is a one-line VerifierError, and nothing is cached."""
    from transformers import AutoConfig

    from dflash_audit.data.builtin_verifier import cache_dir, verified_record
    from dflash_audit.data.errors import VerifierError
    from dflash_audit.data.proxy_folder import proxy_verifier_dir

    real_cache = cache_dir()
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "verifiers").mkdir(parents=True)
    (tmp_path / "cache" / "verifiers" / "smollm2-135m").symlink_to(
        real_cache / "verifiers" / "smollm2-135m")
    (tmp_path / "config.json").write_text(AutoConfig.for_model("dots1").to_json_string())
    with pytest.raises(VerifierError) as err:
        proxy_verifier_dir(str(tmp_path / "config.json"))
    assert "a proxy of model_type 'dots1' cannot run or derive a drafter config" in str(
        err.value) and "\n" not in str(err.value)
    builtin = tmp_path / "cache" / "verifiers" / "smollm2-135m"  # and its hashes' record
    assert sorted(p.name for p in builtin.parent.iterdir()
                  if p != verified_record(builtin)) == ["smollm2-135m"]


def test_a_failing_derived_field_is_named_before_the_warn_only_mask_token():
    """The compare output prints the first causes of a FAIL: the mask token (a choice that
    only warns) came first and hid the RoPE cause."""
    from types import SimpleNamespace

    from dflash_audit.audit.checks.derivation import check_derivation

    case = SimpleNamespace(name="real-00-full", verifier=SimpleNamespace(
        name="family:gemma3_text", target_layers="speculators",
        config=family_config("gemma3_text")))
    ref = {"mask_token_id": 2, "rope_theta": 10000.0, "head_dim": 16}
    cand = {"mask_token_id": 16, "rope_theta": 1e6, "head_dim": 16}
    [result] = check_derivation(case, SimpleNamespace(derivation=cand),
                                SimpleNamespace(derivation=ref))
    assert result.status == "fail"
    assert list(result.details["differing"]) == ["rope_theta", "mask_token_id"]
    assert result.summary.split(": ", 1)[1].startswith(
        "rope theta 1e+06 where the verifier's sliding_attention rope_parameters give 10000")


#: (candidate fields, reference fields): spellings the saved config's consumer
#: (transformers' Qwen3Config) and the draft layers treat alike.
SAME_FOR_THE_CONSUMER = [
    ({"saved.use_sliding_window": None}, {"saved.use_sliding_window": False}),  # ModelOpt
    ({"attention_bias": None, "saved.attention_bias": None},
     {"attention_bias": False, "saved.attention_bias": False}),
    ({"saved.tie_word_embeddings": None}, {"saved.tie_word_embeddings": False}),
    ({"head_dim": 8.0, "rms_norm_eps": 1e-5}, {"head_dim": 8, "rms_norm_eps": 1.0e-5}),
    ({"rope_scaling": {}}, {"rope_scaling": None}),
    ({"rope_partial_rotary_factor": 1.0}, {"rope_partial_rotary_factor": None}),
    ({"saved.rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 1.0}},
     {"saved.rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}),
    ({"saved.use_sliding_window": None, "saved.sliding_window": 4096},  # dropped on load
     {"saved.use_sliding_window": False, "saved.sliding_window": None}),
    ({"saved.use_sliding_window": False, "saved.layer_types": None},
     {"saved.use_sliding_window": False, "saved.layer_types": ["full_attention"] * 3}),
]
#: ... and values that change what runs: still differences.
DIFFER_FOR_THE_CONSUMER = [
    ({"saved.use_sliding_window": None}, {"saved.use_sliding_window": True}),
    ({"attention_bias": None}, {"attention_bias": True}),
    ({"rope_partial_rotary_factor": 0.25}, {"rope_partial_rotary_factor": None}),
    ({"rope_scaling": {}}, {"rope_scaling": {"factor": 8.0}}),
    ({"saved.use_sliding_window": True, "saved.sliding_window": 4096},
     {"saved.use_sliding_window": True, "saved.sliding_window": 2048}),
    ({"saved.use_sliding_window": False, "saved.layer_types": None},
     {"saved.use_sliding_window": False, "saved.layer_types": ["sliding_attention"] * 3}),
    ({"saved.sliding_window": 0}, {"saved.sliding_window": None}),  # no use_sliding_window
]


@pytest.mark.parametrize("cand, ref", SAME_FOR_THE_CONSUMER + DIFFER_FOR_THE_CONSUMER)
def test_equivalent_config_spellings_are_equal(cand, ref):
    """A derived or saved config field differs only where its consumer behaves differently
    (None / False / a missing key for a boolean off, 8 / 8.0, {} / None for no scaling, ...):
    ModelOpt's saved ``use_sliding_window: None`` against the reference's ``False`` was a
    FAIL."""
    from types import SimpleNamespace

    from dflash_audit.audit.checks.derivation import check_derivation

    case = SimpleNamespace(name="syn-000-llama-full", verifier=SimpleNamespace(
        name="family:llama", target_layers="speculators", config=family_config("llama")))
    common = {"hidden_size": 32}
    [result] = check_derivation(case, SimpleNamespace(derivation={**common, **cand}),
                                SimpleNamespace(derivation={**common, **ref}))
    differ = (cand, ref) in DIFFER_FOR_THE_CONSUMER
    assert result.status == ("fail" if differ else "pass"), result.summary
    assert bool(result.details["differing"]) == differ
    if differ:  # the raw values are what the report shows
        key = next(iter(result.details["differing"]))
        assert result.details["differing"][key] == {"candidate": cand[key],
                                                    "reference": ref[key]}


def test_a_verifier_that_is_not_causal_is_refused(tmp_path, monkeypatch):
    """BERT has a causal-LM head in transformers (BertLMHeadModel) but attends to later
    tokens unless is_decoder: its proxy was built and audited as a verifier before."""
    from dflash_audit.data.builtin_verifier import cache_dir
    from dflash_audit.data.errors import VerifierError
    from dflash_audit.data.proxy_folder import proxy_verifier_dir

    real_cache = cache_dir()
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "verifiers").mkdir(parents=True)
    (tmp_path / "cache" / "verifiers" / "smollm2-135m").symlink_to(
        real_cache / "verifiers" / "smollm2-135m")
    bert = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522}
    (tmp_path / "config.json").write_text(json.dumps(bert))
    with pytest.raises(VerifierError, match="model_type 'bert' is not a causal LM"):
        proxy_verifier_dir(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({**bert, "is_decoder": True}))
    assert proxy_verifier_dir(str(tmp_path / "config.json"))[1].is_dir()  # causal: accepted
