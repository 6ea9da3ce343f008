"""What SGLang 0.5.23 will run for a DFlash drafter checkpoint, computed by SGLang's own code.

Run as ``python sglang_probe.py CHECKPOINT_DIR OUT_JSON`` with the engine's cached site folder
and this project's root on ``PYTHONPATH``; writes a :class:`~dflash_audit.serve.fields.
SideRecord`.

The ``sglang`` package cannot be imported on a CPU machine with only torch and transformers:
``sglang/__init__.py`` and ``sglang/srt/utils/__init__.py`` import triton, zmq, starlette,
orjson and the engine's runtime, and ``models/dflash.py`` / ``speculative/dflash_utils.py``
import its kernels. So the probe

- enters ``sglang``, ``sglang.srt`` and ``sglang.srt.utils`` as bare packages (their
  ``__init__`` not run) and imports the one light module it needs as a module:
  ``sglang/srt/utils/hf_transformers_patches.py`` (``apply_all``, the transformers patches
  SGLang applies at import);
- compiles, from the installed files (verified against the wheel's RECORD), the engine's own
  functions and classes that read the config and build the draft model: ``get_config`` and
  ``HfModelConfigParser`` (config loading), ``parse_dflash_draft_config`` /
  ``DFlashDraftConfig`` and the layer-type helpers, ``DFlashDraftModel`` /
  ``DFlashDecoderLayer`` / ``DFlashAttention`` / ``DFlashMLP`` (run on the meta device),
  ``get_rope``, ``get_rope_config`` and the torch-native backend's sliding-window mask;
- binds the runtime those use (tensor-parallel linears, RMSNorm kernels, RadixAttention, the
  rotary classes) to recorders that keep the arguments SGLang passes them. Every replacement is
  listed in the record's ``notes``.
"""

from __future__ import annotations

import __future__ as _future
import ast
import enum
import hashlib
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_audit.serve.fields import SideRecord, layer_key
from dflash_audit.serve.probes.engine_source import (
    EngineSourceError,
    Provenance,
    record_sha256,
    site_folder,
)

SIDE = "SGLang 0.5.23"
DFLASH = "sglang/srt/models/dflash.py"
UTILS = "sglang/srt/speculative/dflash_utils.py"
HF_CONFIG = "sglang/srt/utils/hf_transformers/config.py"
HF_COMMON = "sglang/srt/utils/hf_transformers/common.py"
RADIX = "sglang/srt/layers/radix_attention.py"
ROPE = "sglang/srt/layers/rotary_embedding/factory.py"
TORCH_NATIVE = "sglang/srt/layers/attention/torch_native_backend.py"
WORKER = "sglang/srt/speculative/dflash_worker_v2.py"
SPEC_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
QWEN3 = "sglang/srt/models/qwen3.py"
FLASHINFER = "sglang/srt/layers/attention/flashinfer_backend.py"

NOTES = [
    "sglang/__init__.py, sglang/srt/utils/__init__.py not run (they import triton, zmq and "
    "the serving runtime); sglang.srt.utils.hf_transformers_patches.apply_all() is run",
    "config reading: SGLang's get_config and HfModelConfigParser.parse run as compiled from "
    f"{HF_CONFIG}; replaced: lru_cache_frozenset (no cache), get_model_config_parser (the 'hf' "
    "parser only), load_pointer_adapter (None when the folder has no head.pt), "
    "_CONFIG_REGISTRY (SGLang's own config classes: a model_type of theirs is not run here), "
    "AutoConfig is transformers' (SGLang registers its own model types only)",
    "draft model: DFlashDraftModel.__init__ runs on the meta device with recorders for "
    "QKV/Row/Column/Merged/ReplicatedLinear, RMSNorm/GemmaRMSNorm, SiluAndMul, "
    "VocabParallelEmbedding, RadixAttention and the rotary classes get_rope returns; "
    "get_parallel() is tp_size=1",
    "layers.{i}.sliding_window is SGLang's window_left + 1 (SGLang stores window_left = "
    f"sliding_window - 1, {UTILS}:get_dflash_attention_sliding_window_size); kv >= q - "
    "window_left is kv > q - W",
]


class NotRunHere(Exception):
    """A step of SGLang's that this probe cannot run on this machine (the reason)."""


# --------------------------------------------------------------------------- engine code

