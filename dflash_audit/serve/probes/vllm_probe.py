"""What vLLM 0.33.0 will run for a DFlash drafter checkpoint, decided by vLLM's own code.

Run as ``python vllm_probe.py CHECKPOINT_DIR OUT_JSON`` with the engine's cached site folder
first on ``PYTHONPATH`` (:func:`dflash_audit.serve.engines.run_probe`); writes a
:class:`~dflash_audit.serve.fields.SideRecord`.

On CPU with only torch/transformers, vLLM's config reading imports and runs as it is
(``vllm.transformers_utils.config.get_config``, the speculators conversion
``configs/speculators/{base,algos}.py``, ``EAGLEConfig``, ``set_default_rope_theta``); the one
package that does not import (``vllm.config``: its ``__init__`` pulls cbor2, zmq, the
tokenizer stack) is entered as a bare package so that its plain submodule ``vllm.config.utils``
(``getattr_iter``, used by ``patch_rope_parameters``) loads from its own file. The model
module ``qwen3_dflash.py``, the proposer, the attention backends and the rotary-embedding
factory stop at vLLM's kernels / runtime on import: their deciding functions, methods and
single statements are compiled from the installed files (checked against the wheel's RECORD)
with the runtime names they read bound to small stand-ins, each listed in ``notes``.

A ``ValueError`` / ``NotImplementedError`` / ... raised inside vLLM's (or transformers') code
while it reads the checkpoint is the engine refusing it: ``refused`` holds it in one line.
The stand-ins and the engine definitions bound to them are in
:mod:`dflash_audit.serve.probes.vllm_runtime`; this module reads the fields.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace as NS

from dflash_audit.serve.probes.engine_source import EngineFile
from dflash_audit.serve.probes.vllm_runtime import (
    DFLASH_SPECULATOR, DFLASH_UTILS, EAGLE_UTILS, FLEX, LAYERNORM,
    MODEL_UTILS, QWEN3_DFLASH, ROPE_INIT, SPEC_UTILS, SPECULATIVE, SPECULATORS_ALGOS,
    SPECULATORS_BASE, TU_CONFIG, VLLM_CONFIG, captured_order, dflash_functions,
    enter_bare_packages, flex_sliding_mask_mod, run_get_rope, run_load_weights,
    uses_gemma_norm)

SIDE = "vLLM 0.33.0"


class Refused(Exception):
    """vLLM's own code raised on this checkpoint (the message is the engine's)."""


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _raised_in_engine(exc: BaseException, site: Path) -> bool:
    """The innermost frame of ``exc`` is in vLLM's or transformers' files."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    if isinstance(exc, NameError) or "SimpleNamespace" in str(exc):
        return False  # a runtime name this probe did not bind: the probe's bug, not a refusal
    return last is not None and ("/vllm/" in last or "/transformers/" in last
                                 or last.startswith(str(site)))


