"""The ``defaults`` check: each side's default gamma / loss / weighting / block_size /
max_anchors / dpace_alpha next to the profile's explicit value.

Never fails (both sides run the profile's explicit values); exact comparison, loss names by
their first word. Where the profile names a value the reference has no equivalent for
(weighting ``none``, loss ``ce-data``), the reference reports what it ran instead
(``defaults.runs_instead``, ``reference/adapter.py: reference_loss_spec``) and this check warns
with those sentences. Hypotheses name: a candidate default that differs from the reference's
(a run without an explicit profile would train differently), and a candidate that reports
``gamma = None`` (no position decay by default).
"""

from __future__ import annotations

from typing import Any

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.result import PASS, WARN, CheckResult

#: field -> names under which a side may report its default for it
DEFAULT_ALIASES: dict[str, tuple[str, ...]] = {
    "gamma": ("gamma", "dflash_decay_gamma"),
    "loss": ("loss", "loss_fn", "loss_when_unset"),
    "weighting": ("weighting", "per_position_loss_weight"),
    "block_size": ("block_size",),
    "max_anchors": ("max_anchors",),
    "dpace_alpha": ("dpace_alpha",),
}


def _default_of(defaults: dict[str, Any], field: str) -> Any:
    return next((defaults[k] for k in DEFAULT_ALIASES[field] if k in defaults), None)


def profile_defaults(case: Case) -> dict[str, Any]:
    """The explicit values the audit runs both sides under."""
    return {"gamma": case.loss.gamma, "loss": case.loss.loss, "weighting": case.loss.weighting,
            "block_size": case.config.block_size,
            "max_anchors": int(case.inputs["anchor_positions"].numel()),
            "dpace_alpha": case.loss.dpace_alpha}


def _reports_none(defaults: dict[str, Any], field: str) -> bool:
    """The side names the field with the value None (e.g. ``gamma = None``: no decay)."""
    return any(k in defaults and defaults[k] is None for k in DEFAULT_ALIASES[field])


def _same_default(a: Any, b: Any) -> bool:
    """Equal defaults: 8 and 8.0 alike, a loss by its first word (check and diagnosis)."""
    if isinstance(a, str) and isinstance(b, str):  # "kl_div (fused)" names the loss kl_div
        return a.split()[0] == b.split()[0]
    return a == b


def check_defaults(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Each side's default gamma / loss / weighting / block_size / max_anchors / dpace_alpha,
    next to the profile's explicit value. Both sides run the profile, so this never fails; it
    warns where the candidate's default differs from the reference's (a run without an
    explicit profile would train differently)."""
    profile = profile_defaults(case)
    fields, differing = {}, []
    for field, value in profile.items():
        c, r = _default_of(cand.defaults, field), _default_of(ref.defaults, field)
        fields[field] = {"profile": value, "candidate_default": c, "reference_default": r}
        if c is not None and r is not None and not _same_default(c, r):
            differing.append(f"{field}: candidate {c!r}, reference {r!r}")
        elif field == "gamma" and _reports_none(cand.defaults, field) and r is not None:
            fields[field]["candidate_reports_none"] = True
            differing.append(f"gamma: candidate None (no position decay), reference {r!r}")
    instead = dict(ref.defaults.get("runs_instead") or {})
    status = WARN if differing or instead else PASS
    reported = "" if cand.defaults else "; the candidate reports no defaults"
    summary = ("defaults differ (both sides ran the profile's explicit values): "
               + "; ".join(differing) if differing else
               "both sides ran the profile's explicit values" + reported)
    if instead:
        summary = ("; ".join(f"{k}: {v}" for k, v in instead.items())
                   + ("; " + summary if differing else ""))
    return CheckResult("defaults", case.name, status, summary,
                       candidate=dict(cand.defaults), reference=dict(ref.defaults),
                       details={"fields": fields, "reference_runs_instead": instead})


def diagnose_defaults(ev: Evidence, result: CheckResult) -> list[str]:
    """Each default of the candidate that differs from the reference's."""
    out = [f"{field}: {sentence}" for field, sentence in
           result.details.get("reference_runs_instead", {}).items()]
    for name, v in result.details.get("fields", {}).items():
        c, r = v["candidate_default"], v["reference_default"]
        if v.get("candidate_reports_none"):
            out.append(f"the candidate's default {name} is None (no position decay, w_s = 1); "
                       f"the reference's is {r!r}: a run without an explicit gamma would not "
                       "decay the loss over the block")
        if c is not None and r is not None and not _same_default(c, r):
            out.append(f"the candidate's default {name} {c!r} differs from the reference's "
                       f"{r!r}: a run without an explicit profile would train differently")
    return out
