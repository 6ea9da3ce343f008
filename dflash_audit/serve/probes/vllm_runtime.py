"""The vLLM probe's runtime stand-ins and the engine's definitions loaded with them.

Holds what :mod:`dflash_audit.serve.probes.vllm_probe` runs instead of vLLM 0.33.0's runtime:
the paths of the engine's files the probe reads; ``vllm`` and ``vllm.config`` entered as bare
packages (:func:`enter_bare_packages`); recorders standing in for the classes the engine
constructs (rotary embeddings, the weights loader and mapper); and the engine's functions and
methods compiled from the installed files (checked against the wheel's RECORD) with those
stand-ins bound: FlexAttention's sliding-window ``mask_mod`` (:func:`flex_sliding_mask_mod`),
``get_rope`` (:func:`run_get_rope`) and ``DFlashQwen3ForCausalLM.load_weights``
(:func:`run_load_weights`). Each replacement is listed in the record's ``notes``; the probe
proper (the fields it reads into the SideRecord, ``main``) stays in ``vllm_probe``.
"""

from __future__ import annotations

import collections.abc
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

from dflash_audit.serve.fields import MASK_EMBEDDING_FILE, MASK_EMBEDDING_ROW
from dflash_audit.serve.probes.engine_source import EngineFile, engine_functions

QWEN3_DFLASH = "vllm/model_executor/models/qwen3_dflash.py"
ROPE_INIT = "vllm/model_executor/layers/rotary_embedding/__init__.py"
FLEX = "vllm/v1/attention/backends/flex_attention.py"
SPECULATIVE = "vllm/config/speculative.py"
VLLM_CONFIG = "vllm/config/vllm.py"
EAGLE3_UTILS = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
EAGLE_UTILS = "vllm/v1/worker/gpu/spec_decode/eagle/utils.py"
DFLASH_UTILS = "vllm/v1/worker/gpu/spec_decode/dflash/utils.py"
SPEC_UTILS = "vllm/v1/worker/gpu/spec_decode/utils.py"
DFLASH_SPECULATOR = "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"
MODEL_UTILS = "vllm/model_executor/models/utils.py"
TU_CONFIG = "vllm/transformers_utils/config.py"
SPECULATORS_BASE = "vllm/transformers_utils/configs/speculators/base.py"
SPECULATORS_ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"
INTERFACES = "vllm/model_executor/models/interfaces.py"
LAYERNORM = "vllm/model_executor/layers/layernorm.py"


# ---------------------------------------------------------------- the engine's source
def enter_bare_packages(rec, site: Path) -> None:
    """``vllm`` and ``vllm.config`` as packages whose ``__init__`` is not run, so their plain
    submodules load from their own files."""
    # vllm.config's __init__ does not import on CPU; its plain utils module does. vllm's own
    # __init__ only re-exports the engine and imports vllm.env_override (torch._inductor
    # settings, ~5 s here): neither reads a config, so the package is entered bare too.
    for name in ("vllm", "vllm.config"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(site.joinpath(*name.split(".")))]
        sys.modules.setdefault(name, pkg)
    rec.notes.append("vllm and vllm.config entered as bare packages (vllm/__init__ imports "
                     "env_override's torch._inductor settings; vllm/config/__init__ imports "
                     "cbor2/zmq/the tokenizer stack): vllm.transformers_utils and "
                     "vllm.config.utils (getattr_iter, used by patch_rope_parameters) load "
                     "from their own files")


class _Recorder:
    """Stands in for a class the engine constructs (a rotary embedding, a weights loader):
    keeps the arguments it was given."""

    made: list[_Recorder] = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        _Recorder.made.append(self)


def _recorder(name: str) -> type:
    return type(name, (_Recorder,), {})


def flex_sliding_mask_mod(site: Path, rec):
    """FlexAttention's sliding-window mask_mod compiled from the wheel: a function of W
    giving the engine's mask_mod for that window."""
    import torch

    flex = EngineFile(FLEX, site)
    fn, line = flex.method("FlexAttentionMetadata", "get_sliding_window_mask_mod",
                           {"torch": torch})
    rec.notes.append(f"{FLEX}:FlexAttentionMetadata.get_sliding_window_mask_mod (line {line}) "
                     "compiled and run with self.sliding_window = W, uses_paged_kv = False "
                     "(logical indices)")
    return lambda w: fn(NS(sliding_window=w, uses_paged_kv=False, doc_ids=None))


def run_get_rope(site: Path, rec, head_dim, max_position, neox, rope_params) -> dict:
    """get_rope compiled from the wheel and run with its rotary classes replaced by
    recorders: the class it picked and the arguments it gave it."""
    import torch

    src = EngineFile(ROPE_INIT, site)
    classes = {n: _recorder(n) for n in src.imported_names() if n[0].isupper()}
    funcs, prov = engine_functions(ROPE_INIT, ["get_rope"], {"torch": torch, "Any": Any,
                                                             **classes})
    rec.notes.append(f"{prov['get_rope']} compiled and run with its rotary-embedding classes "
                     "replaced by recorders of their arguments (the classes build kernels)")
    _Recorder.made.clear()
    emb = funcs["get_rope"](head_dim, max_position=max_position, is_neox_style=neox,
                            rope_parameters=rope_params)
    args = list(emb.args)
    return {"class": type(emb).__name__, "rotary_dim": args[1], "max_position": args[2],
            "type": rope_params.get("rope_type", "default")}