def engine_defs(relative: str, names: list[str], bindings: dict[str, Any] | None = None,
                ) -> tuple[dict[str, Any], dict[str, Provenance]]:
    """Like :func:`~dflash_audit.serve.probes.engine_source.engine_functions`, for the
    top-level functions, classes and assignments ``names`` of an engine file, compiled with
    the file's own ``from __future__ import annotations`` (so signatures need no bindings)."""
    site = site_folder(relative.split("/")[0])
    path = site / relative
    if not path.is_file():
        raise EngineSourceError(f"{relative} is not in the installed engine ({site})")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    recorded = record_sha256(site, relative)
    if recorded is not None and recorded != digest:
        raise EngineSourceError(f"{path} differs from its wheel's RECORD: reinstall the engine")
    tree = ast.parse(data, filename=str(path))
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id in names:
                    found[t.id] = node
    missing = [n for n in names if n not in found]
    if missing:
        raise EngineSourceError(f"{relative} defines no {', '.join(missing)}: the adapter was "
                                "written for SGLang 0.5.23")
    constants = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 and _literal(n.value) and n not in found.values()]
    order = sorted(set(map(id, found.values())))
    body = constants + [n for n in tree.body if id(n) in order]
    flags = _future.annotations.compiler_flag if any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names) for n in tree.body) else 0
    # a module of its own in sys.modules: a dataclass with string annotations looks it up
    module = types.ModuleType(f"engine_source:{relative}")
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update({"__builtins__": __builtins__, **(bindings or {})})
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", flags=flags,
                 dont_inherit=True), ns)  # noqa: S102 - the engine's own code
    return ({n: ns[n] for n in names},
            {n: Provenance(relative, n, found[n].lineno, digest) for n in names})


def _literal(node: ast.AST | None) -> bool:
    if node is None:
        return False
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def enter_bare_packages() -> None:
    """``sglang``, ``sglang.srt``, ``sglang.srt.utils`` as packages whose ``__init__`` is not
    run, so a light submodule can be imported as itself."""
    site = site_folder("sglang")
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(site / name.replace(".", "/"))]
            sys.modules[name] = mod


# --------------------------------------------------------------------------- recorders

class Recorded(nn.Module):
    """A replaced runtime module: keeps the arguments SGLang built it with."""

    kind = "module"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


def recorder(name: str) -> type[Recorded]:
    return type(name, (Recorded,), {"kind": name})


@dataclass
class _Parallel:
    tp_size: int = 1
    tp_rank: int = 0


def _passthrough_cache(*_a: Any, **_k: Any):
    return lambda f: f


# --------------------------------------------------------------------------- the probe

