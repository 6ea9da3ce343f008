"""What z-lab ``dflash`` 0.1.0 serves for a drafter checkpoint, read off z-lab's own built
model and functions: ``python zlab_probe.py CHECKPOINT_DIR OUT_JSON`` (z-lab's cached site
folder and this project on ``PYTHONPATH``; :func:`dflash_audit.serve.engines.run_probe`).

z-lab drafts on CPU, so nothing here is replaced: the folder is loaded the way z-lab's own
loader loads a draft (``dflash/benchmark.py:load_transformers_models``:
``AutoConfig.from_pretrained`` then ``DFlashDraftModel.from_pretrained``, in fp32 here where
z-lab serves bf16), and every field is read from that model or decided by running z-lab's
functions:

* per layer attention / window / block causality / window origin: observed in a forward of
  z-lab's model built from the served config with its widths shrunk to 8 (masking reads only
  ``layer_types``, ``sliding_window`` and ``is_causal``): every call into the attention kernel
  is intercepted, the kernel re-run on zero queries and keys, and the keys each query's output
  depends on are what it sees -- z-lab's ``_attention_mask`` where it builds one, the
  kernel's own causal flag where it builds none;
* RoPE from its ``rotary_emb`` (``Qwen3RotaryEmbedding``) and z-lab's ``apply_rotary_pos_emb``
  on a unit vector (rotate-half or interleaved);
* target layers through ``extract_context_feature`` on index tensors (z-lab id k reads
  ``hidden_states[k + 1]``), the RMSNorm convention by running ``model.norm`` with a zero
  weight, the drafting values through z-lab's ``_draft_value``.

A speculators-format folder (``speculators_model_type: "dflash"``) is not loadable by z-lab as
is (its loader's error is in ``notes``): the adapter first writes the z-lab folder
(:func:`write_zlab_folder`, with the framework adapter's config writer
:func:`dflash_audit.audit.frameworks.zlab_adapter.zlab_config`) and says so in ``notes``.
"""

from __future__ import annotations

import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dflash_audit.serve.fields import MASK_EMBEDDING_FILE, MASK_EMBEDDING_ROW

SIDE = "z-lab dflash 0.1.0"
MODEL_PY = "dflash/model.py"
#: Weights of z-lab's draft model (the rest of a checkpoint is the target's or a draft vocab).
ZLAB_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.")


class ZLabRefused(Exception):
    """z-lab (or the adapter's conversion for it) cannot load the checkpoint."""


def src(obj: Any, what: str = "") -> str:
    """``dflash/model.py:NAME (line N)`` of a z-lab function or class, plus ``what``."""
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", str(obj)))
    try:
        line = inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        line = "?"
    return f"{MODEL_PY}:{name} (line {line}){' ' + what if what else ''}"


