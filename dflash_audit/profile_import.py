"""A profile from a user's DFlash drafter ``config.json``: ``--profile path/to/config.json``.

Two formats are read:

* a **speculators** DFlash checkpoint config (``speculators_model_type: "dflash"``, what
  ``DFlashDraftModel.save_pretrained`` and our :mod:`dflash_audit.model.checkpoint` write):
  ``block_size``, ``aux_hidden_state_layer_ids`` (speculators convention), ``mask_token_id``,
  ``draft_vocab_size`` (a draft vocabulary when smaller than the transformer's
  ``vocab_size``), ``sliding_window_non_causal``, ``sample_from_anchor`` and the
  ``transformer_layer_config``'s ``num_hidden_layers``, ``layer_types``, ``sliding_window``;
* a **z-lab** DFlash config (``architectures: ["DFlashDraftModel"]`` with a ``dflash_config``
  holding ``target_layer_ids`` and ``mask_token_id``, as z-lab/dflash's released drafters),
  read as z-lab reads it (:func:`zlab_run_config`: ``dflash_config`` first, then the top
  level; a value both give differently is refused): ``block_size``, ``num_hidden_layers``,
  ``layer_types`` / ``sliding_window``, ``is_causal``; z-lab's target layer ids read
  ``hidden_states[id + 1]``, so the profile's ids are those + 1. Serving values no profile
  field holds (``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``
  other than z-lab's defaults; DFlash2 configs) are refused, naming the key.

A drafter config does not hold the training recipe (loss, weighting, gamma, D-PACE alpha,
max_anchors, optimizer): those come from the built-in profile of the same origin
(``reference-train-cli`` for speculators, ``zlab`` for z-lab) and the report records every
field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_audit.user_input import loads_json

#: Built-in profile that supplies the training recipe for each drafter-config format.
RECIPE = {"speculators": "reference-train-cli", "zlab": "zlab"}


def drafter_config_format(d: dict[str, Any]) -> str | None:
    """``"speculators"``, ``"zlab"`` or None for a parsed ``config.json``."""
    if d.get("speculators_model_type") == "dflash" and "transformer_layer_config" in d:
        return "speculators"
    dc = d.get("dflash_config")
    if isinstance(dc, dict) and ("target_layer_ids" in dc or "num_target_layers" in d or any(
            str(a).startswith("DFlash") for a in d.get("architectures") or [])):
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


#: Values z-lab reads from ``dflash_config`` first, then from the top level
#: (``_draft_value``, z-lab dflash 0.1.0 ``dflash/model.py:127-132``), with z-lab's default.
ZLAB_DRAFT_VALUES = {"target_layer_ids": None, "block_size": 16, "mask_token_id": None,
                     "input_embedding_scale": 1.0, "output_multiplier": 1.0,
                     "final_logit_softcapping": None}
#: DFlash2 values (``dflash/model.py:518-519, 641-642``), read the same way.
ZLAB_DFLASH2_VALUES = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
#: Top-level Qwen3Config keys z-lab's draft model reads (``dflash/model.py:338-367, 554-571``).
ZLAB_ARCHITECTURE_KEYS = ("num_hidden_layers", "num_target_layers", "hidden_size",
                          "intermediate_size", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                          "hidden_act", "attention_bias", "attention_dropout", "layer_types",
                          "sliding_window", "use_sliding_window", "is_causal", "rope_theta",
                          "rope_parameters", "rope_scaling")


def zlab_run_config(d: dict[str, Any], source: str) -> dict[str, Any]:
    """Every value of a z-lab DFlash ``config.json`` (parsed) that changes what z-lab's
    drafter computes, as z-lab reads it: ``dflash_config`` first, then the top level, then
    z-lab's default (:data:`ZLAB_DRAFT_VALUES`), and the architecture keys
    (:data:`ZLAB_ARCHITECTURE_KEYS`, ``None`` when absent). ``target_layer_ids`` absent:
    ``build_target_layer_ids(num_target_layers, num_hidden_layers)``, as z-lab's model does.

    Returns ``{"architecture", "dflash2" (its values or None), "target_layer_ids" (z-lab ids),
    "target_layer_ids_source", "target_layer_ids_speculators" (+1), the draft values, the
    architecture keys, "ignored" (``dflash_config`` keys z-lab does not read)}``.

    Raises:
        ValueError: a value given both in ``dflash_config`` and at the top level with
            different values (e.g. ``block_size``: z-lab serves the ``dflash_config`` one, a
            trainer reading the top level trains another; the message names the key), no
            ``dflash_config`` object, or neither ``target_layer_ids`` nor
            ``num_target_layers``.
    """
    from dflash_audit.model.config import zlab_build_target_layer_ids

    dc = d.get("dflash_config")
    if not isinstance(dc, dict):
        raise ValueError(f"{source}: no dflash_config object: not a z-lab DFlash config")
    out: dict[str, Any] = {"architecture": (d.get("architectures") or [None])[0]}
    for key, default in {**ZLAB_DRAFT_VALUES, **dict.fromkeys(ZLAB_DFLASH2_VALUES)}.items():
        if key in dc and key in d and dc[key] != d[key]:
            raise ValueError(f"{source}: {key} is {dc[key]!r} in dflash_config and {d[key]!r} "
                             f"at the top level; z-lab serves the dflash_config value, a "
                             f"trainer that reads the top level trains the other: make them "
                             f"agree (or keep one)")
        out[key] = dc[key] if key in dc else d.get(key, default)
    dflash2 = {k: out.pop(k) for k in ZLAB_DFLASH2_VALUES}
    out["dflash2"] = dflash2 if out["architecture"] == "DFlash2DraftModel" or any(
        v is not None for v in dflash2.values()) else None
    for key in ZLAB_ARCHITECTURE_KEYS:
        out[key] = d.get(key)
    if out["target_layer_ids"] is not None:
        out["target_layer_ids_source"] = ("dflash_config" if "target_layer_ids" in dc
                                          else "top level")
    elif out["num_target_layers"] is not None and out["num_hidden_layers"] is not None:
        out["target_layer_ids"] = zlab_build_target_layer_ids(
            _int(out["num_target_layers"], "num_target_layers"),
            _int(out["num_hidden_layers"], "num_hidden_layers"))
        out["target_layer_ids_source"] = "build_target_layer_ids(num_target_layers, " \
                                         "num_hidden_layers)"
    else:
        raise ValueError(f"{source}: neither target_layer_ids nor num_target_layers: z-lab "
                         "cannot tell which verifier layers the drafter reads")
    if not isinstance(out["target_layer_ids"], list):
        raise ValueError(f"{source}: target_layer_ids = {out['target_layer_ids']!r} is not a "
                         "list of ids")
    out["target_layer_ids_speculators"] = [_int(i, "target_layer_ids") + 1
                                           for i in out["target_layer_ids"]]
    out["target_layer_ids_computed"] = "target_layer_ids" not in dc and "target_layer_ids" not in d
    out["ignored"] = sorted(k for k in dc if k not in ZLAB_DRAFT_VALUES
                            and k not in ZLAB_DFLASH2_VALUES)
    return out


#: How the origin of computed ids begins (:class:`DrafterLayerIds`,
#: ``Profile.target_layers_origin``).
COMPUTED = "computed, not read"


@dataclass(frozen=True)
class DrafterLayerIds:
    """The target layer ids a drafter config makes its drafter read, and where they come from.

    ``ids``: speculators convention (id L = HF ``output_hidden_states[L]``), in the config's
    order; ``origin``: one line, the key they were read from, or (beginning with
    :data:`COMPUTED`) the rule and the config values they were computed with.
    """

    ids: list[int]
    origin: str

    @property
    def computed(self) -> bool:
        """True when the config names no ids and they were computed by its framework's rule."""
        return ids_computed(self.origin)


