"""Runs INSIDE the reference's process: what speculators trains a checkpoint as.

argv: CHECKPOINT_DIR OUT_JSON. Loads the folder's config with speculators' own
``DFlashSpeculatorConfig.from_pretrained``, builds ``DFlashDraftModel`` from it (no verifier
weights are needed to read its structure), and writes the serve-check record
(``dflash_audit/serve/fields.py`` documents the keys) read off the built model: per-layer
attention from the model's ``sliding_window_indices`` / ``sliding_window`` /
``sliding_window_non_causal`` and the reference's own training mask
(``_create_attention_mask`` for one anchor, eager), RoPE from its rotary embedding module,
the norm convention by running its ``norm`` on a probe input, fc from the built ``fc``, the
vocabulary and head rules from the model's load rules. A config the reference refuses is
``refused`` with its own error. Imports only the resolved speculators, torch, transformers.
"""

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adapter  # noqa: E402

CORE = "speculators/models/dflash/core.py"


def one_line(exc: BaseException) -> str:
    """The error in one line: a pydantic ValidationError's first line names only the model, so
    its next lines (the field and what is wrong with it) are kept, joined with '; '."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()
             and not x.strip().startswith("For further information")]
    return "; ".join(lines[:5])[:600]


def rope_theta(rot, rope_type, dim, configured):
    """The base the reference's rotary embedding computed its inverse frequencies from, and
    where it was read: the ``rope_theta`` of the config the module was built with
    (transformers' ``Qwen3RotaryEmbedding`` keeps it as ``.config``; its
    ``compute_default_rope_parameters`` and the scaled types read exactly that), checked for
    the default type against ``inv_freq[1] ** (-dim / 2)``. That value alone is no reading:
    float32 frequencies give 999997 for 1e6 at head_dim 128, and a scaled type (yarn, linear,
    llama3) rescales them. Only where the module holds no base, or one its default
    frequencies do not come from, is the derived value given (6 significant digits)."""
    import math

    held = (getattr(getattr(rot, "config", None), "rope_parameters", None) or {})
    held = held.get("sliding_attention", held) if isinstance(held, dict) else {}
    theta = held.get("rope_theta", configured) if isinstance(held, dict) else configured
    derived = float(rot.inv_freq[1].double() ** (-dim / 2.0)) if dim > 2 else None
    if rope_type != "default" or derived is None:
        return (float(theta) if theta is not None else None,
                "rope_parameters.rope_theta of the config it was built with")
    if theta is not None and math.isclose(derived, float(theta), rel_tol=1e-3):
        return float(theta), ("rope_parameters.rope_theta of the config it was built with "
                              "(its inv_freq[1] ** (-rotary_dim / 2) agrees)")
    return float(f"{derived:.6g}"), ("inv_freq[1] ** (-rotary_dim / 2), 6 significant digits "
                                     "(the module holds no base its frequencies come from)")


def main(folder: Path, out: Path) -> None:
    record = {"side": "reference", "fields": {}, "sources": {}, "not_run": {},
              "refused": None, "notes": [], "masks": {}}

    def put(key, value, source):
        record["fields"][key] = value
        record["sources"][key] = source

    speculators, core, _ = adapter.import_reference(out.parent)
    import torch
    from speculators.models.attention import create_float_mask

    record["side"] = f"speculators {getattr(speculators, '__version__', '')}".strip()
    try:
        config = core.DFlashSpeculatorConfig.from_pretrained(str(folder))
        config.transformer_layer_config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = core.DFlashDraftModel(config)
    except Exception as exc:  # the reference's own refusal of this config
        record["refused"] = f"{type(exc).__name__}: {one_line(exc)}"
        out.write_text(json.dumps(record))
        return
    model._create_mask_fn = create_float_mask
    tl = config.transformer_layer_config
    init = f"{CORE}:DFlashDraftModel.__init__"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "num_hidden_layers", "rms_norm_eps", "hidden_act"):
        put(key, getattr(tl, key), f"transformer_layer_config.{key}")
    put("head_dim", int(getattr(tl, "head_dim", None) or tl.hidden_size // tl.num_attention_heads),
        "transformer_layer_config.head_dim")
    B, W = int(model.block_size), model.sliding_window
    a = int(W or 0) + 2 * B + 8
    T = a + B + 1
    for i in range(tl.num_hidden_layers):
        sliding = i in model.sliding_window_indices
        put(f"layers.{i}.attention", "sliding" if sliding else "full",
            f"{init} (sliding_window_indices)")
        put(f"layers.{i}.sliding_window", int(W) if sliding else None,
            f"{init} (transformer_layer_config.sliding_window)")
        mask = model._create_attention_mask(
            document_ids=torch.zeros(1, T, dtype=torch.long), total_seq_len=T,
            anchor_positions=torch.tensor([a]), device=torch.device("cpu"),
            sliding_window=W if sliding else None,
            sliding_window_non_causal=model.sliding_window_non_causal)
        rows = (mask == 0).reshape(mask.shape[-2], mask.shape[-1]).int().tolist()
        record["masks"][str(i)] = {"anchor": a, "total_seq_len": T, "rows": rows,
                                   "source": f"{CORE}:DFlashDraftModel._create_attention_mask"}
    rot = model.rotary_emb
    rope = dict(getattr(tl, "rope_parameters", None) or {})
    if "sliding_attention" in rope:
        rope = dict(rope["sliding_attention"])
    dim = 2 * int(rot.inv_freq.numel())
    rsrc = f"{init} (Qwen3RotaryEmbedding(flatten_rope_parameters(config)))"
    rope_type = getattr(rot, "rope_type", rope.get("rope_type", "default"))
    theta, theta_src = rope_theta(rot, rope_type, dim, rope.get("rope_theta"))
    put("rope.type", rope_type, rsrc)
    put("rope.theta", theta, f"{rsrc}: {theta_src}")
    put("rope.scaling", {k: v for k, v in rope.items()
                         if k not in ("rope_type", "rope_theta", "partial_rotary_factor")} or None,
        "transformer_layer_config.rope_parameters")
    put("rope.rotary_dim", dim, rsrc + ": 2 * len(inv_freq)")
    put("rope.neox_style", True, "transformers Qwen3 apply_rotary_pos_emb (rotate_half)")
    put("rope.max_positions", None,
        rsrc + ": cos/sin computed per position (no table)")
    with torch.no_grad():
        probe = type(model.norm)(4, eps=1e-6)
        probe.weight.zero_()
        one_plus = bool(probe(torch.ones(1, 4)).abs().max() > 0.5)
    put("norm.one_plus_weight", one_plus, f"{init} ({type(model.norm).__name__} run on ones "
        "with zero weight)")
    put("target_layer_ids", [int(x) for x in model.target_layer_ids],
        f"{CORE}:DFlashDraftModel.target_layer_ids")
    put("fc.in_features", int(model.fc.in_features), f"{init} (fc)")
    put("mask_token_id", config.mask_token_id, "DFlashSpeculatorConfig.mask_token_id")
    put("block_size", B, "DFlashSpeculatorConfig.block_size")
    put("sample_from_anchor", bool(config.sample_from_anchor),
        "DFlashSpeculatorConfig.sample_from_anchor")
    put("num_speculative_tokens", B if config.sample_from_anchor else B - 1,
        "DFlashSpeculatorConfig.sample_from_anchor (block_size, else block_size - 1)")
    put("draft_vocab_size", int(model.draft_vocab_size), "DraftVocabMixin._init_vocab")
    put("draft_vocab.mapping", "d2t offsets" if model.use_draft_vocab else "none",
        "DraftVocabMixin (d2t: target id = i + d2t[i])")
    ignored = model.__dict__.get("_keys_to_ignore_on_load_missing", [])
    put("lm_head.source", "target" if "lm_head.weight" in ignored else "checkpoint",
        f"{init} (_keys_to_ignore_on_load_missing; load_verifier_weights)")
    put("embed_tokens.source", "target", f"{CORE}:DFlashDraftModel.load_verifier_weights "
        "(overwrite_embed_tokens=True)")
    put("mask_embedding.source", "embed_tokens[mask_token_id]",
        f"{CORE}:DFlashDraftModel (noise_embedding = embed_tokens(mask_token_ids))")
    out.write_text(json.dumps(record))


if __name__ == "__main__":
    adapter.die_with_parent()  # a kill -9 of serve-check leaves no reference running
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        main(folder, out)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
