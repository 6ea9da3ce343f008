"""The ``derivation`` check: the drafter config each side derives from the case's verifier
config, field by field.

The reference's side is its own derivation, run in the reference's process on the case's
verifier folder with the case's draft layout (``reference/adapter.py: derive``: the training
CLI's ``create_transformer_layer_config``, the model's ``flatten_rope_parameters``, rotary
embedding and ``resolve_verifier_norm_class``); the candidate's is its optional
``derive_config(verifier_config, config)`` (ours: :func:`dflash_audit.model.derivation.
derivation_fields`). Compared: rope theta / type / partial factor / scaling, the rotary
dimension and attention scaling, head geometry, eps, activation, norm convention, vocab sizes,
layer types, sliding window, the mask token (where the reference resolves one from a
tokenizer), the default target layer ids (where the profile asks for the speculators default)
and ``saved.<key>``: what each side writes into a checkpoint's ``config.json``. Exact
comparison, floats to a relative tolerance of 1e-9; a differing mask token only warns (it is
saved in ``config.json``, a choice rather than a conformance failure). Spellings a field's
consumer treats alike are equal (:func:`consumer_value`: None / False / a missing saved key
for a boolean that is off, ``{}`` / None for no RoPE scaling, ...). A field the
candidate does not report is not compared; a candidate without ``derive_config`` gets
``warn`` "not provided". A verifier the
reference's own code cannot derive (e.g. Olmo3: its config has no ``head_dim``) is a reference
limitation (``warn``), not a candidate failure.

Hypotheses name: a derive_config that raised (with its error), geometry left at a config
class's defaults (heads, head_dim, MLP size, eps not inherited: ModelOpt under transformers 5),
``rope_theta`` set as an attribute the rotary embedding never reads, a RoPE base taken from the
wrong place (a 1e6 fallback where a nested
per-layer-type ``rope_parameters`` gives the ``sliding_attention`` entry), a saved
``partial_rotary_factor`` the draft layers do not apply, a norm convention, head_dim or eps
not taken from the verifier, and any other field as "<field> X where the reference derives Y".
"""

from __future__ import annotations

import math
from typing import Any

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult

#: Relative tolerance of float fields (eps, rope theta, scaling factors).
FLOAT_RTOL = 1e-9
#: Keys of a derivation dict that are not fields (``provenance``: which fields a framework
#: adapter set itself, :mod:`dflash_audit.audit.frameworks.provenance`).
META_KEYS = {"error", "traceback", "provenance", "unsupported"}
#: Fields whose difference is a documented choice, not a conformance failure: the mask token
#: is saved in the checkpoint's config.json, so training and inference agree on it either way
#: (our data pipeline prefers an unused reserved special token over the reference CLI's
#: pad / eos / unk fallback, a token real text contains).
WARN_KEYS = {"mask_token_id"}