def sglang_code(ckpt: Path) -> dict[str, Any]:
    """Compile the SGLang functions and classes the probe runs; returns them by name with
    their provenance under ``"_prov"``."""
    import transformers
    from transformers import AutoConfig, PretrainedConfig

    enter_bare_packages()
    from sglang.srt.utils.hf_transformers_patches import apply_all, normalize_rope_scaling_compat

    apply_all()
    prov: dict[str, Provenance] = {}
    common_t = {"Any": Any, "Optional": typing.Optional, "List": typing.List,
                "Tuple": typing.Tuple, "Dict": typing.Dict, "Sequence": typing.Sequence,
                "Union": typing.Union, "torch": torch, "Path": Path, "dataclass": dataclass,
                "os": __import__("os"), "json": json}

    f, p = engine_defs(HF_COMMON, ["get_rope_config", "check_gguf_file", "get_hf_text_config",
                                   "_patch_text_config", "_is_deepseek_ocr_model",
                                   "_is_deepseek_ocr2_model"],
                       {**common_t, "PretrainedConfig": PretrainedConfig,
                        "normalize_rope_scaling_compat": normalize_rope_scaling_compat})
    prov.update(p)
    code = dict(f)
    f, p = engine_defs("sglang/srt/utils/runai_utils.py", ["is_runai_obj_uri"], common_t)
    prov.update(p)
    code.update(f)
    f, p = engine_defs(HF_COMMON, ["resolve_runai_obj_uri"], {**common_t, **code})
    prov.update(p)
    code.update(f)
    f, p = engine_defs("sglang/srt/utils/common.py", ["is_remote_url"],
                       {**common_t, "re": __import__("re")})
    prov.update(p)
    code.update(f)
    f, p = engine_defs("sglang/srt/utils/hf_transformers/mistral_utils.py",
                       ["is_mistral_model"], common_t)
    prov.update(p)
    code.update(f)

    registry = _SglangRegistry()

    def load_pointer_adapter(model_path: str, revision: Any) -> Any:
        if (Path(model_path) / "head.pt").exists():
            raise NotRunHere("a Kev LoRA pointer checkpoint (head.pt): not probed")
        return None

    class _NotSglangConfig:  # isinstance(config, DeepseekV41Config) is False for ours
        pass

    parser_holder: dict[str, Any] = {}
    f, p = engine_defs(HF_CONFIG, ["_set_architectures", "_try_load_longcat_config",
                                   "_try_load_raw_mamba_config", "HfModelConfigParser",
                                   "get_config"],
                       {**common_t, **code, "copy": __import__("copy"),
                        "PretrainedConfig": PretrainedConfig, "AutoConfig": AutoConfig,
                        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": _LazyCausalLMNames(),
                        "_CONFIG_REGISTRY": registry, "ModelConfigParserBase": object,
                        "register_model_config_parser": _passthrough_cache,
                        "lru_cache_frozenset": _passthrough_cache,
                        "get_model_config_parser": lambda name: parser_holder[name],
                        "DeepseekV41Config": _NotSglangConfig,
                        "POINTER_ADAPTER_BASES": {}})
    prov.update(p)
    code.update(f)
    parser_holder["hf"] = f["HfModelConfigParser"]()
    # get_config imports load_pointer_adapter inside the function: give it this module's
    sys.modules.setdefault("sglang.srt.configs", types.ModuleType("sglang.srt.configs"))
    model_config = types.ModuleType("sglang.srt.configs.model_config")
    model_config.load_pointer_adapter = load_pointer_adapter
    sys.modules["sglang.srt.configs.model_config"] = model_config

    f, p = engine_defs(RADIX, ["AttentionType"], {"Enum": enum.Enum})
    prov.update(p)
    code.update(f)
    from numbers import Integral

    f, p = engine_defs(UTILS, ["DEFAULT_DFLASH_MASK_TOKEN", "build_target_layer_ids",
                               "get_dflash_layer_types",
                               "get_dflash_attention_sliding_window_size", "_cfg_get",
                               "_get_text_config", "_get_dflash_config",
                               "is_nemotron_35_draft_config", "_parse_optional_int",
                               "DFlashDraftConfig", "parse_dflash_draft_config"],
                       {**common_t, "Integral": Integral})
    prov.update(p)
    code.update(f)

    rope_classes = _rope_class_names()
    rope_bind = {n: recorder(n) for n in rope_classes}
    f, p = engine_defs(ROPE, ["get_rope"], {**common_t, **rope_bind,
                                            "_get_live_rope_cache_entry": lambda key: None})
    prov.update(p)
    engine_get_rope = f["get_rope"]

    def get_rope(*args: Any, **kwargs: Any) -> Any:
        """SGLang's get_rope, keeping the arguments DFlashAttention.__init__ gave it."""
        built = engine_get_rope(*args, **kwargs)
        built._sglang_call = {"head_size": args[0] if args else kwargs["head_size"], **kwargs}
        return built

    code["get_rope"] = get_rope

    runtime = {n: recorder(n) for n in (
        "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
        "ReplicatedLinear", "RowParallelLinear", "RMSNorm", "GemmaRMSNorm", "SiluAndMul",
        "VocabParallelEmbedding", "RadixAttention")}
    f, p = engine_defs(DFLASH, ["_ROPE_DIM_SUPERSEDED_KEYS", "_get_dflash_attention_type",
                                "_get_dflash_layer_attention_params", "DFlashAttention",
                                "DFlashMLP", "DFlashDecoderLayer", "DFlashDraftModel"],
                       {**common_t, **code, **runtime, "nn": nn, "F": torch.nn.functional,
                        "partial": __import__("functools").partial,
                        "get_parallel": lambda: _Parallel(), "get_spec": _no_spec,
                        "_is_npu": False, "logger": __import__("logging").getLogger("sglang"),
                        "DraftParallelSpec": lambda **kw: kw,
                        "DraftTPExecution": types.SimpleNamespace(SINGLE_GROUP="single"),
                        "set_weight_attrs": lambda *a, **k: None,
                        "sharded_weight_loader": lambda *a, **k: None,
                        "get_compiler_backend": lambda: "eager"})
    prov.update(p)
    code.update(f)

    f, p = engine_defs(TORCH_NATIVE, ["TorchNativeAttnBackend"],
                       {**common_t, "AttentionBackend": object,
                        "AttentionType": code["AttentionType"],
                        "scaled_dot_product_attention": None, "SWAKVPool": None,
                        "KVWriteLoc": None, "ForwardBatch": None})
    prov.update(p)
    code.update(f)
    code["_prov"] = prov
    del transformers
    return code


