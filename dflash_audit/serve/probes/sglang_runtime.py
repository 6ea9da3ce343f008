"""The SGLang probe's runtime stand-ins and the engine's definitions loaded with them.

Holds what :mod:`dflash_audit.serve.probes.sglang_probe` runs instead of SGLang 0.5.23's
runtime: the paths of the engine's files the probe reads; ``sglang``, ``sglang.srt`` and
``sglang.srt.utils`` entered as bare packages (:func:`enter_bare_packages`); the recorders and
stubs bound in place of its kernels and runtime (:class:`Recorded`, the config registry, the
tensor-parallel state, ``get_spec``); and :func:`sglang_code`, which compiles the engine's own
functions and classes from the installed files (verified against the wheel's RECORD) with
those bound. :data:`NOTES` lists every replacement for the record's ``notes``; the probe proper
(the fields it reads into the SideRecord, ``main``) stays in ``sglang_probe``.
"""

from __future__ import annotations

import ast
import enum
import json
import logging
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_audit.serve.probes.engine_source import (
    EngineFile,
    Provenance,
    engine_functions,
    site_folder,
)

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

    f, p = engine_functions(HF_COMMON, ["get_rope_config", "check_gguf_file", "get_hf_text_config",
                                   "_patch_text_config", "_is_deepseek_ocr_model",
                                   "_is_deepseek_ocr2_model"],
                       {**common_t, "PretrainedConfig": PretrainedConfig,
                        "normalize_rope_scaling_compat": normalize_rope_scaling_compat})
    prov.update(p)
    code = dict(f)
    f, p = engine_functions("sglang/srt/utils/runai_utils.py", ["is_runai_obj_uri"], common_t)
    prov.update(p)
    code.update(f)
    f, p = engine_functions(HF_COMMON, ["resolve_runai_obj_uri"], {**common_t, **code})
    prov.update(p)
    code.update(f)
    f, p = engine_functions("sglang/srt/utils/common.py", ["is_remote_url"],
                       {**common_t, "re": __import__("re")})
    prov.update(p)
    code.update(f)
    f, p = engine_functions("sglang/srt/utils/hf_transformers/mistral_utils.py",
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
    f, p = engine_functions(HF_CONFIG, ["_set_architectures", "_try_load_longcat_config",
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

    f, p = engine_functions(RADIX, ["AttentionType"], {"Enum": enum.Enum})
    prov.update(p)
    code.update(f)
    from numbers import Integral

    f, p = engine_functions(UTILS, ["DEFAULT_DFLASH_MASK_TOKEN", "build_target_layer_ids",
                               "get_dflash_layer_types",
                               "get_dflash_attention_sliding_window_size", "_cfg_get",
                               "_get_text_config", "_get_dflash_config",
                               "is_nemotron_35_draft_config", "_parse_optional_int",
                               "DFlashDraftConfig", "parse_dflash_draft_config"],
                       {**common_t, "Integral": Integral})
    prov.update(p)
    code.update(f)

    rope = EngineFile(ROPE)  # parsed and checked against the RECORD once
    get_rope_node = next(n for n in rope.tree.body
                         if isinstance(n, ast.FunctionDef) and n.name == "get_rope")
    rope_bind = {n: recorder(n) for n in _rope_class_names(get_rope_node)}
    stubs = {"_get_live_rope_cache_entry": lambda key: None}
    f, p = rope.definitions(["get_rope", *_module_helpers(rope.tree, get_rope_node, stubs)],
                            {**common_t, **rope_bind, **stubs, "logger": logging.getLogger(
                                "sglang.srt.layers.rotary_embedding.factory")})
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
    f, p = engine_functions(DFLASH, ["_ROPE_DIM_SUPERSEDED_KEYS", "_get_dflash_attention_type",
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

    f, p = engine_functions(TORCH_NATIVE, ["TorchNativeAttnBackend"],
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


def _module_helpers(tree: ast.Module, function: ast.FunctionDef, bound: dict[str, Any]
                    ) -> list[str]:
    """The module-level functions of the engine file ``tree`` that ``function`` calls,
    directly or through one another (e.g. ``get_rope`` -> ``_get_rope_param`` on its yarn,
    llama3 and dynamic paths: without them every scaled RoPE ended in a NameError, exit 2),
    less those ``bound`` to stubs; compiled from the same file as the function."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    found: list[str] = []
    todo = [function]
    while todo:
        for node in ast.walk(todo.pop()):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and \
                    node.id in defs and node.id not in bound and node.id != function.name and \
                    node.id not in found:
                found.append(node.id)
                todo.append(defs[node.id])
    return found


def _rope_class_names(fn: ast.FunctionDef) -> list[str]:
    """The rotary-embedding classes ``get_rope`` (``fn``) may build: recorded, not run."""
    return sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                   and isinstance(n.ctx, ast.Load) and n.id[:1].isupper()
                   and n.id.endswith("Embedding")})
