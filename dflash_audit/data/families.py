"""Verifier family proxies: tiny, seeded, random-weight Hugging Face causal LMs built offline.

A DFlash drafter depends on its verifier through a handful of config facts: depth and
``layer_types`` (full, sliding, linear-attention layers), the final norm's convention
(``x*w`` or Gemma-style ``x*(1+w)``), ``rope_parameters`` (flat, nested per layer type,
``partial_rotary_factor``, scaling), ``head_dim`` independent of ``hidden_size /
num_attention_heads``, RMSNorm eps, activation, tied embeddings and the vocabulary. A proxy
keeps those and shrinks only the width, so it builds in well under a second from the
transformers config classes (no download) and runs on CPU.

``family_config(name)`` gives the config of one built-in family, ``proxy_config_from_json``
shrinks a user's real ``config.json`` (real depth and layer types), ``build_proxy`` makes a
seeded fp32 eval model from either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_audit.user_input import loads_json

if TYPE_CHECKING:
    import torch

#: Width of a proxy: hidden size, attention heads, KV heads, vocabulary.
PROXY_HIDDEN, PROXY_HEADS, PROXY_KV_HEADS, PROXY_VOCAB = 32, 4, 2, 128


class FamilyError(ValueError):
    """An unknown family name, or a config.json a proxy cannot be built from."""


def _pattern(n: int, period: int, odd: str, other: str) -> list[str]:
    """``other`` except every ``period``-th layer (1-based), which is ``odd``."""
    return [odd if (i + 1) % period == 0 else other for i in range(n)]


def _families(n: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Family name -> (transformers config class, overrides) for an n-layer proxy."""
    return {
        "llama": ("LlamaConfig", {  # Llama 3.1: llama3 rope scaling, untied
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256},
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
        "qwen3": ("Qwen3Config", {  # head_dim 16 != H / heads = 8; tied (Qwen3-0.6B)
            "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
        "qwen3_5": ("Qwen3_5TextConfig", {  # hybrid: 3 linear-attention + 1 full, x*(1+w)
            "head_dim": 16, "layer_types": _pattern(n, 4, "full_attention", "linear_attention"),
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25},
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
        "gemma3_text": ("Gemma3TextConfig", {  # nested rope per layer type, 5:1 sliding, x*(1+w)
            "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
            "layer_types": _pattern(n, 6, "full_attention", "sliding_attention"),
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True}),
        "mistral": ("MistralConfig", {  # sliding window on every layer, flat rope
            "sliding_window": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
        "gpt_oss": ("GptOssConfig", {  # yarn rope, alternating sliding, attention bias, MoE
            "head_dim": 8, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
            "layer_types": _pattern(n, 2, "full_attention", "sliding_attention"),
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 32},
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
        "olmo3": ("Olmo3Config", {  # nested rope, both entries present, 3:1 sliding
            "sliding_window": 8, "layer_types": _pattern(n, 4, "full_attention",
                                                         "sliding_attention"),
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0}},
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
        "glm4": ("Glm4Config", {  # GLM-4: partial rotary 0.5, attention bias, tiny eps
            "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5},
            "attention_bias": True, "rms_norm_eps": 1.5625e-07, "tie_word_embeddings": False}),
    }


#: Built-in families, in the order the synthetic spread cycles through them.
FAMILIES = tuple(_families(4))


def family_config(name: str, num_hidden_layers: int = 6, vocab_size: int = PROXY_VOCAB) -> Any:
    """The transformers config of a built-in family's proxy (H=32, 4 heads, 2 KV heads).

    Raises:
        FamilyError: unknown family (the message lists the known ones).
    """
    table = _families(num_hidden_layers)
    if name not in table:
        raise FamilyError(f"unknown verifier family {name!r}; use one of {', '.join(table)}")
    import transformers

    cls_name, overrides = table[name]
    H = PROXY_HIDDEN
    return getattr(transformers, cls_name)(**{
        "hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": PROXY_HEADS,
        "num_key_value_heads": PROXY_KV_HEADS, "num_hidden_layers": num_hidden_layers,
        "vocab_size": vocab_size, "max_position_embeddings": 1024, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, **overrides})


#: Width fields of a real config a proxy shrinks, and their proxy values.
_SHRINK = {"intermediate_size": 2 * PROXY_HIDDEN, "moe_intermediate_size": PROXY_HIDDEN,
           "shared_expert_intermediate_size": PROXY_HIDDEN, "num_experts": 4,
           "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "vocab_size": PROXY_VOCAB}


def _shrunk_head_dim(d: dict[str, Any]) -> int:
    """head_dim of the proxy: H/heads, or twice it when the real one is independent of
    hidden_size / num_attention_heads (kept independent)."""
    base = PROXY_HIDDEN // PROXY_HEADS
    real = d.get("head_dim")
    if real and int(real) * int(d["num_attention_heads"]) != int(d["hidden_size"]):
        return 2 * base
    return base


def _shrink_mrope(rope: dict[str, Any], head_dim: int) -> None:
    """Rescale an ``mrope_section`` (in place) to the proxy's rotary half-dim, same split."""
    section = rope.get("mrope_section")
    if not section:
        return
    half = int(head_dim * float(rope.get("partial_rotary_factor", 1.0))) // 2
    total = sum(section)
    new = [max(1, round(s * half / total)) for s in section]
    new[0] += half - sum(new)
    rope["mrope_section"] = new


#: Config keys of multi-head latent attention (DeepSeek-V2/V3, Kimi K2, LongCat): its
#: low-rank query/key/value projections and split rope/nope head dims do not shrink into a
#: proxy, and DFlash's draft layers (standard grouped-query attention) do not derive from it.
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _shrink_rope_factors(rope: dict[str, Any], rotary_half: int) -> None:
    """Resample longrope's per-frequency ``short_factor`` / ``long_factor`` lists (in place)
    to the proxy's rotary half-dim, evenly spaced so the low-to-high frequency profile is
    kept (transformers requires one factor per rotated frequency)."""
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if isinstance(factors, list) and factors and len(factors) != rotary_half:
            last = len(factors) - 1
            rope[key] = [factors[round(i * last / max(1, rotary_half - 1))]
                         for i in range(rotary_half)]


#: Deepest verifier config a proxy is built for (a proxy keeps the real depth).
MAX_PROXY_LAYERS = 512


def _checked_text_config(d: Any, file: Path) -> dict[str, Any]:
    """The decoder's part of a parsed config.json (its ``text_config`` when it has one),
    checked for what a proxy needs.

    Raises:
        FamilyError: not a JSON object, no positive integer depth / width, or multi-head
            latent attention (:data:`MLA_KEYS`).
    """
    if not isinstance(d, dict):
        raise FamilyError(f"{file}: not a JSON object (a Hugging Face config.json is one); "
                          "pass your verifier's config.json")
    text = d.get("text_config")
    d = text if isinstance(text, dict) and text else d
    for key in ("num_hidden_layers", "hidden_size"):
        value = d.get(key)
        if key in d and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise FamilyError(f"{file}: {key} = {value!r}; it must be a positive integer")
    depth = d.get("num_hidden_layers")
    if isinstance(depth, int) and depth > MAX_PROXY_LAYERS:
        raise FamilyError(f"{file}: num_hidden_layers = {depth}; a proxy is built at the real "
                          f"depth and dflash-audit takes up to {MAX_PROXY_LAYERS} layers (the "
                          "deepest released LLMs have under 200); check the config")
    mla = [k for k in MLA_KEYS if d.get(k)]
    if mla:
        raise FamilyError(f"{file}: model_type {d.get('model_type')!r} uses multi-head latent "
                          f"attention ({', '.join(mla)}), which dflash-audit does not support "
                          "(DFlash's draft layers use grouped-query attention); use "
                          "--verifier family:NAME for the closest supported family")
    return d


def proxy_config_from_json(path: str | Path) -> Any:
    """A proxy config from a user's real ``config.json`` (a file or the folder holding it):
    the real depth, ``layer_types``, rope, norm family, eps, activation, tied embeddings and
    sliding window, with the width shrunk (H=32, 4 heads, 2 KV heads, vocab 128, experts and
    linear-attention heads cut). Multimodal configs use their ``text_config``.

    Raises:
        FamilyError: unreadable file, no ``model_type``, a model_type this transformers does
            not know, or a config that is not a decoder LM.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        d = loads_json(file.read_text())
    except (OSError, ValueError) as exc:
        raise FamilyError(f"cannot read verifier config {file}: {exc}") from None
    d = _checked_text_config(d, file)
    from transformers import AutoConfig

    model_type = d.get("model_type")
    try:
        cls = type(AutoConfig.for_model(model_type))
    except (ValueError, KeyError):
        raise FamilyError(f"{file}: model_type {model_type!r} is unknown to this transformers; "
                          "upgrade transformers or use --verifier family:NAME") from None
    if "num_hidden_layers" not in d or "hidden_size" not in d:
        raise FamilyError(f"{file}: no num_hidden_layers / hidden_size: not a decoder LM config")
    d = {**d, "num_attention_heads": d.get("num_attention_heads") or PROXY_HEADS}
    head_dim = _shrunk_head_dim(d)
    shrunk = {k: v for k, v in _SHRINK.items() if k in d}
    kv = d.get("num_key_value_heads")
    rope = json.loads(json.dumps(d.get("rope_parameters") or {}))
    legacy = json.loads(json.dumps(d.get("rope_scaling") or {}))  # transformers 4 configs
    for entry in [rope, legacy, *(v for v in rope.values() if isinstance(v, dict))]:
        _shrink_mrope(entry, head_dim)
        factor = entry.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        _shrink_rope_factors(entry, int(head_dim * float(factor or 1.0)) // 2)
    if legacy:
        shrunk["rope_scaling"] = legacy
    d.pop("architectures", None)
    d.pop("auto_map", None)
    d.pop("quantization_config", None)
    try:
        config = cls(**{**d, **shrunk, "hidden_size": PROXY_HIDDEN,
                      "num_attention_heads": PROXY_HEADS,
                      "num_key_value_heads": PROXY_HEADS if kv and int(kv) == int(
                          d["num_attention_heads"]) else PROXY_KV_HEADS,
                      "head_dim": head_dim, **({"rope_parameters": rope} if rope else {})})
    except Exception as exc:  # noqa: BLE001 - transformers' validation (StrictDataclassError...)
        raise FamilyError(f"{file}: transformers' {cls.__name__} refuses this config: "
                          f"{one_line(exc)}; fix the config.json") from None
    for i, tok in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        value = getattr(config, tok, None)  # the file's or the class default (Phi-3: 32000)
        if isinstance(value, int) and value >= PROXY_VOCAB:
            setattr(config, tok, PROXY_VOCAB - 1 - i)
        elif isinstance(value, list):
            setattr(config, tok, [PROXY_VOCAB - 1])
    return config


def build_proxy(config: Any, seed: int = 0) -> torch.nn.Module:
    """A seeded random-weight fp32 eval causal LM for ``config`` (eager attention).

    Norm gains are drawn around their identity (``x*w`` ones, Gemma-style ``x*(1+w)``
    zeros) so a norm applied in the wrong convention changes the numbers.
    """
    import torch  # here: a family name is checked before any heavy import
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                 dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.rand_like(p) * 0.5 - 0.25)
    return model.eval()


def resolve_verifier_spec(spec: str, num_hidden_layers: int = 6) -> Any:
    """``family:NAME`` -> a built-in family's config; a path -> a shrunk user config.

    Raises:
        FamilyError: unknown family or unreadable config.
    """
    if spec.startswith("family:"):
        return family_config(spec.split(":", 1)[1], num_hidden_layers=num_hidden_layers)
    return proxy_config_from_json(spec)
