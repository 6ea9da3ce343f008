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

The stand-ins and the engine definitions loaded with them are in
:mod:`dflash_audit.serve.probes.sglang_runtime`; this module reads the fields.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_audit.serve.fields import (
    MASK_EMBEDDING_FILE,
    MASK_EMBEDDING_ROW,
    SideRecord,
    layer_key,
)
from dflash_audit.serve.probes.engine_source import Provenance
from dflash_audit.serve.probes.sglang_runtime import (
    DFLASH,
    FLASHINFER,
    HF_CONFIG,
    NOTES,
    QWEN3,
    ROPE,
    SPEC_HOOK,
    TORCH_NATIVE,
    UTILS,
    WORKER,
    NotRunHere,
    sglang_code,
)

SIDE = "SGLang 0.5.23"


# --------------------------------------------------------------------------- the probe

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
    rec.set("mask_embedding.source",
            MASK_EMBEDDING_FILE if (ckpt / MASK_EMBEDDING_FILE).exists() else MASK_EMBEDDING_ROW,
            f"{WORKER}:_maybe_merge_trained_mask_embedding (writes the vector of the checkpoint "
            f"folder's {MASK_EMBEDDING_FILE}, when os.path.exists, into the target's embedding row "
            "mask_token_id; the worker needs a target, so the file's presence is read here)")


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