def same_value(a: Any, b: Any) -> bool:
    """Equality of two derivation values: floats to :data:`FLOAT_RTOL`, dicts and lists
    element by element, ``1`` equal to ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=FLOAT_RTOL, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


#: Fields (derived, and ``saved.<field>``) whose consumer reads None -- also a key missing
#: from the saved config.json, reported as None -- as False: transformers 5's Qwen3Config,
#: what the saved transformer_layer_config loads as, defaults each to False and tests it for
#: truth (``sliding_window if use_sliding_window else None``; ``bias=attention_bias``; the
#: head tied only when ``tie_word_embeddings``).
BOOLEAN_OFF = ("use_sliding_window", "attention_bias", "tie_word_embeddings")
#: Fields whose None the consumer reads as a value: transformers rotates every feature when
#: a config names no ``partial_rotary_factor``.
NONE_MEANS = {"rope_partial_rotary_factor": 1.0}


def consumer_value(key: str, fields: dict[str, Any]) -> Any:
    """Field ``key`` of one side's derivation ``fields`` as its consumer reads it, so that
    spellings it treats alike compare equal and only values that change behaviour differ:
    None is False for :data:`BOOLEAN_OFF`, the default of :data:`NONE_MEANS`; an empty
    ``rope_scaling`` is None (no scaling); ``saved.rope_parameters`` without ``rope_type``
    is ``"default"``'s and a ``partial_rotary_factor`` 1.0 is none; ``saved.sliding_window``
    is None where ``saved.use_sliding_window`` is off (Qwen3Config drops it); a missing
    ``saved.layer_types`` with the window off is every layer ``full_attention`` (Qwen3Config
    fills it so: :data:`ALL_FULL`)."""
    value = fields.get(key)
    base = key.removeprefix("saved.")
    if base in BOOLEAN_OFF and value is None:
        return False
    if base in NONE_MEANS and value is None:
        return NONE_MEANS[base]
    if key == "rope_scaling" and not value:
        return None
    if key == "saved.rope_parameters" and isinstance(value, dict):
        value = {"rope_type": "default", **value}
        if same_value(value.get("partial_rotary_factor"), 1.0):
            value.pop("partial_rotary_factor")
    if key in ("saved.sliding_window", "saved.layer_types") and \
            "saved.use_sliding_window" in fields and not fields["saved.use_sliding_window"]:
        return None if key == "saved.sliding_window" else (ALL_FULL if value is None else value)
    return value


#: :func:`consumer_value` of a missing ``saved.layer_types`` with the window off.
ALL_FULL = "all full_attention"


def same_field(key: str, cand: dict[str, Any], ref: dict[str, Any]) -> bool:
    """Whether field ``key`` of two derivations is the same for its consumer
    (:func:`consumer_value`, then :func:`same_value`; :data:`ALL_FULL` equals any list of
    ``full_attention`` layers)."""
    a, b = consumer_value(key, cand), consumer_value(key, ref)
    if ALL_FULL in (a, b) and a != b:
        other = b if a == ALL_FULL else a
        return isinstance(other, list) and set(other) == {"full_attention"}
    return same_value(a, b)


#: Geometry fields a derived drafter config must take from the verifier, and what a config
#: class fills in first when it is built before they are copied (transformers 5.19
#: ``Qwen3Config()``: ModelOpt 0.47's ``modify`` "setdefault"s attributes that already exist).
CONFIG_CLASS_DEFAULTS = {"num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                         "intermediate_size": 22016, "rms_norm_eps": 1e-6,
                         "max_position_embeddings": 32768}
#: transformers' default RoPE base (``rope_parameters`` of a config built without one).
DEFAULT_ROPE_THETA = 10_000.0


def config_class_defaults(differing: dict[str, dict[str, Any]]) -> list[str]:
    """The differing geometry fields whose candidate values are all the config class's
    defaults (:data:`CONFIG_CLASS_DEFAULTS`), when at least two are."""
    keys = [k for k, default in CONFIG_CLASS_DEFAULTS.items() if k in differing
            and same_value(differing[k]["candidate"], default)]
    return keys if len(keys) >= 2 else []


def rope_attribute_cause(case: Case, cand: dict[str, Any], differing: dict) -> str | None:
    """"rope_theta set as an attribute ..." when the draft layers run transformers' default
    base while the candidate's saved config carries the verifier's (``saved.rope_theta``)."""
    d = differing.get("rope_theta")
    saved = cand.get("saved.rope_theta")
    if d is None or saved is None or not same_value(d["candidate"], DEFAULT_ROPE_THETA) or \
            not same_value(saved, d["reference"]):
        return None
    return (f"rope_theta set as a config attribute ({saved:g}, what the saved config.json says) "
            f"that transformers 5's rotary embedding never reads (it reads rope_parameters): "
            f"the draft layers run theta {DEFAULT_ROPE_THETA:g} where the verifier's "
            f"rope_parameters give {d['reference']:g}")


def _verifier_rope(case: Case) -> dict[str, Any]:
    vc = case.verifier.config
    vc = getattr(vc, "text_config", None) or vc
    rope = getattr(vc, "rope_parameters", None)
    return dict(rope) if isinstance(rope, dict) else {}


def name_difference(key: str, c: Any, r: Any, case: Case) -> str:
    """One differing field in words, with where the reference's value comes from."""
    rope = _verifier_rope(case)
    if key == "rope_theta":
        nested = next((t for t in ("sliding_attention", "full_attention")
                       if isinstance(rope.get(t), dict)), None)
        source = (f"the verifier's {nested} rope_parameters give {r:g}" if nested else
                  f"the verifier's rope_parameters give {r:g}")
        return f"rope theta {c:g} where {source}"
    if key == "saved.rope_parameters":
        extra = ""
        if isinstance(c, dict) and "partial_rotary_factor" in c and (
                not isinstance(r, dict) or "partial_rotary_factor" not in r):
            extra = (f" (a saved partial_rotary_factor {c['partial_rotary_factor']} the draft "
                     "layers do not apply: an engine that honours it runs another RoPE than "
                     "was trained)")
        elif isinstance(c, dict) and any(isinstance(v, dict) for v in c.values()):
            extra = (" (nested per-layer-type rope_parameters in a draft config whose layers "
                     "all use one RoPE)")
        return f"the saved config.json's rope_parameters {c} where the reference writes {r}{extra}"
    if key == "verifier_norm":
        return f"verifier norm convention {c} where the reference uses {r} for this verifier"
    if key == "rotary_dim":
        return f"the draft layers rotate {c} features per head where the reference rotates {r}"
    if key == "mask_token_id":
        return (f"mask_token_id {c} where the reference's training CLI resolves {r} from the "
                "verifier's tokenizer (both are saved in config.json; a choice, not a "
                "conformance failure)")
    if key.startswith("saved."):
        return f"the saved config.json's {key[6:]} {c!r} where the reference writes {r!r}"
    return f"{key} {c!r} where the reference derives {r!r}"


