"""A profile from a user's DFlash drafter ``config.json``: ``--profile path/to/config.json``.

Two formats are read:

* a **speculators** DFlash checkpoint config (``speculators_model_type: "dflash"``, what
  ``DFlashDraftModel.save_pretrained`` and our :mod:`dflash_audit.model.checkpoint` write):
  ``block_size``, ``aux_hidden_state_layer_ids`` (speculators convention), ``mask_token_id``,
  ``draft_vocab_size`` (a draft vocabulary when smaller than the transformer's
  ``vocab_size``), ``sliding_window_non_causal``, ``sample_from_anchor`` and the
  ``transformer_layer_config``'s ``num_hidden_layers``, ``layer_types``, ``sliding_window``;
* a **z-lab** DFlash config (``architectures: ["DFlashDraftModel"]`` with a ``dflash_config``
  holding ``target_layer_ids`` and ``mask_token_id``, as z-lab/dflash's released drafters):
  ``block_size``, ``num_hidden_layers``, ``layer_types`` / ``sliding_window``; z-lab's target
  layer ids read ``hidden_states[id + 1]``, so the profile's ids are those + 1.

A drafter config does not hold the training recipe (loss, weighting, gamma, D-PACE alpha,
max_anchors, optimizer): those come from the built-in profile of the same origin
(``reference-train-cli`` for speculators, ``zlab`` for z-lab) and the report records every
field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION

#: Built-in profile that supplies the training recipe for each drafter-config format.
RECIPE = {"speculators": "reference-train-cli", "zlab": "zlab"}


def drafter_config_format(d: dict[str, Any]) -> str | None:
    """``"speculators"``, ``"zlab"`` or None for a parsed ``config.json``."""
    if d.get("speculators_model_type") == "dflash" and "transformer_layer_config" in d:
        return "speculators"
    if isinstance(d.get("dflash_config"), dict) and "target_layer_ids" in d["dflash_config"]:
        return "zlab"
    return None


def _layout(layer_types: Any, num_layers: int, source: str) -> list[str] | str:
    """The profile's layer_layout of a drafter's ``layer_types``.

    Raises:
        ValueError: a type a DFlash draft layer does not have, or not one per draft layer.
    """
    types = list(layer_types or [])
    if not types:
        return "full"
    bad = sorted({str(t) for t in types} - {SLIDING_ATTENTION, FULL_ATTENTION})
    if bad:
        raise ValueError(f"{source}: layer_types {bad} are not DFlash draft layer types (use "
                         f"{FULL_ATTENTION!r} / {SLIDING_ATTENTION!r})")
    if len(types) != num_layers:
        raise ValueError(f"{source}: {len(types)} layer_types for num_hidden_layers = "
                         f"{num_layers}; give one per draft layer")
    return ["sliding" if t == SLIDING_ATTENTION else "full" for t in types]


def _int(value: Any, field: str) -> int:
    """``value`` as an int; a float with a fraction, a bool or a non-numeric string is
    refused (never truncated)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{field} = {value!r} is not an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} = {value!r} is not an integer") from None


def _first(d: dict[str, Any], inner: dict[str, Any], key: str) -> Any:
    """``d[key]`` when present (even 0 or null), else ``inner[key]`` (KeyError if neither)."""
    return d[key] if key in d else inner[key]


def profile_fields(d: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """(format, the drafter's profile fields) of a parsed drafter ``config.json``.

    Raises:
        ValueError: neither format, or a field missing (naming it).
    """
    fmt = drafter_config_format(d)
    if fmt is None:
        raise ValueError(f"{source} is neither a speculators DFlash checkpoint config "
                         "(speculators_model_type 'dflash' + transformer_layer_config) nor a "
                         "z-lab DFlash config (dflash_config.target_layer_ids)")
    try:
        if fmt == "speculators":
            tl = d["transformer_layer_config"]
            n = _int(tl["num_hidden_layers"], "num_hidden_layers")
            fields = {"block_size": _int(d["block_size"], "block_size"),
                      "target_layers": [_int(i, "aux_hidden_state_layer_ids")
                                        for i in d["aux_hidden_state_layer_ids"]],
                      "mask_token_id": d.get("mask_token_id"),
                      "sliding_window_non_causal": bool(d.get("sliding_window_non_causal",
                                                              False)),
                      "sample_from_anchor": bool(d.get("sample_from_anchor", False))}
            layer_types, window = tl.get("layer_types"), tl.get("sliding_window")
            draft_vocab = d.get("draft_vocab_size")
            if draft_vocab is not None:
                draft_vocab = _int(draft_vocab, "draft_vocab_size")
                vocab = _int(tl.get("vocab_size") or 0, "vocab_size")
                if vocab and draft_vocab > vocab:
                    raise ValueError(f"draft_vocab_size = {draft_vocab} is larger than the "
                                     f"transformer's vocab_size = {vocab}")
                if draft_vocab < vocab:
                    fields["draft_vocab_size"] = draft_vocab
        else:
            dc = d["dflash_config"]
            n = _int(d["num_hidden_layers"], "num_hidden_layers")
            fields = {"block_size": _int(_first(d, dc, "block_size"), "block_size"),
                      "target_layers": [_int(i, "target_layer_ids") + 1
                                        for i in dc["target_layer_ids"]],
                      "mask_token_id": dc.get("mask_token_id", d.get("mask_token_id"))}
            layer_types, window = d.get("layer_types"), d.get("sliding_window")
        if fields.get("mask_token_id") is not None:
            fields["mask_token_id"] = _int(fields["mask_token_id"], "mask_token_id")
        window = _int(window, "sliding_window") if window is not None else None
    except (KeyError, TypeError, ValueError) as exc:
        what = f"the field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{source}: {fmt} DFlash config without a usable value: {what}; fix "
                         "it or give a TOML profile") from None
    layout = _layout(layer_types, n, source)
    fields.update(num_draft_layers=n, layer_layout=layout)
    if SLIDING_ATTENTION in list(layer_types or []):
        fields["sliding_window"] = window
    return fmt, fields


def read_drafter_config(path: Path) -> tuple[str, dict[str, Any]]:
    """(format, profile fields) of a drafter ``config.json`` file (or its folder).

    Raises:
        ValueError: unreadable, not JSON, or not a DFlash drafter config.
    """
    file = path / "config.json" if path.is_dir() else path
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read drafter config {file}: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: not a JSON object")
    return profile_fields(d, str(file))