def ids_computed(origin: str) -> bool:
    """Whether a :attr:`DrafterLayerIds.origin` (or ``Profile.target_layers_origin``) says the
    ids were computed by a rule rather than read from the config."""
    return str(origin or "").startswith(COMPUTED)


def drafter_layer_ids(d: dict[str, Any], source: str) -> DrafterLayerIds | None:
    """The target layer ids of a parsed drafter ``config.json``: the one reading that both
    ``compare --profile config.json`` and ``check-batches --drafter-config`` use.

    A z-lab config is read as z-lab reads it (:func:`zlab_run_config`): its
    ``target_layer_ids`` + 1, or, when it names none, z-lab's
    ``build_target_layer_ids(num_target_layers, num_hidden_layers)`` + 1, and the origin says
    so with the values used. Any other config's
    top-level ``aux_hidden_state_layer_ids`` (speculators ids) is read as is. None when the
    config holds neither.

    Raises:
        ValueError: ids that are not integers, or a z-lab config :func:`zlab_run_config`
            refuses (naming ``source`` and the key).
    """
    if drafter_config_format(d) != "zlab":
        if "aux_hidden_state_layer_ids" not in d:
            return None
        ids = d["aux_hidden_state_layer_ids"]
        if not isinstance(ids, list):
            raise ValueError(f"aux_hidden_state_layer_ids = {ids!r} is not a list of ids")
        return DrafterLayerIds([_int(i, "aux_hidden_state_layer_ids") for i in ids],
                               f"read from {source} aux_hidden_state_layer_ids (speculators ids)")
    run = zlab_run_config(d, source)
    zlab = list(run["target_layer_ids"])
    if run["target_layer_ids_computed"]:
        origin = (f"{COMPUTED}: {source} names no target_layer_ids, so z-lab's rule "
                  f"build_target_layer_ids(num_target_layers={run['num_target_layers']}, "
                  f"num_hidden_layers={run['num_hidden_layers']}) = {zlab} (z-lab ids), + 1")
    else:
        where = "dflash_config" if run["target_layer_ids_source"] == "dflash_config" else \
            "top-level"
        origin = f"read from {source} {where} target_layer_ids (z-lab ids {zlab}, + 1)"
    return DrafterLayerIds(run["target_layer_ids_speculators"], origin)