def _compared_keys(case: Case, cand: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    keys = [k for k in ref if k not in META_KEYS and k in cand]
    if ref.get("mask_token_id") is None:  # no tokenizer: the reference resolves none
        keys = [k for k in keys if k != "mask_token_id"]
    if case.verifier.target_layers != "speculators":
        keys = [k for k in keys if k != "default_target_layer_ids"]
    return keys


def check_derivation(case: Case, cand: SideOutputs, ref: SideOutputs) -> list[CheckResult]:
    """The candidate's derivation against the reference's, field by field (``[]`` for a case
    without a verifier)."""
    if case.verifier is None:
        return []
    name = case.verifier.name

    def result(status: str, summary: str, **kw: Any) -> list[CheckResult]:
        return [CheckResult("derivation", case.name, status, summary,
                            details={"verifier": name, **kw.pop("details", {})}, **kw)]

    r = ref.derivation
    if r is None:
        return result(WARN, f"the reference wrote no derivation of verifier {name}")
    if "error" in r:
        return result(WARN, f"reference limitation: the reference's own code cannot derive a "
                      f"drafter config from verifier {name}: {r['error']}",
                      details={"reference_error": r["error"]})
    c = cand.derivation
    if c is None:
        return result(WARN, "not provided: the candidate has no derive_config(verifier_config, "
                      "config)")
    if "unsupported" in c:  # the framework's own limit, declared (not a failure)
        return result(WARN, str(c["unsupported"]), details={"unsupported": c["unsupported"]})
    if "error" in c:
        return result(FAIL, f"the candidate's derive_config raised {c['error']}",
                      details={"candidate_error": c["error"]})
    keys = _compared_keys(case, c, r)
    differing = {k: {"candidate": c[k], "reference": r[k]}  # failing fields before warn-only
                 for k in sorted(keys, key=lambda k: k in WARN_KEYS)
                 if not same_field(k, c, r)}
    details = {"compared": keys, "not_reported": sorted(set(r) - set(c) - META_KEYS),
               "differing": differing}
    if differing:
        status = WARN if set(differing) <= WARN_KEYS else FAIL
        failing = {k: v for k, v in differing.items() if status == WARN or k not in WARN_KEYS}
        words = [name_difference(k, v["candidate"], v["reference"], case)
                 for k, v in failing.items()]
        notes = [name_difference(k, v["candidate"], v["reference"], case)
                 for k, v in differing.items() if k not in failing]
        details["warnings"] = notes  # choices, never shown as part of a failure
        return result(status, f"{len(failing)} of {len(keys)} derived fields differ for "
                      f"verifier {name}: " + "; ".join(words)
                      + (f" (and {len(notes)} warning-only field(s), see details)" if notes
                         else ""),
                      candidate={k: v["candidate"] for k, v in differing.items()},
                      reference={k: v["reference"] for k, v in differing.items()},
                      details=details)
    return result(PASS, f"{len(keys)} derived fields equal for verifier {name}",
                  details=details)


def diagnose_derivation(ev: Evidence, result: CheckResult) -> list[str]:
    """Each differing field, named (rope base source, saved partial factor, norm
    convention, ...)."""
    case = ev.case
    if "candidate_error" in result.details:
        return [f"derive_config raised {result.details['candidate_error']}"]
    differing = dict(result.details.get("differing", {}))
    if result.status == FAIL:  # a warning-only field is never shown as part of a failure
        differing = {k: v for k, v in differing.items() if k not in WARN_KEYS}
    causes = []
    defaults = config_class_defaults(differing)
    if defaults:
        values = ", ".join(f"{k} {differing[k]['candidate']:g}" for k in defaults)
        refs = ", ".join(f"{differing[k]['reference']:g}" for k in defaults)
        causes.append(f"the drafter config does not inherit the verifier's {', '.join(defaults)}"
                      f" ({refs}): its {values} are the config class's defaults (transformers "
                      "Qwen3Config), so the class filled its defaults before the verifier's "
                      "values were copied (a setdefault on attributes that already exist)")
        differing = {k: v for k, v in differing.items() if k not in defaults}
    rope = rope_attribute_cause(case, ev.cand.derivation or {}, differing)
    if rope:
        causes.append(rope)
        differing.pop("rope_theta")
    return causes + [name_difference(k, v["candidate"], v["reference"], case)
                     for k, v in differing.items()]