def dflash_functions(rec, Qwen3Config) -> tuple[Any, Any, dict[str, Any]]:
    """qwen3_dflash.py's deciding functions compiled from the wheel, with
    ``get_current_vllm_config()`` bound to the returned runner stand-in
    (``use_v2_model_runner``), and eagle3_utils' ``get_eagle3_aux_layers_from_config``;
    returns (runner, aux_fn, the qwen3_dflash functions by name)."""
    runner = NS(use_v2_model_runner=True)
    e3, e3_prov = engine_functions(EAGLE3_UTILS, ["get_eagle3_aux_layers_from_config"],
                                   {"SpeculativeConfig": object})
    aux_fn = e3["get_eagle3_aux_layers_from_config"]
    qd, qd_prov = engine_functions(
        QWEN3_DFLASH, ["_dflash_layer_causal", "dflash_has_any_non_causal",
                       "_get_dflash_fc_input_size", "_resolve_layer_attention"],
        {"Qwen3Config": Qwen3Config, "VllmConfig": object,
         "get_current_vllm_config": lambda: runner,
         "get_eagle3_aux_layers_from_config": aux_fn})
    rec.notes.append(f"{QWEN3_DFLASH}: _resolve_layer_attention, _dflash_layer_causal, "
                     "dflash_has_any_non_causal, _get_dflash_fc_input_size compiled from the "
                     "wheel; get_current_vllm_config() replaced by an object with "
                     "use_v2_model_runner (True = vLLM 0.33.0's default runner, then False)")
    return runner, aux_fn, qd


def run_load_weights(rec, site: Path, ckpt: Path, torch) -> tuple[Any, dict[str, Any]]:
    """DFlashQwen3ForCausalLM.load_weights on the checkpoint's names and tensors (loader and
    mapper replaced by recorders); returns the model stand-in it ran on and what the loader
    was given (the mapper under ``"__mapper__"``)."""
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                tensors[k] = st.get_tensor(k)
    loaded: dict[str, Any] = {}

    class Loader:
        def __init__(self, model):
            pass

        def load_weights(self, weights, mapper=None):
            for name, t in weights:
                loaded[name] = t
            loaded["__mapper__"] = mapper

    class Mapper:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    mu, _ = engine_functions(MODEL_UTILS, ["process_eagle_weight"],
                             {"supports_any_eagle": lambda m: True, "nn": torch.nn})
    qd = EngineFile(QWEN3_DFLASH, site)
    load, line = qd.method("DFlashQwen3ForCausalLM", "load_weights",
                           {"process_eagle_weight": mu["process_eagle_weight"],
                            "WeightsMapper": Mapper, "AutoWeightsLoader": Loader,
                            "Iterable": collections.abc.Iterable, "torch": torch})
    shipped = (ckpt / MASK_EMBEDDING_FILE).is_file()
    model = NS(model=NS(use_aux_hidden_state=True, has_separate_mask_embedding=False,
                        _build_fused_kv_buffers=lambda: None),
               # its file check (a stand-in tensor: the vector itself changes no field)
               _read_mask_embedding=lambda: torch.zeros(1) if shipped else None)
    load(model, iter(tensors.items()))
    rec.set("mask_embedding.source",
            MASK_EMBEDDING_FILE if model.model.has_separate_mask_embedding else MASK_EMBEDDING_ROW,
            f"{QWEN3_DFLASH}:DFlashQwen3ForCausalLM.load_weights (_read_mask_embedding: "
            f"{MASK_EMBEDDING_FILE} {'in' if shipped else 'not in'} the checkpoint folder -> "
            "has_separate_mask_embedding) -> embed_input_ids")
    rec.notes.append(f"{QWEN3_DFLASH}:DFlashQwen3ForCausalLM.load_weights (line {line}) run on "
                     "the checkpoint's tensors with AutoWeightsLoader / WeightsMapper replaced by "
                     "recorders; supports_any_eagle -> True (DFlashQwen3ForCausalLM is an "
                     "Eagle3 model)")
    return model, loaded


def captured_order(site: Path, aux: list[int], torch) -> tuple[list[int] | None, str]:
    """The target layer ids ``aux`` (``get_eagle3_aux_layers_from_config``'s) in the order the
    target hands their hidden states to ``fc``: the engine's own
    ``EagleModelMixin._maybe_add_hidden_state`` run in its layer loop (layer 0, 1, ...) with
    ``aux_hidden_state_layers = aux``; it appends a layer's state when the layer is in the
    list, so the order is the layers' (ascending, each once), not the config's. Returns the
    ids (None without any) and their source."""
    source = (f"{EAGLE3_UTILS}:get_eagle3_aux_layers_from_config (the ids the target captures "
              "after that many layers: speculators convention)")
    if not aux:
        return None, source
    add, line = EngineFile(INTERFACES, site).method("EagleModelMixin", "_maybe_add_hidden_state",
                                                    {"torch": torch})
    model, states = NS(aux_hidden_state_layers=tuple(aux)), []
    # the loop's layers that decide the order: each listed id and its neighbours, ascending
    # (a layer between two of them appends nothing; an id of 2e8 is no 2e8 calls)
    for layer in sorted({0} | {j for i in aux for j in (i - 1, i, i + 1) if j >= 0}):
        states = add(model, states, layer, torch.tensor(float(layer)), None)
    return [int(t) for t in states], (f"{source}, in the order {INTERFACES}:EagleModelMixin."
                                      f"_maybe_add_hidden_state (line {line}) appends them in "
                                      "the target's layer loop")


def uses_gemma_norm(site: Path) -> bool:
    return "GemmaRMSNorm" in (site / QWEN3_DFLASH).read_text()