class _LazyCausalLMNames(dict):
    """transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, imported when get_config reads it
    (its GGUF branch only): importing modeling_auto costs seconds."""

    def _names(self) -> dict[str, str]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def __contains__(self, key: object) -> bool:
        return key in self._names()

    def __getitem__(self, key: str) -> str:
        return self._names()[key]


def _no_spec() -> Any:
    raise NotRunHere("get_spec(): the server's speculative arguments (a Nemotron 3.5 / "
                     "attention-sink draft needs them)")


class _SglangRegistry(dict):
    """Stands for SGLang's ``_CONFIG_REGISTRY`` (its own config classes, imported with its
    runtime): membership answers by the model types SGLang's config classes declare; using
    one is not run here."""

    def __init__(self) -> None:
        super().__init__()
        site = site_folder("sglang")
        types_: set[str] = set()
        for path in sorted((site / "sglang/srt/configs").glob("*.py")):
            for node in ast.walk(ast.parse(path.read_bytes())):
                if isinstance(node, ast.ClassDef):
                    for stmt in node.body:
                        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                                and isinstance(stmt.targets[0], ast.Name)
                                and stmt.targets[0].id == "model_type"
                                and isinstance(stmt.value, ast.Constant)):
                            types_.add(stmt.value.value)
        self.model_types = types_

    def __contains__(self, key: object) -> bool:
        if key in self.model_types:
            raise NotRunHere(f"model_type {key!r} is loaded by SGLang's own config class "
                             "(sglang/srt/configs), which imports its runtime")
        return False

    def __getitem__(self, key: str) -> Any:
        raise NotRunHere(f"model_type {key!r} is loaded by SGLang's own config class "
                         "(sglang/srt/configs), which imports its runtime")


def _rope_class_names() -> list[str]:
    site = site_folder("sglang")
    tree = ast.parse((site / ROPE).read_bytes())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_rope")
    return sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                   and isinstance(n.ctx, ast.Load) and n.id[:1].isupper()
                   and n.id.endswith("Embedding")})


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"


def _src(prov: dict[str, Provenance], name: str) -> str:
    return str(prov[name])


