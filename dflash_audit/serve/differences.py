"""Train-serve differences: each field of what the engine will run against what the drafter
was trained as, with a name for every difference and whether it can change what is drafted.

A row is ``same``, ``differs`` (it changes the drafted tokens: the verdict fails), ``warn``
(it cannot change a drafting step, or only past a bound the report names), ``not run``
(the engine's adapter could not compute it here, e.g. it needs CUDA) or ``unknown`` (no side
says). The training value is the reference's reading; our drafter's reading is compared with
it too (a disagreement there is a ``warn``: the checkpoint is ambiguous to loaders).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dflash_audit.serve.attention import (
    block_rows,
    rule_differences,
    rule_of,
    serving_mask,
    window_origin,
)
from dflash_audit.serve.fields import SideRecord, layer_key

SAME, DIFFERS, WARN, NOT_RUN, UNKNOWN = "same", "differs", "warn", "not run", "unknown"

#: The name of a difference in each field (the bug class a user searches for).
NAMES: dict[str, str] = {
    "attention": "layer type", "sliding_window": "window size",
    "block_causal": "causality inside the block",
    "window_origin": "where the window is counted from",
    "rope.type": "RoPE type", "rope.theta": "RoPE theta", "rope.scaling": "RoPE scaling",
    "rope.rotary_dim": "partial rotary", "rope.neox_style": "RoPE layout (neox vs interleaved)",
    "rope.max_positions": "rotary table shorter than the target's context",
    "norm.one_plus_weight": "norm convention", "target_layer_ids": "target layer ids",
    "fc.in_features": "fc width", "mask_token_id": "mask token", "block_size": "block size",
    "num_speculative_tokens": "speculative tokens per step",
    "sample_from_anchor": "anchor-first layout", "draft_vocab_size": "draft vocabulary size",
    "draft_vocab.mapping": "draft vocabulary mapping",
    "lm_head.source": "draft lm_head replaced", "embed_tokens.source": "embeddings source",
    "mask_embedding.source": "mask slot embedding replaced",
}


#: Engine-only settings (no training counterpart) and the value that changes nothing.
NEUTRAL: dict[str, Any] = {"embed_tokens.scale": 1.0, "logits.multiplier": 1.0,
                           "logits.softcap": None, "rope.max_positions_raised_to_target": True,
                           "runner.v1_model_runner": "runs"}
#: What to do about a difference of each name (printed under it).
FIXES: dict[str, str] = {
    "causality inside the block": "make the config say what training did: the engine reads "
    "causality from is_causal, then dflash_config.causal (vLLM derives it from speculators' "
    "sliding_window_non_causal for every layer), then the layer types; for a drafter without "
    "sliding layers, sliding_window_non_causal: true in config.json serves every layer "
    "bidirectional as it was trained",
    "where the window is counted from": "no config key changes it: the engine counts the "
    "window back from each slot's own position, so slot s sees s + 1 fewer context keys than "
    "in training once the context is longer than the window; serve with full attention "
    "layers, or train with a window wider than your contexts",
    "mask slot embedding replaced": "remove mask_embedding.pt from the checkpoint folder: "
    "training embedded every mask slot with embed_tokens[mask_token_id], and the engine "
    "replaces that row with the file's vector",
    "draft lm_head replaced": "this engine drafts with the target's full head: train without "
    "a draft vocabulary (draft_vocab_size = the verifier's vocabulary) to serve with it",
    "draft vocabulary size": "this engine drafts over the target's vocabulary: train without a "
    "draft vocabulary to serve with it",
    "draft vocabulary mapping": "this engine has no d2t mapping: train without a draft "
    "vocabulary to serve with it",
    "checkpoint not loadable as it is": "the engine reads z-lab-format configs (a Qwen3 "
    "config with dflash_config); what it serves of this drafter written so is reported here",
    "RoPE theta": "write rope_parameters.rope_theta explicitly in the checkpoint's config",
    "rotary table shorter than the target's context": "set max_position_embeddings in the "
    "checkpoint's config to the target's context length",
    "mask token": "write mask_token_id explicitly in the checkpoint's config",
    "speculative tokens per step": "pass num_speculative_tokens = block_size - 1 to the engine "
    "(its speculative config)",
    "block size": "write block_size explicitly in the checkpoint's config",
    "anchor-first layout": "this engine never drafts slot 0: train with sample_from_anchor "
    "false to serve with it",
    "target layer ids": "write the target layer ids in the engine's convention (speculators "
    "ids are HF hidden_states indices; z-lab ids are one less)",
}


@dataclass
class Row:
    """One field: ``key``; the ``trained`` value and its ``trained_source`` (the reference's,
    else ours); ``served`` and ``served_source`` (the engine's); ``status`` (see the module
    docstring); ``name`` of the difference; ``message`` one line for a person."""

    key: str
    trained: Any
    served: Any
    status: str
    message: str = ""
    name: str = ""
    trained_source: str = ""
    served_source: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerRule:
    """The attention rule of one draft layer, trained vs served (:mod:`.attention`)."""

    layer: int
    trained: dict[str, Any]
    served: dict[str, Any] | None
    differences: list[str] = field(default_factory=list)
    served_from: str = ""
    trained_rows: Any = None
    served_rows: Any = None
    total_seq_len: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "trained": self.trained, "served": self.served,
                "differences": self.differences, "served_from": self.served_from}


def complete_from_masks(record: SideRecord) -> None:
    """Add ``layers.{i}.block_causal`` / ``window_origin`` read off the side's own masks
    (never overriding what the side computed itself)."""
    for i, m in record.masks.items():
        rule = rule_of(block_rows(m["rows"], m["total_seq_len"]), m["anchor"],
                       m["total_seq_len"])
        src = m.get("source", "the side's mask")
        window = record.fields.get(layer_key(int(i), "sliding_window"))
        for key, value in (("block_causal", rule["block_causal"]),
                           ("window_origin", window_origin(rule, window))):
            if layer_key(int(i), key) not in record.fields:
                record.set(layer_key(int(i), key), value, f"{src} (read off its mask)")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if a in (None, {}) and b in (None, {}):
        return True
    return a == b


def _base(key: str) -> str:
    return key.split(".", 2)[2] if key.startswith("layers.") else key


def _ordered_keys(*records: SideRecord) -> list[str]:
    keys: list[str] = []
    for r in records:
        for k in list(r.fields) + list(r.not_run):
            if k not in keys:
                keys.append(k)
    return keys


def compare(trained: SideRecord, ours: SideRecord | None, served: SideRecord,
            engine_label: str, verifier_max_positions: int | None = None) -> list[Row]:
    """Every field's row, trained (``trained``, the reference's reading) vs ``served``.

    Args:
        ours: our drafter's reading, compared with ``trained`` (warn rows), or None.
        engine_label: ``vLLM 0.33.0``, for the messages.
        verifier_max_positions: the target's context length (its ``max_position_embeddings``),
            which bounds the positions a served drafter sees; None when unknown.
    """
    rows = []
    # the training value: the reference's reading, else ours (a key only our loader reads)
    train_fields = {**(ours.fields if ours and not ours.refused else {}), **trained.fields}
    train_sources = {**(ours.sources if ours and not ours.refused else {}), **trained.sources}
    for key in _ordered_keys(trained, served):
        t, s = train_fields.get(key), served.fields.get(key)
        t_src, s_src = train_sources.get(key, ""), served.sources.get(key, "")
        name = NAMES.get(_base(key), key)
        row = Row(key, t, s, SAME, name="", trained_source=t_src, served_source=s_src)
        if key in served.not_run:
            row.status, row.message = NOT_RUN, served.not_run[key]
        elif key not in served.fields:
            row.status, row.message = UNKNOWN, f"{engine_label}'s adapter does not report it"
        elif key not in train_fields:
            if key in NEUTRAL and _equal(NEUTRAL[key], s):
                row.message = f"only {engine_label} has this setting; its value is neutral"
            else:
                row.status, row.name = WARN, key
                row.message = (f"{engine_label} runs {key} = {s!r} ({s_src}); training has no "
                               "such setting")
        elif not _equal(t, s):
            row.status, row.name = DIFFERS, name
            row.message = (f"{engine_label} serves this drafter with {key} {s!r} ({s_src}); it "
                           f"was trained with {t!r} ({t_src})")
            _soften(row, engine_label, verifier_max_positions, served)
        if row.status == DIFFERS:
            row.fix = FIXES.get(row.name, "")
        rows.append(row)
    if ours is not None and not ours.refused:
        for key, value in ours.fields.items():
            if key in trained.fields and not _equal(value, trained.fields[key]):
                rows.append(Row(f"{key} (our drafter)", trained.fields[key], value, WARN,
                                f"our drafter reads {key} as {value!r}, the reference as "
                                f"{trained.fields[key]!r}", "loaders disagree",
                                trained.sources.get(key, ""), ours.sources.get(key, "")))
    return rows


def _soften(row: Row, engine: str, verifier_max_positions: int | None,
            served: SideRecord) -> None:
    """Turn a difference that cannot change what is drafted into a warning, with why."""
    key, t, s = row.key, row.trained, row.served
    raised = "rope.max_positions_raised_to_target"
    if key == "rope.max_positions" and served.fields.get(raised):
        row.status = SAME
        row.message = (f"{engine} raises the draft's rotary table past its {s} positions to the "
                       f"target's context ({served.sources.get(raised, '')})")
    elif key == "rope.max_positions" and t is None and isinstance(s, int):
        if verifier_max_positions is not None and s >= verifier_max_positions:
            row.status = SAME
            row.message = (f"{engine}'s rotary table covers {s} positions, the target's "
                           f"context {verifier_max_positions}")
        else:
            bound = (f"the target serves {verifier_max_positions}" if verifier_max_positions
                     else "the target's context length is unknown (pass --verifier)")
            row.status = DIFFERS if verifier_max_positions else WARN
            row.message = (f"{engine} sizes the draft's rotary table to {s} positions "
                           f"({row.served_source}); training computed RoPE at every position; "
                           f"{bound}: drafting past position {s} uses wrong or no RoPE")
    elif key == "dtype":
        row.status = WARN
        row.message = (f"{engine} computes the draft in {s} ({row.served_source}), training ran "
                       f"in {t}: rounding, not another computation")
    elif key == "num_speculative_tokens" and isinstance(t, int) and isinstance(s, int) and s < t:
        row.status = WARN
        row.message += f": {engine} drafts {t - s} fewer slots than were trained (no wrong token)"


def layer_rules(trained: SideRecord, served: SideRecord, engine_label: str) -> list[LayerRule]:
    """Per layer: the training rule (the trained side's own mask) beside the serving rule
    (the engine's own mask if its probe built one, else :func:`serving_mask` of what the
    engine resolved for the layer)."""
    out = []
    for i, m in sorted(trained.masks.items(), key=lambda kv: int(kv[0])):
        layer, T, anchor = int(i), int(m["total_seq_len"]), int(m["anchor"])
        t_rows = block_rows(m["rows"], T)
        B = t_rows.shape[0]
        rule = LayerRule(layer, rule_of(t_rows, anchor, T), None, trained_rows=t_rows,
                         total_seq_len=T)
        if i in served.masks:
            own = served.masks[i]
            s_rows = block_rows(own["rows"], int(own["total_seq_len"]))
            rule.served_from = own.get("source", f"{engine_label}'s mask code")
            rule.served, rule.served_rows = rule_of(s_rows, int(own["anchor"]),
                                                    int(own["total_seq_len"])), s_rows
            rule.differences = rule_differences(rule.trained, rule.served)
            out.append(rule)
            continue
        else:
            f = served.fields
            kind, window = f.get(layer_key(layer, "attention")), f.get(
                layer_key(layer, "sliding_window"))
            causal, origin = f.get(layer_key(layer, "block_causal")), f.get(
                layer_key(layer, "window_origin"))
            if kind is None or causal is None or (window and origin is None):
                rule.served_from = f"{engine_label}'s adapter did not resolve this layer"
                out.append(rule)
                continue
            s_rows = serving_mask(torch.zeros(T, dtype=torch.long), torch.tensor([anchor]),
                                  B, window if kind == "sliding" else None, bool(causal), origin)
            rule.served_from = (f"{engine_label}'s resolved window {window}, causal {causal}, "
                                f"origin {origin} (dflash_audit/serve/attention.py:serving_mask)")
        rule.served, rule.served_rows = rule_of(s_rows, anchor, T), s_rows
        rule.differences = rule_differences(rule.trained, rule.served)
        out.append(rule)
    return out
