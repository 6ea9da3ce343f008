"""Who computed each candidate output of a framework audit -- the framework's code or the
adapter's glue -- and what that does to the verdict.

An adapter declares ``PROVENANCE`` (``{output key or prefix ending in ".": "framework" |
"adapter"}``; unlisted keys are the framework's); ``SideOutputs.metadata["provenance"]``
overrides it per case, and so does a ``"provenance"`` entry of the dict its
``derive_config`` returns (``{field: ...}``, as ``derivation.<field>``). A key may name a part
of an output a check reads: a field of a dict output (``structure.target_layer_ids``,
``derivation.layer_types``, ``metrics.``) counts for the check that reads that output. A check whose candidate values came from the adapter is not a plain
PASS: it becomes a WARN that says so ("loss: computed by the adapter, not audited as
SpecForge 0.2.0's"), which does not fail the audit; a FAIL on such values stays a FAIL, marked
as the adapter's. Cases outside the framework's capabilities (``case.unsupported``) run only
the checks that need no training step (:data:`WITHOUT_STEP`) after one WARN result
``supported`` that names why.
"""

from __future__ import annotations

from typing import Any

from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult

ADAPTER, FRAMEWORK = "adapter", "framework"
#: Output keys (prefixes) each check's candidate values come from.
CHECK_KEYS: dict[str, tuple[str, ...]] = {
    "structure": ("structure",), "mask": ("mask.",), "context": ("context",),
    "targets": ("targets", "target_ids"), "logits": ("logits",),
    "loss": ("loss", "aligned_loss_mask", "loss_weights."), "gradients": ("grad.",),
    "metrics": ("metrics",), "anchors": ("anchor_draws",), "derivation": ("derivation",),
    "defaults": ("defaults",)}
#: Outputs that are dicts of named fields (their parts: ``structure.target_layer_ids``).
DICT_OUTPUTS = ("structure", "metrics", "derivation", "defaults")
#: The checks that compare no training step: what runs on a case the framework cannot run.
WITHOUT_STEP = ("derivation", "anchors")


def who_computed(key: str, provenance: dict[str, str]) -> str:
    """``"adapter"`` or ``"framework"`` for output ``key`` (exact key first, then the
    longest matching ``prefix.``)."""
    if key in provenance:
        return provenance[key]
    prefixes = [p for p in provenance if p.endswith(".") and key.startswith(p)]
    return provenance[max(prefixes, key=len)] if prefixes else FRAMEWORK


def has_part(outputs: Any, part: str) -> bool:
    """Whether the candidate's ``outputs`` hold output ``part``: a tensor key, a tensor family
    (``grad.``), or a field / field family of a dict output (:data:`DICT_OUTPUTS`,
    ``structure.state_dict.<...>``, ``metrics.``); True without ``outputs`` (not known)."""
    if outputs is None:
        return True
    top, _, field = part.partition(".")
    if top in DICT_OUTPUTS:
        fields = getattr(outputs, top, None) or {}
        if not field:
            return bool(fields)
        below = field if field.endswith(".") else field + "."
        return any(k == field or k.startswith(below) or field.startswith(f"{k}.")
                   for k in fields)
    tensors = getattr(outputs, "tensors", {}) or {}
    return any(k.startswith(part) for k in tensors) if part.endswith(".") else part in tensors


def adapter_keys(check: str, provenance: dict[str, str], outputs: Any = None,
                 layer_type: str | None = None) -> list[str]:
    """The output keys a check reads that the adapter computed (``outputs``: the candidate's
    SideOutputs, to resolve families such as ``mask.`` / ``grad.`` to its keys and to tell
    which declared parts it holds; a ``mask`` result of one ``layer_type`` reads only
    ``mask.<layer_type>``): the check's keys themselves, and every part of them the adapter
    computed (``structure.target_layer_ids`` for ``structure``, ``derivation.layer_types``
    for ``derivation``, ``metrics.`` for ``metrics``)."""
    keys = CHECK_KEYS.get(check, ())
    if check == "mask" and layer_type:
        keys = (f"mask.{layer_type}",)
    present = list(getattr(outputs, "tensors", {}) or {}) if outputs is not None else []
    out = []
    for k in keys:
        family = [t for t in present if t.startswith(k)] if k.endswith(".") else []
        for key in family or [k]:
            if who_computed(key, provenance) == ADAPTER and key not in out:
                out.append(key)
        below = k if k.endswith(".") else k + "."
        out += [part for part, who in provenance.items() if who == ADAPTER and part != k
                and part.startswith(below) and part not in out and has_part(outputs, part)]
    return out


def case_provenance(declared: dict[str, str] | None, outputs: Any) -> dict[str, str]:
    """The adapter's ``PROVENANCE`` overridden by the case's ``metadata["provenance"]`` and by
    the ``"provenance"`` entry of its derivation (``{field: ...}`` -> ``derivation.<field>``)."""
    merged = dict(declared or {})
    meta = getattr(outputs, "metadata", None) or {}
    if isinstance(meta.get("provenance"), dict):
        merged.update({str(k): str(v) for k, v in meta["provenance"].items()})
    derivation = getattr(outputs, "derivation", None)
    if isinstance(derivation, dict) and isinstance(derivation.get("provenance"), dict):
        merged.update({f"derivation.{k}": str(v)
                       for k, v in derivation["provenance"].items()})
    return merged


def mark_provenance(results: list[CheckResult], provenance: dict[str, str], label: str,
                    outputs: Any = None) -> list[CheckResult]:
    """Mark, in place, every result whose candidate values came from the adapter: a PASS
    becomes a WARN "<check>: computed by the adapter, not audited as <label>'s" (that note its
    diagnosis); a FAIL or WARN keeps its status and its diagnosis (the note is no cause) with
    the note first in its summary. ``details["provenance"]`` lists the adapter's keys.
    Returns ``results``."""
    for r in results:
        keys = adapter_keys(r.name, provenance, outputs, r.details.get("layer_type"))
        if not keys:
            continue
        note = (f"{r.name}: computed by the adapter, not audited as {label}'s "
                f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
        r.details = {**r.details, "provenance": {"adapter": keys}}
        if r.status == PASS:
            r.status, r.summary, r.diagnosis = WARN, f"{note}; {r.summary}", [note]
        elif r.status == FAIL:
            r.summary = f"[{note}: a difference here may be the adapter's, not {label}'s] " \
                        f"{r.summary}"
        else:
            r.summary = f"[{note}] {r.summary}"
    return results


def unsupported_result(case: Any) -> CheckResult:
    """The WARN ``supported`` result of a case outside the framework's capabilities."""
    reasons = "; ".join(case.unsupported)
    return CheckResult("supported", case.name, WARN,
                       f"{reasons}; only the {' and '.join(WITHOUT_STEP)} checks ran on it",
                       diagnosis=list(case.unsupported),
                       details={"unsupported": list(case.unsupported)})