def probe(ckpt: Path, rec: SideRecord) -> None:
    code = sglang_code(ckpt)
    prov = code["_prov"]
    rec.notes.extend(NOTES)
    src_get_config = f"{HF_CONFIG}:get_config -> HfModelConfigParser.parse"

    # 1. the config, read as SGLang reads --speculative-draft-model-path
    raw = json.loads((ckpt / "config.json").read_text())
    if "speculators_model_type" in raw:
        rec.notes.append("SGLang 0.5.23 has no reader for the speculators format: no file of "
                         "the wheel names speculators_model_type / transformer_layer_config; "
                         "the folder goes to transformers' AutoConfig as it is")
    try:
        config = code["get_config"](str(ckpt), trust_remote_code=False)
    except NotRunHere as exc:
        rec.not_run["config"] = f"not run here: {exc}"
        return
    except (ValueError, OSError, TypeError, KeyError) as exc:
        rec.refused = f"{_one_line(exc)} (raised in {src_get_config})"
        return
    draft_cfg = code["parse_dflash_draft_config"](draft_hf_config=config)

    # 2. the draft model as SGLang builds it (DFlashDraftModel.__init__), on the meta device
    try:
        with torch.device("meta"):
            model = code["DFlashDraftModel"](config=config)
    except NotRunHere as exc:
        rec.not_run["model"] = f"not run here: {exc}"
        return
    except (ValueError, AssertionError, TypeError, KeyError, AttributeError) as exc:
        rec.refused = (f"{_one_line(exc)} (raised in {DFLASH}:DFlashDraftModel.__init__)")
        return
    init = f"{DFLASH}:DFlashDraftModel.__init__"
    attn_init = f"{DFLASH}:DFlashAttention.__init__"
    at = code["AttentionType"]

    # sizes as DFlashDraftModel / DFlashAttention read them
    first = model.layers[0].self_attn
    rec.set("num_hidden_layers", len(model.layers), init)
    rec.set("hidden_size", int(config.hidden_size), init)
    rec.set("num_attention_heads", first.total_num_heads, attn_init)
    rec.set("num_key_value_heads", first.total_num_kv_heads, attn_init)
    rec.set("head_dim", first.head_dim, attn_init)
    rec.set("intermediate_size", int(getattr(config, "intermediate_size", 0)),
            f"{DFLASH}:DFlashMLP.__init__")
    rec.set("rms_norm_eps", model.rms_norm_eps, init)
    rec.set("hidden_act", getattr(config, "hidden_act", "silu"), f"{DFLASH}:DFlashMLP.__init__")
    rec.set("norm.one_plus_weight", type(model.norm).__name__ == "GemmaRMSNorm",
            f"{init} (GemmaRMSNorm if config.use_gemma_norm else RMSNorm)")

    # 3. per layer: RadixAttention's window / type, and the backend's window semantics
    for i, layer in enumerate(model.layers):
        radix = layer.self_attn.attn
        window = int(radix.kwargs["sliding_window_size"])
        attn_type = radix.kwargs["attn_type"]
        src = (f"{DFLASH}:_get_dflash_layer_attention_params via "
               f"DFlashAttention.__init__ -> RadixAttention(sliding_window_size, attn_type)")
        rec.set(layer_key(i, "attention"), "full" if window == -1 else "sliding", src)
        rec.set(layer_key(i, "sliding_window"), None if window == -1 else window + 1, src)
        rec.set(layer_key(i, "block_causal"), attn_type == at.DECODER,
                f"{DFLASH}:_get_dflash_attention_type (DECODER causal, ENCODER_ONLY not)")
        if window == -1:
            rec.set(layer_key(i, "window_origin"), None, src)
        else:
            origin = window_origin(code["TorchNativeAttnBackend"], window, draft_cfg)
            rec.set(layer_key(i, "window_origin"), origin,
                    f"{TORCH_NATIVE}:TorchNativeAttnBackend._make_sliding_window_mask (run "
                    f"on positions); {FLASHINFER}:1427 window_left=layer.sliding_window_size")
            if attn_type != at.DECODER:
                rec.notes.append(
                    f"layer {i}: a non-causal sliding layer: the torch-native backend drops "
                    f"its window ({TORCH_NATIVE}:forward_extend passes sliding_window_size "
                    f"only when causal); FlashInfer keeps window_left ({FLASHINFER}:1427)")

    # 4. RoPE: what DFlashAttention.__init__ passed to get_rope, and what get_rope built
    rope = first.rotary_emb
    rope_src = f"{attn_init} -> {_src(prov, 'get_rope_config')}"
    kwargs = first_rope_call(first)
    rec.set("rope.theta", float(kwargs["base"]), rope_src)
    scaling = kwargs["rope_scaling"]
    rec.set("rope.type", "default" if scaling is None else
            scaling.get("rope_type", scaling.get("type")),
            f"{ROPE}:get_rope -> {type(rope).__name__}")
    extra = None if scaling is None else {
        k: v for k, v in scaling.items() if k not in ("rope_type", "type", "rope_theta")}
    rec.set("rope.scaling", extra or None, rope_src)
    rotary_dim = int(rope.args[1]) if len(rope.args) > 1 else int(rope.kwargs["rotary_dim"])
    rec.set("rope.rotary_dim", rotary_dim,
            f"{attn_init} (rope_dim / partial_rotary_factor) -> {ROPE}:get_rope "
            f"-> {type(rope).__name__}(rotary_dim)")
    rec.set("rope.neox_style", bool(kwargs["is_neox_style"]),
            f"{attn_init} (config.rope_is_neox_style / is_neox_style, default True)")
    rec.set("rope.max_positions", int(kwargs["max_position"]),
            f"{attn_init} (config.max_position_embeddings, default 32768)")

    # 5. context features, block, mask, vocab, heads
    ids = draft_cfg.target_layer_ids
    tl_src = (f"{UTILS}:DFlashDraftConfig.resolve_target_layer_ids (SGLang id k = after "
              f"target layer k, HF style); {QWEN3}:set_dflash_layers_to_capture captures "
              "before layer k+1 = speculators id k+1")
    if ids is None:
        rec.not_run["target_layer_ids"] = (
            "not run here: the config names no target_layer_ids; SGLang picks "
            f"build_target_layer_ids(target num_hidden_layers, draft layers) from the served "
            f"target model ({UTILS}:build_target_layer_ids), which this probe does not have")
        rec.notes.append(f"fc.in_features counts {model.num_context_features} features: "
                         "without target_layer_ids DFlashDraftModel.__init__ takes as many as "
                         "the draft has layers")
    else:
        rec.set("target_layer_ids", [int(k) + 1 for k in ids], tl_src)
    rec.set("fc.in_features", int(model.fc.in_features),
            f"{init} (num_context_features * hidden_size)")
    rec.set("block_size", int(model.block_size),
            f"{UTILS}:DFlashDraftConfig.resolve_block_size (dflash_config.block_size or "
            f"block_size, default 16); {SPEC_HOOK}:_handle_dflash infers "
            "--speculative-num-draft-tokens from it")
    rec.set("num_speculative_tokens", int(model.block_size) - 1,
            f"{WORKER}:_DflashDraftSampler (block position 0 is the anchor/bonus token, "
            "drafts are positions 1..B-1)")
    rec.set("sample_from_anchor", False,
            f"{WORKER}:_DflashDraftSampler.__call__ (hidden_states[:, 1:]: slot 0 is the "
            "verified token, never drafted)")
    if is_nemotron := bool(code["is_nemotron_35_draft_config"](config)):
        rec.notes.append("a Nemotron 3.5 layout (non-anchor query layout): not audited")
    if draft_cfg.mask_token_id is not None:
        rec.set("mask_token_id", draft_cfg.mask_token_id,
                f"{UTILS}:parse_dflash_draft_config (dflash_config.mask_token_id or "
                "mask_token_id)")
    else:
        rec.not_run["mask_token_id"] = (
            f"not run here: the config has no mask_token_id; SGLang looks "
            f"{draft_cfg.mask_token!r} up in the target tokenizer "
            f"({WORKER}:_resolve_mask_token_id)")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    rec.set("draft_vocab_size", vocab,
            f"{WORKER}:_DflashDraftSampler (argmax over the target lm_head's whole vocab; "
            "draft_vocab_size / d2t are not read)")
    rec.set("draft_vocab.mapping", "none",
            f"{WORKER}:_DflashDraftSampler (no d2t in SGLang's DFlash path)")
    rec.set("lm_head.source", "target",
            f"{WORKER}:_DflashDraftSampler (the target lm_head); {DFLASH}:"
            "DFlashDraftModel.load_weights ignores lm_head.weight (no such parameter)")
    emb_src = (f"{WORKER}:_resolve_dflash_embedding_module; {DFLASH}:DFlashDraftModel.forward"
               " (input_embeds required)")
    rec.set("embed_tokens.source", "checkpoint" if is_nemotron else "target", emb_src)