#: z-lab serving values a profile has no field for: a config that sets them is refused as a
#: profile (the audit would run without them), naming the key.
_ZLAB_UNPROFILED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                    "final_logit_softcapping": None}


def _zlab_fields(d: dict[str, Any], source: str) -> tuple[dict[str, Any], Any, Any, int]:
    """(profile fields, layer_types, sliding_window, draft layers) of a z-lab config.

    Raises:
        ValueError: see :func:`zlab_run_config`, a DFlash2 config, a serving value the
            profile cannot express, or ``is_causal = true`` (causal full-attention layers).
    """
    run = zlab_run_config(d, source)
    if run["dflash2"] is not None:
        raise ValueError(f"{source}: a DFlash2 config ({run['dflash2']}); the audit's profile "
                         "describes DFlash drafters only")
    for key, neutral in _ZLAB_UNPROFILED.items():
        value = run[key]
        if value is not None and value != neutral and not (neutral is None and float(value) <= 0):
            raise ValueError(f"{source}: {key} = {value!r} changes z-lab's drafter and no profile "
                             f"field holds it; the audit would run without it (z-lab's default "
                             f"is {neutral!r})")
    if run["is_causal"]:
        raise ValueError(f"{source}: is_causal = true makes every z-lab draft layer causal, "
                         "full-attention ones too; no profile layout holds that")
    ids = drafter_layer_ids(d, source)
    fields = {"block_size": _int(run["block_size"], "block_size"),
              "target_layers": ids.ids, "target_layers_origin": ids.origin,
              "mask_token_id": run["mask_token_id"]}
    if run["is_causal"] is False:
        fields["sliding_window_non_causal"] = True
    n = _int(run["num_hidden_layers"], "num_hidden_layers")
    return fields, run["layer_types"], run["sliding_window"], n


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
            ids = drafter_layer_ids(d, source)
            if ids is None:
                raise KeyError("aux_hidden_state_layer_ids")
            fields = {"block_size": _int(d["block_size"], "block_size"),
                      "target_layers": ids.ids, "target_layers_origin": ids.origin,
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
            fields, layer_types, window, n = _zlab_fields(d, source)
        if fields.get("mask_token_id") is not None:
            fields["mask_token_id"] = _int(fields["mask_token_id"], "mask_token_id")
        window = _int(window, "sliding_window") if window is not None else None
    except (KeyError, TypeError, ValueError) as exc:
        if fmt == "zlab" and isinstance(exc, ValueError) and str(exc).startswith(source):
            raise  # already one line naming the file and the key
        what = f"the field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{source}: {fmt} DFlash config without a usable value: {what}; fix "
                         "it or give a TOML profile") from None
    layout = _layout(layer_types, n, source)
    fields.update(num_draft_layers=n, layer_layout=layout)
    if SLIDING_ATTENTION in list(layer_types or []):
        fields["sliding_window"] = window
    return fmt, fields


def read_config_json(path: Path | str, what: str = "drafter config"
                     ) -> tuple[dict[str, Any], Path]:
    """The JSON object of a ``config.json`` file (or of its folder) and the file read.

    Raises:
        ValueError: unreadable, not JSON, or not a JSON object (``what`` names it).
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        d = loads_json(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {what} {file}: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: not a JSON object")
    return d, file


def read_drafter_config(path: Path) -> tuple[str, dict[str, Any]]:
    """(format, profile fields) of a drafter ``config.json`` file (or its folder).

    Raises:
        ValueError: unreadable, not JSON, or not a DFlash drafter config.
    """
    d, file = read_config_json(path)
    return profile_fields(d, str(file))