# ---------------------------------------------------------------- the probe
def probe(rec, ckpt: Path, site: Path) -> None:
    from dflash_audit.serve.fields import layer_key
    from dflash_audit.serve.probes.engine_source import engine_functions

    enter_bare_packages(rec, site)
    import torch
    import vllm.transformers_utils.config as tuc
    from transformers import Qwen3Config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.loads((ckpt / "config.json").read_text())
    speculators = raw.get("speculators_config") is not None
    fmt = "speculators" if speculators else "z-lab"
    rec.notes.append(f"checkpoint format: {fmt} "
                     + ("(speculators_model_type " + repr(raw.get("speculators_model_type"))
                        + ": get_config -> SpeculatorsConfig.from_pretrained -> algos.py:"
                          "update_dflash)" if speculators else
                        "(plain config.json: get_config -> transformers AutoConfig, wrapped by "
                        "SpeculativeConfig in EAGLEConfig(method='dflash') as for "
                        "--speculative-config '{\"method\": \"dflash\", \"model\": ...}')"))

    # 1. vLLM's reading of the config --------------------------------------------------
    serve_spec: dict | None = None
    if speculators:
        try:
            _, _, serve_spec = tuc.maybe_override_with_speculators(
                str(ckpt), None, trust_remote_code=False)
            rec.notes.append(f"`vllm serve CHECKPOINT` (the speculators route) serves the "
                             f"verifier named in the checkpoint with {serve_spec}")
        except ValueError as exc:
            rec.notes.append("`vllm serve CHECKPOINT` (the speculators route) refuses it: "
                             f"{one_line(exc)} (transformers_utils/config.py:"
                             "maybe_override_with_speculators); served through --model TARGET "
                             "--speculative-config instead")
    cfg = tuc.get_config(str(ckpt), trust_remote_code=False)
    config_src = f"{TU_CONFIG}:get_config"
    if speculators:
        config_src = f"{SPECULATORS_ALGOS}:update_dflash"
    elif not isinstance(cfg, (EAGLEConfig, SpeculatorsConfig)):
        cfg = EAGLEConfig(cfg, method="dflash", model_type="eagle")
        config_src = f"{TU_CONFIG}:get_config + transformers_utils/configs/eagle.py:EAGLEConfig"
    arch = list(getattr(cfg, "architectures", None) or [])
    rec.notes.append(f"architectures after vLLM's reading: {arch} (registry: DFlashDraftModel "
                     "-> qwen3_dflash.DFlashQwen3ForCausalLM)")
    if "DFlashDraftModel" not in arch:
        rec.notes.append("this probe follows qwen3_dflash.py (DFlashDraftModel) only")

    # the qwen3_dflash module's deciding functions --------------------------------------
    runner, aux_fn, qd = dflash_functions(rec, Qwen3Config)

    # 3. RoPE default theta, as DFlashQwen3DecoderLayer.__init__ applies it -------------
    layer_cfg = raw.get("transformer_layer_config", raw) if speculators else raw
    in_ckpt = "rope_theta" in (layer_cfg.get("rope_parameters") or {}) or "rope_theta" in layer_cfg
    had_theta = "rope_theta" in (getattr(cfg, "rope_parameters", None) or {})
    tuc.set_default_rope_theta(cfg, default_theta=1000000)
    if in_ckpt:
        theta_src = f"{config_src} (the checkpoint's rope_theta)"
    elif had_theta:
        theta_src = ("transformers configuration_utils.py:PreTrainedConfig.__init__ -> "
                     "modeling_rope_utils.py:convert_rope_params_to_dict (default_theta "
                     f"{type(cfg).default_theta}: the checkpoint has rope_parameters without "
                     "rope_theta; vLLM's set_default_rope_theta(1000000) then keeps it)")
    else:
        theta_src = (f"{TU_CONFIG}:set_default_rope_theta (default_theta=1000000, from "
                     f"{QWEN3_DFLASH}:DFlashQwen3DecoderLayer.__init__)")

    # sizes, as DFlashQwen3DecoderLayer / DFlashQwen3Attention read them
    n_layers = int(cfg.num_hidden_layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_src = f"{QWEN3_DFLASH}:DFlashQwen3DecoderLayer.__init__"
    rec.set("num_hidden_layers", n_layers, f"{QWEN3_DFLASH}:DFlashQwen3Model.__init__")
    rec.set("hidden_size", cfg.hidden_size, attn_src)
    rec.set("num_attention_heads", cfg.num_attention_heads, attn_src)
    rec.set("num_key_value_heads", cfg.num_key_value_heads, attn_src)
    rec.set("head_dim", head_dim, f"{QWEN3_DFLASH}:DFlashQwen3Attention.__init__ (head_dim or "
                                  "hidden_size // num_heads)")
    rec.set("intermediate_size", cfg.intermediate_size, attn_src)
    rec.set("rms_norm_eps", cfg.rms_norm_eps, attn_src)
    rec.set("hidden_act", cfg.hidden_act, attn_src)

    # 2. per-layer attention ------------------------------------------------------------
    mask_mod_fn = None
    mixed_v1 = None
    for i in range(n_layers):
        window, causal = qd["_resolve_layer_attention"](cfg, i)
        src = f"{QWEN3_DFLASH}:_resolve_layer_attention"
        rec.set(layer_key(i, "attention"), "sliding" if window is not None else "full", src)
        rec.set(layer_key(i, "sliding_window"), window, src)
        rec.set(layer_key(i, "block_causal"), bool(causal),
                f"{QWEN3_DFLASH}:_dflash_layer_causal")
        if window is None:
            rec.set(layer_key(i, "window_origin"), None, src)
            continue
        if mask_mod_fn is None:
            mask_mod_fn = flex_sliding_mask_mod(site, rec)
        origin = _window_origin(mask_mod_fn, int(window), torch)
        if origin == "query" and not any("counted back from each query" in n for n in rec.notes):
            rec.notes.append(
                f"sliding window W={window}: vLLM's mask keeps kv with |q - kv| < W, q the "
                "slot's own position (slot s of a block at anchor a sees context from "
                "a + s - W + 1): counted back from each query; the reference trains every "
                "slot with kv >= a - W, so even slot 0 sees one context token fewer and slot "
                "s sees s + 1 fewer")
        rec.set(layer_key(i, "window_origin"), origin,
                f"{FLEX}:FlexAttentionMetadata.get_sliding_window_mask_mod "
                "(per_layer_sliding_window, run on index tensors)")
    # the V1 runner
    runner.use_v2_model_runner = False
    try:
        for i in range(n_layers):
            qd["_resolve_layer_attention"](cfg, i)
        v1 = "runs"
    except NotImplementedError as exc:
        mixed_v1 = one_line(exc)
        v1 = f"refused: {mixed_v1}"
    finally:
        runner.use_v2_model_runner = True
    rec.set("runner.v1_model_runner", v1, f"{QWEN3_DFLASH}:_resolve_layer_attention")
    vc = EngineFile(VLLM_CONFIG, site)
    needs_multi, line = vc.method("VllmConfig", "_dflash_needs_multi_kv_group", {})
    multi = needs_multi(NS(speculative_config=NS(method="dflash",
                                                 draft_model_config=NS(hf_config=cfg))))
    if multi:
        rec.notes.append(
            "mixed sliding/full draft: vLLM 0.33.0 runs it on the V2 model runner only "
            f"(its default). With VLLM_USE_V2_MODEL_RUNNER=0 (or when anything else sends "
            f"the engine to V1) config/vllm.py:_get_v1_model_runner_unsupported_features "
            f"rejects it first ('Model Runner V1 does not support: mixed sliding/full dflash "
            f"drafts', VllmConfig._dflash_needs_multi_kv_group line {line} -> True), and "
            f"qwen3_dflash.py:_resolve_layer_attention would raise: {mixed_v1} (vLLM issue "
            "50710: one KV-cache group per drafter on V1)")
    non_causal = qd["dflash_has_any_non_causal"](cfg)
    rec.notes.append(f"dflash_has_any_non_causal -> {non_causal}: the draft's attention backend "
                     + ("must support non-causal attention (use_non_causal=True)" if non_causal
                        else "runs every layer causal (use_non_causal=False)"))

    # 3. RoPE ---------------------------------------------------------------------------
    rope_params = dict(getattr(cfg, "rope_parameters", None) or {})
    rec.set("rope.theta", float(rope_params["rope_theta"]), theta_src)
    neox = getattr(cfg, "is_neox_style", True)
    rec.set("rope.neox_style", bool(neox), f"{attn_src} (getattr(config, 'is_neox_style', "
                                           "True))")
    rope = run_get_rope(site, rec, head_dim, cfg.max_position_embeddings, neox, rope_params)
    rec.set("rope.type", rope["type"], f"{ROPE_INIT}:get_rope (-> {rope['class']})")
    rec.set("rope.scaling", {k: v for k, v in rope_params.items()
                             if k not in ("rope_type", "rope_theta")} or None,
            f"{ROPE_INIT}:get_rope (rope_parameters besides rope_type / rope_theta)")
    rec.set("rope.rotary_dim", rope["rotary_dim"], f"{ROPE_INIT}:get_rope")
    rec.set("rope.max_positions", rope["max_position"],
            f"{ROPE_INIT}:get_rope (max_position=config.max_position_embeddings from "
            f"{attn_src})")
    sp = EngineFile(SPECULATIVE, site)
    cache_only = sp.constant("_CACHE_ONLY_ROPE_TYPES")
    sizes_only, _ = engine_functions(SPECULATIVE, ["_rope_only_sizes_cache"],
                                     {"iter_rope_parameters": tuc.iter_rope_parameters,
                                      "_CACHE_ONLY_ROPE_TYPES": cache_only,
                                      "PreTrainedConfig": object})
    raised = bool(sizes_only["_rope_only_sizes_cache"](cfg))
    rec.set("rope.max_positions_raised_to_target", raised,
            f"{SPECULATIVE}:SpeculativeConfig._maybe_override_draft_max_position_embeddings")
    rec.notes.append(
        f"rope.max_positions: the draft's max_position_embeddings "
        f"({cfg.max_position_embeddings}) sizes the rotary cache; "
        + ("vLLM raises it to the target's max_model_len when that is larger (rope types "
           f"{sorted(cache_only)} only sizes the cache; vLLM PR 57964 class)" if raised else
           "vLLM does NOT raise it for this RoPE type: VllmConfig limits the served "
           "max_model_len to the draft's instead"))

    # 4. target layers, fc, mask token, block, vocabulary --------------------------------
    spec = NS(draft_model_config=NS(hf_config=cfg), method="dflash")
    aux = aux_fn(spec)
    rec.set("target_layer_ids", *captured_order(site, list(aux or []), torch))
    rec.notes.append(f"vLLM's dflash_config.target_layer_ids = "
                     f"{(getattr(cfg, 'dflash_config', None) or {}).get('target_layer_ids')} "
                     "(aux - 1, z-lab convention); eagle_aux_hidden_state_layer_ids = "
                     f"{getattr(cfg, 'eagle_aux_hidden_state_layer_ids', None)}")
    rec.set("fc.in_features", qd["_get_dflash_fc_input_size"](NS(speculative_config=spec)),
            f"{QWEN3_DFLASH}:_get_dflash_fc_input_size (target_hidden_size or hidden_size "
            "x aux layers)")
    su, _ = engine_functions(SPEC_UTILS, ["get_parallel_drafting_token_id"])
    rec.set("mask_token_id", su["get_parallel_drafting_token_id"](cfg),
            f"{SPEC_UTILS}:get_parallel_drafting_token_id")

    spd = EngineFile(DFLASH_SPECULATOR, site)
    check, line = spd.statement("DFlashSpeculator", "__init__", "sample_from_anchor",
                                ["dflash_config"], {})
    check(getattr(cfg, "dflash_config", None) or {})  # raises ValueError: refused on V2
    rec.set("sample_from_anchor", False,
            f"{DFLASH_SPECULATOR}:DFlashSpeculator.__init__ (line {line}: True is refused, "
            "then self.sample_from_anchor = False)")
    if speculators:
        nst = SpeculatorsConfig.extract_vllm_speculative_config(raw)["num_speculative_tokens"]
        rec.set("num_speculative_tokens", nst,
                f"{SPECULATORS_BASE}:SpeculatorsConfig.build_vllm_speculative_config "
                "(proposal_methods[0].speculative_tokens)")
        rec.set("block_size", nst + 1,
                f"{DFLASH_SPECULATOR}:DFlashSpeculator.__init__ (num_query_per_req = 1 + "
                "num_speculative_steps: bonus token + masks)")
        rec.notes.append("vLLM reads no block_size for dflash: a block is the bonus (anchor) "
                         "token + num_speculative_tokens mask slots; the checkpoint's "
                         f"block_size {raw.get('block_size')} is not read. "
                         "num_speculative_tokens is taken from the checkpoint on `vllm serve "
                         "CHECKPOINT` only; with --speculative-config the user's value wins")
    else:
        why = ("vLLM takes it from the user only (--speculative-config num_speculative_tokens);"
               " without one config/speculative.py:SpeculativeConfig.__post_init__ raises "
               "'A speculative model was provided, but `num_speculative_tokens` was not "
               "provided' (this format has no n_predict / proposal_methods)")
        rec.not_run["num_speculative_tokens"] = why
        rec.not_run["block_size"] = ("1 + the user's num_speculative_tokens (DFlashSpeculator "
                                     "num_query_per_req); vLLM reads no block_size for dflash")

    draft_vocab = getattr(cfg, "draft_vocab_size", None) or getattr(cfg, "vocab_size", None)
    rec.set("draft_vocab_size", draft_vocab,
            f"{QWEN3_DFLASH}:DFlashQwen3ForCausalLM.__init__ (draft_vocab_size, else "
            "vocab_size)")
    _weights(rec, site, ckpt, cfg, draft_vocab, torch)
    rec.set("norm.one_plus_weight", False,
            f"{QWEN3_DFLASH}:DFlashQwen3Model.__init__ / DFlashQwen3DecoderLayer.__init__ "
            f"(vllm {LAYERNORM}:RMSNorm, x * w; no GemmaRMSNorm)")
    if uses_gemma_norm(site):
        rec.notes.append("qwen3_dflash.py names GemmaRMSNorm: recheck norm.one_plus_weight")

    rec.not_run["attention_backend"] = (
        "not run here: needs CUDA: vLLM picks the draft's attention backend on the GPU "
        f"(use_non_causal={non_causal}); window_origin is from FlexAttention's "
        "sliding-window mask_mod, FLASH_ATTN's window (sliding_window - 1, 0) is also counted "
        "back from each query (flash_attn.py:166)")
    rec.not_run["context_kv"] = (
        "not run here: needs CUDA: DFlashQwen3Model.precompute_and_store_context_kv (fc -> "
        "hidden_norm -> k_norm -> RoPE of the context keys) runs vllm._custom_ops kernels")


def _window_origin(mask_mod_for, w: int, torch) -> str:
    """Run the engine's mask_mod for a block at anchor position a (slot s at a + s, context
    at positions < a): 'anchor' if every slot sees context back to a - W, 'query' if slot s
    sees back to a + s - W + 1."""
    mod = mask_mod_for(w)
    a = 4 * w
    kv = torch.arange(a)
    first = []
    for s in range(3):
        allowed = mod(torch.tensor(0), torch.tensor(0), torch.tensor(a + s), kv)
        first.append(int(kv[allowed].min()) if bool(allowed.any()) else None)
    if all(f == a - w for f in first):
        return "anchor"
    if all(f == a + s - w + 1 for s, f in enumerate(first)):
        return "query"
    return f"other: first visible context position per slot {first} (anchor {a}, W {w})"


def _weights(rec, site: Path, ckpt: Path, cfg, draft_vocab, torch) -> None:
    """DFlashQwen3ForCausalLM.load_weights on the checkpoint's names and tensors (loader
    replaced by a recorder), then the V2 runner's sharing rule for lm_head / embed_tokens."""
    from dflash_audit.serve.probes.engine_source import engine_functions

    model, loaded = run_load_weights(rec, site, ckpt, torch)
    dropped = loaded["__mapper__"].kwargs.get("orig_to_new_substr", {})
    vocab = int(cfg.vocab_size)
    has_d2t = "draft_id_to_target_id" in loaded
    if draft_vocab != vocab:
        mapping = "d2t offsets" if has_d2t else "d2t offsets (all zero: no d2t in checkpoint)"
    else:
        mapping = "none"
    rec.set("draft_vocab.mapping", mapping,
            f"{QWEN3_DFLASH}:DFlashQwen3ForCausalLM.load_weights / compute_logits (target id = "
            "i + draft_id_to_target_id[i], only when draft_vocab_size != the target's vocab)")
    if draft_vocab != vocab and not has_d2t:
        rec.notes.append("draft_vocab_size != vocab_size but no d2t: vLLM drops the mapping "
                         f"({dropped}) and keeps a zero draft_id_to_target_id: draft id i is "
                         "served as target id i")
    rec.notes.append("the target's vocabulary size is taken as the draft config's vocab_size "
                     "(vLLM compares draft_vocab_size with the target model's get_vocab_size())")

    eu, _ = engine_functions(EAGLE_UTILS, ["_should_share"], {"torch": torch, "nn": torch.nn})
    should_share = eu["_should_share"]
    hidden = int(cfg.hidden_size)
    share_src = (f"{DFLASH_UTILS}:load_dflash_model (V2 runner; the V1 proposer's "
                 "llm_base_proposer.py:_maybe_share_lm_head / _maybe_share_embeddings use the "
                 "same rule)")
    for key, flag, weight, target_shape in (
            ("lm_head.source", "has_own_lm_head", "lm_head.weight", (vocab, hidden)),
            ("embed_tokens.source", "has_own_embed_tokens", "model.embed_tokens.weight",
             (vocab, hidden))):
        own = bool(getattr(model, flag, False))
        if key == "lm_head.source" and getattr(cfg, "has_own_lm_head", False):
            rec.set(key, "checkpoint", f"{DFLASH_UTILS}:load_dflash_model "
                                       "(config.has_own_lm_head)")
            continue
        if not own:
            rec.set(key, "target" if should_share(model, flag, None, None) else "checkpoint",
                    f"{share_src}; {MODEL_UTILS}:process_eagle_weight ({flag} False: no such "
                    "weight in the checkpoint)")
            continue
        draft = loaded.get(weight)
        if draft is not None and tuple(draft.shape) != target_shape:
            # torch.equal of tensors of different shapes is False whatever the values
            target = NS(weight=torch.zeros(target_shape, dtype=draft.dtype))
            share = should_share(model, flag, NS(weight=draft), target)
            rec.set(key, "target" if share else "checkpoint",
                    f"{share_src}; _should_share ({list(draft.shape)} vs the target's "
                    f"{list(target_shape)})")
        else:
            rec.not_run[key] = ("needs the target's weights: vLLM shares the target's "
                                f"{key.split('.')[0]} when the checkpoint's is torch.equal to "
                                f"it ({EAGLE_UTILS}:_should_share)")


def main(argv: list[str]) -> int:
    from dflash_audit.serve.fields import SideRecord
    from dflash_audit.serve.probes.engine_source import site_folder

    ckpt, out = Path(argv[1]), Path(argv[2])
    rec = SideRecord(SIDE)
    site = site_folder("vllm")
    try:
        probe(rec, ckpt, site)
    except Exception as exc:  # noqa: BLE001 - only the engine's own errors are a refusal
        if not _raised_in_engine(exc, site):
            raise
        rec.refused = one_line(exc)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        rec.notes.append(f"refused at {Path(where.filename).name}:{where.lineno} "
                         f"({where.name})")
    rec.write(out)
    return 0


if __name__ == "__main__":
    from dflash_audit.audit.sides.candidate_runner import die_with_parent

    die_with_parent()  # a kill -9 of serve-check leaves no probe running
    sys.exit(main(sys.argv))