def first_rope_call(attn: Any) -> dict[str, Any]:
    """The arguments DFlashAttention.__init__ passed to get_rope (kept by the wrapper)."""
    return attn.rotary_emb._sglang_call


def window_origin(backend: Any, window_left: int, draft_cfg: Any) -> str:
    """Run SGLang's torch-native sliding-window mask on a block of B slots after a context,
    positions as the draft runs them (slot s at anchor + s), and say where the window counts
    back from: ``"query"`` when each slot's own position, ``"anchor"`` when the block's."""
    block = int(draft_cfg.resolve_block_size(default=16))
    ctx = window_left + 2 * block + 2
    n = ctx + block
    mask = backend._make_sliding_window_mask(q_len=n, kv_len=n, sliding_window_size=window_left,
                                             device=torch.device("cpu"))
    anchor = ctx
    kv = torch.arange(n)
    for s in range(block):
        q = anchor + s
        row = mask[q]
        by_query = (kv <= q) & (kv >= q - window_left)
        if not torch.equal(row, by_query):
            raise RuntimeError("SGLang's sliding-window mask is neither query- nor anchor-"
                               "relative: the adapter needs a look")
    last = mask[anchor + block - 1]
    return "query" if not bool(last[anchor - window_left - 1]) and block > 1 else "anchor"


def main(argv: list[str]) -> int:
    ckpt, out = Path(argv[1]), Path(argv[2])
    rec = SideRecord(SIDE)
    probe(ckpt, rec)
    rec.write(out)
    return 0


if __name__ == "__main__":
    from dflash_audit.audit.sides.candidate_runner import die_with_parent

    die_with_parent()  # a kill -9 of serve-check leaves no probe running
    sys.exit(main(sys.argv))