# ------------------------------------------------------------------------ loading
def verifier_layers(d: dict[str, Any]) -> tuple[int | None, str | None]:
    """N and model_type of the verifier a speculators config names, from its local
    ``config.json`` (None, None when it is not a readable local folder)."""
    name = ((d.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not name or not (Path(name) / "config.json").is_file():
        return None, None
    vc = json.loads((Path(name) / "config.json").read_text())
    vc = vc.get("text_config") or vc
    return int(vc["num_hidden_layers"]), vc.get("model_type")


def write_zlab_folder(checkpoint: Path, out: Path) -> list[str]:
    """Write the z-lab folder (``config.json`` as the Qwen3Config z-lab reads, with
    ``dflash_config``; ``model.safetensors`` with z-lab's weights only) of a speculators-format
    checkpoint into ``out``; return the notes on what the conversion decided.

    Raises:
        ZLabRefused: the checkpoint's config cannot be read as a DFlash config.
    """
    from safetensors.torch import load_file, save_file

    from dflash_audit.audit.frameworks.zlab_adapter import zlab_config
    from dflash_audit.model.checkpoint import CheckpointError, config_from_reference

    d = json.loads((checkpoint / "config.json").read_text())
    n, model_type = verifier_layers(d)
    notes = []
    ids = [int(i) for i in d.get("aux_hidden_state_layer_ids") or []]
    if n is None:
        n = max(ids) if ids else 1
        notes.append(f"the verifier's layer count is not readable here: num_target_layers "
                     f"written as {n} (max target layer id; z-lab reads it only when "
                     "target_layer_ids is absent, and the adapter always writes them)")
    try:
        config = config_from_reference(d, n, model_type or "llama")
        zc = zlab_config(config)
    except (CheckpointError, KeyError, TypeError, ValueError) as exc:
        raise ZLabRefused(f"the adapter cannot write a z-lab config for this checkpoint "
                          f"({type(exc).__name__}: {exc})") from None
    zc.architectures = ["DFlashDraftModel"]
    out.mkdir(parents=True, exist_ok=True)
    zc.save_pretrained(out)
    state = load_file(checkpoint / "model.safetensors")
    kept = {k: v for k, v in state.items() if k.startswith(ZLAB_PREFIXES)}
    dropped = sorted(set(state) - set(kept))
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    notes.insert(0, "z-lab reads a z-lab config (a Qwen3Config with dflash_config); this "
                 "speculators-format checkpoint was converted by the adapter (zlab_adapter."
                 "zlab_config: dflash_config.target_layer_ids = speculators ids - 1, "
                 "block_size, mask_token_id, layer_types, sliding_window, is_causal=False for "
                 "a non-causal window) -- the conversion is the adapter's, not z-lab's")
    if dropped:
        notes.append(f"checkpoint weights z-lab has no place for, not served: {dropped} "
                     "(z-lab drafts with the target's embedding and full-vocab lm_head)")
    if (mask := checkpoint / MASK_EMBEDDING_FILE).exists():  # served with it (SGLang reads it)
        (shutil.copytree if mask.is_dir() else shutil.copy2)(mask, out / MASK_EMBEDDING_FILE)
    return notes


def load_served(checkpoint: Path, work: Path, dtype=None):
    """z-lab's model of ``checkpoint`` loaded as z-lab loads a draft; ``(model, folder,
    notes, refused_as_is)``: the folder z-lab read (the checkpoint, or the adapter's conversion
    in ``work``) and, for a conversion, z-lab's own error on the folder as it is.

    Raises:
        ZLabRefused: z-lab's (or the conversion's) error, one line.
    """
    import torch
    from transformers import AutoConfig

    import dflash.model as zm

    dtype = dtype or torch.float32
    try:
        d = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ZLabRefused(f"{checkpoint}/config.json: {type(exc).__name__}: {exc}") from None
    notes: list[str] = []
    folder, refused_as_is = checkpoint, None
    if "dflash_config" not in d:
        try:
            AutoConfig.from_pretrained(checkpoint)
            as_is = "loads as is"
        except Exception as exc:  # noqa: BLE001 - z-lab's loader's own error, reported
            as_is = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if d.get("speculators_model_type") != "dflash":
            raise ZLabRefused(f"neither a z-lab config (no dflash_config) nor a speculators "
                              f"DFlash config; z-lab's AutoConfig: {as_is}")
        notes.append(f"z-lab's loader (benchmark.py:load_transformers_models, "
                     f"AutoConfig.from_pretrained) on the speculators folder as is: {as_is}")
        folder = work / "zlab-format"
        notes[:0] = write_zlab_folder(checkpoint, folder)
        refused_as_is = None if as_is == "loads as is" else as_is
    try:
        config = AutoConfig.from_pretrained(folder)
        cls = (zm.DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or [])
               else zm.DFlashDraftModel)
        model, info = cls.from_pretrained(folder, attn_implementation="sdpa", dtype=dtype,
                                          output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - z-lab refuses the config: its own error
        raise ZLabRefused(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        notes.append(f"z-lab loads the draft with {len(missing)} weights missing, randomly "
                     f"initialised without an error: {missing[:6]}")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        notes.append(f"weights z-lab ignores: {unexpected[:6]}")
    notes.append("z-lab serves the draft in bf16 (benchmark.py:load_transformers_models, "
                 "dtype=torch.bfloat16); probed here in fp32")
    return model.eval(), folder, notes, refused_as_is


# ------------------------------------------------------------------------ the fields
def observe_visibility(config, context: int, block: int) -> dict[int, Any]:
    """Per draft layer: ``{"visible": [B, C+B] bool, "mask_built": bool}`` of z-lab's model
    built from ``config`` (widths shrunk to 8), on a context of ``context`` positions and a
    block of ``block`` slots at positions C..C+B-1, as it drafts (one call, no cache)."""
    import copy

    import torch
    from transformers.models.qwen3 import modeling_qwen3

    import dflash.model as zm

    small = copy.deepcopy(config)
    for key, value in dict(hidden_size=8, intermediate_size=8, num_attention_heads=1,
                           num_key_value_heads=1, head_dim=8).items():
        setattr(small, key, value)
    small._attn_implementation = "sdpa"
    model = zm.DFlashDraftModel(small).float().eval()
    seen: dict[int, Any] = {}
    built: list[int] = []
    kernels = modeling_qwen3.ALL_ATTENTION_FUNCTIONS
    original_kernel = kernels["sdpa"]
    original_mask = zm._attention_mask

    def mask(query, key, **kw):
        built.append(1)
        return original_mask(query, key, **kw)

    def kernel(module, q, k, v, attention_mask, *args, **kwargs):
        with torch.enable_grad():
            probe = torch.zeros_like(v).requires_grad_(True)
            out, _ = original_kernel(module, torch.zeros_like(q), torch.zeros_like(k), probe,
                                     attention_mask, *args, **kwargs)
            rows = []
            for i in range(out.shape[1]):  # [b, q, heads, d] after the kernel's transpose
                (g,) = torch.autograd.grad(out[0, i].sum(), probe, retain_graph=True)
                rows.append(g[0].abs().sum((0, 2)) > 0)
        seen[module.layer_idx] = {"visible": torch.stack(rows), "mask_built": bool(built)}
        built.clear()
        return original_kernel(module, q, k, v, attention_mask, *args, **kwargs)

    kernels["sdpa"] = kernel
    zm._attention_mask = mask
    try:
        with torch.no_grad():
            model(position_ids=torch.arange(context + block)[None],
                  noise_embedding=torch.randn(1, block, 8),
                  target_hidden=torch.randn(1, context, model.fc.in_features))
    finally:
        kernels["sdpa"] = original_kernel
        zm._attention_mask = original_mask
    return seen


def window_reading(visible, context: int, window: int | None) -> tuple[bool, str | None, str]:
    """(block_causal, window_origin, how) of one layer's [B, C+B] visibility with the anchor
    (slot 0) at position C: ``"query"`` when slot s's first visible key is C + s - W + 1 for
    every s, ``"anchor"`` when it is C - W for every s."""
    B = visible.shape[0]
    blk = visible[:, context:]
    causal = all(not bool(blk[s, t]) for s in range(B) for t in range(s + 1, B))
    firsts = [int(visible[s].nonzero()[0]) for s in range(B)]
    if window is None:
        return causal, None, f"first visible key per slot {firsts}"
    if firsts == [context + s - window + 1 for s in range(B)]:
        origin = "query"
    elif firsts == [context - window] * B:
        origin = "anchor"
    else:
        origin = f"other (first visible key per slot {firsts}, anchor at {context})"
    return causal, origin, (f"slot s sees keys from {firsts[0]}+s with the anchor at "
                            f"{context}, W={window}" if origin == "query" else str(firsts))


def probe(checkpoint: Path) -> Any:
    """The :class:`SideRecord` of what z-lab serves for ``checkpoint``."""
    import torch

    import dflash.model as zm
    from dflash_audit.model.layer_ids import from_zlab_ids
    from dflash_audit.serve.fields import SideRecord, layer_key

    rec = SideRecord(SIDE)
    with tempfile.TemporaryDirectory(prefix="zlab-probe-") as tmp:
        try:
            model, folder, notes, rec.refused_as_is = load_served(Path(checkpoint), Path(tmp))
        except ZLabRefused as exc:
            rec.refused = str(exc)
            return rec
        rec.notes += notes
        try:
            fill(rec, model, zm, from_zlab_ids, layer_key, torch)
        except Exception as exc:  # noqa: BLE001 - z-lab's forward fails on this config
            rec.refused = f"z-lab's model fails on this config: {type(exc).__name__}: {exc}"
    return rec


def fill(rec, model, zm, from_zlab_ids, layer_key, torch) -> None:
    """Every field of :mod:`dflash_audit.serve.fields` z-lab decides, into ``rec``."""
    cfg = model.config
    attn0 = model.layers[0].self_attn
    init = src(zm.Qwen3DFlashAttention.__init__)
    rec.set("num_hidden_layers", len(model.layers), src(zm.DFlashDraftModel.__init__))
    rec.set("hidden_size", model.norm.weight.numel(), "config.hidden_size (model.norm)")
    rec.set("num_attention_heads", attn0.q_proj.out_features // attn0.head_dim, init + " q_proj")
    rec.set("num_key_value_heads", attn0.k_proj.out_features // attn0.head_dim, init + " k_proj")
    rec.set("head_dim", attn0.head_dim, init)
    rec.set("intermediate_size", model.layers[0].mlp.gate_proj.out_features,
            "transformers Qwen3MLP(config) gate_proj")
    rec.set("rms_norm_eps", float(model.norm.variance_epsilon), "Qwen3RMSNorm(config.rms_norm_eps)")
    rec.set("hidden_act", cfg.hidden_act, "config.hidden_act (Qwen3MLP)")

    # one drafting call: slot s at position C + s; the context long enough for every window
    B = int(model.block_size)
    windows = [a.self_attn.sliding_window for a in model.layers if a.self_attn.sliding_window]
    C = (max(windows) if windows else 4) + B + 2
    seen = observe_visibility(cfg, C, B)
    forward = src(zm.Qwen3DFlashAttention.forward)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        w = a.sliding_window
        rec.set(layer_key(i, "attention"), "sliding" if w is not None else "full",
                init + " (layer_types[i] == 'sliding_attention')")
        rec.set(layer_key(i, "sliding_window"), w, init + " (config.sliding_window)")
        causal, origin, how = window_reading(seen[i]["visible"], C, w)
        decided = (src(zm._attention_mask) if seen[i]["mask_built"] else
                   f"{forward}: no mask built, the sdpa kernel's is_causal = module.is_causal "
                   f"({a.is_causal})")
        rec.set(layer_key(i, "block_causal"), causal, f"{decided}, observed in a forward "
                f"(is_causal = {a.is_causal}: {init})")
        rec.set(layer_key(i, "window_origin"), origin, f"{decided}, observed in a forward: "
                f"{how}")
        rec.masks[str(i)] = {"anchor": C, "total_seq_len": C,
                             "rows": seen[i]["visible"].int().tolist(),
                             "source": f"{decided}, observed in a forward (the keys whose "
                                       "values change each query's output)"}

    rotary = model.rotary_emb
    rope = dict(getattr(rotary.config, "rope_parameters", None) or {})
    rsrc = ("rotary_emb = transformers Qwen3RotaryEmbedding(config), built in "
            + src(zm.DFlashDraftModel.__init__) + ":")
    rec.set("rope.type", rotary.rope_type, rsrc + " rotary_emb.rope_type")
    rec.set("rope.theta", float(rope["rope_theta"]), rsrc + " config.rope_parameters"
            "['rope_theta']")
    extra = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    rec.set("rope.scaling", extra or None, rsrc + " config.rope_parameters")
    rec.set("rope.rotary_dim", 2 * int(rotary.inv_freq.numel()), rsrc + " 2 x len(inv_freq)")
    d = attn0.head_dim
    unit = torch.zeros(1, 1, 1, d)
    unit[..., 0] = 1.0
    cos0, sin1 = torch.zeros(1, 1, d), torch.ones(1, 1, d)  # a quarter turn: rotation only
    q_rot, _ = zm.apply_rotary_pos_emb(unit, unit, cos0, sin1)
    partner = int(q_rot[0, 0, 0].abs().argmax())
    rec.set("rope.neox_style", partner == d // 2, src(zm.apply_rotary_pos_emb,
            f"(feature 0 rotates with feature {partner} of {d})"))
    far = int(getattr(cfg, "max_position_embeddings", 32768)) * 4
    cos, _ = rotary(torch.zeros(1, 1, d), torch.tensor([[far]]))
    exact = torch.cos(far * rotary.inv_freq.double()).float()
    if torch.allclose(cos[0, 0, : exact.numel()], exact * rotary.attention_scaling, atol=1e-3):
        rec.set("rope.max_positions", None, rsrc + " its forward computes cos/sin for every "
                "position (no table); position 4 x max_position_embeddings checked")
    else:
        rec.set("rope.max_positions", int(cfg.max_position_embeddings), rsrc)
    norm = model.norm
    saved = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.zero_()
        out = norm(torch.ones(1, 1, saved.numel()))
        norm.weight.copy_(saved)
    rec.set("norm.one_plus_weight", bool(out.abs().sum() > 0),
            "transformers Qwen3RMSNorm (model.norm run with a zero weight)")

    n = max(model.target_layer_ids) + 2
    planes = [torch.full((1, 1, 1), float(i)) for i in range(n + 1)]
    read = [int(x) for x in zm.extract_context_feature(planes, model.target_layer_ids)[0, 0]]
    rec.set("target_layer_ids", read, src(zm.extract_context_feature,
            f"on index planes: z-lab ids {list(model.target_layer_ids)} (model.target_layer_ids, "
            f"_draft_value) read hidden_states[id + 1]"))
    if read != from_zlab_ids(model.target_layer_ids):
        rec.notes.append(f"extract_context_feature reads {read}, not z-lab ids + 1")
    rec.set("fc.in_features", model.fc.in_features, src(zm.DFlashDraftModel.__init__, "fc"))
    rec.set("mask_token_id", model.mask_token_id, src(zm._draft_value, "mask_token_id"))
    rec.set("block_size", B, src(zm._draft_value, "block_size (default 16)"))
    gen = src(zm.dflash_generate)
    rec.set("num_speculative_tokens", B - 1, gen + ": draft_hidden[:, 1 - verify_size:], "
            "block_output_ids[:, 1:] = drafts")
    rec.set("sample_from_anchor", False, gen + ": slot 0 holds the last accepted token")
    rec.set("draft_vocab_size", int(cfg.vocab_size), src(zm._output_head, "the target's head "
            "(config.vocab_size; z-lab has no draft vocabulary)"))
    rec.set("draft_vocab.mapping", "none", src(zm._output_head))
    rec.set("lm_head.source", "target", src(zm._output_head) + " via compute_logits")
    rec.set("embed_tokens.source", "target", src(zm._raw_input_embeddings))
    rec.set("mask_embedding.source", MASK_EMBEDDING_ROW,
            src(zm._raw_input_embeddings) + f" (no {MASK_EMBEDDING_FILE} read)")
    rec.set("embed_tokens.scale", float(zm._draft_value(cfg, "input_embedding_scale", 1.0)),
            src(zm._draft_value, "input_embedding_scale (dflash_generate)"))
    rec.set("logits.multiplier", float(zm._draft_value(cfg, "output_multiplier", 1.0)),
            src(zm.DFlashDraftModel.compute_logits, "output_multiplier"))
    cap = zm._draft_value(cfg, "final_logit_softcapping")
    rec.set("logits.softcap", None if cap is None or float(cap) <= 0 else float(cap),
            src(zm.DFlashDraftModel.compute_logits, "final_logit_softcapping"))
    rec.set("dtype", "bfloat16", "dflash/benchmark.py:load_transformers_models "
            "(from_pretrained dtype=torch.bfloat16)")
    if isinstance(model, zm.DFlash2DraftModel):
        rec.notes.append("DFlash2DraftModel: drafts through its CandidateSelector and grouped "
                         "convolutions, which no trainer here trains")
    # the real model runs on this config (a config z-lab cannot run is refused)
    with torch.no_grad():
        model(position_ids=torch.arange(2 + B)[None],
              noise_embedding=torch.zeros(1, B, cfg.hidden_size),
              target_hidden=torch.zeros(1, 2, model.fc.in_features))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: zlab_probe.py CHECKPOINT_DIR OUT_JSON", file=sys.stderr)
        return 2
    probe(Path(argv[0])).write(argv[1])
    return 0


if __name__ == "__main__":
    from dflash_audit.audit.sides.candidate_runner import die_with_parent

    die_with_parent()  # a kill -9 of serve-check leaves no probe running
    sys.exit(main(sys.argv[1:]))
