"""The audit's checks: one small function per quantity that defines DFlash training.

Each check is ``check(case, cand, ref) -> CheckResult`` (``mask`` returns one result per
layer type) and compares the candidate's :class:`SideOutputs` with the reference's on one
:class:`Case`. :func:`run_checks` runs them all in report order:

``structure``  deepdiff of the two structure summaries, plus the candidate against the profile
``defaults``   each side's default gamma / loss / weighting / block_size / max_anchors
               (never fails)
``mask``       exact boolean equality, one result per layer type
``context``    hidden_norm(fc(hidden_states)) [1,T,H] on the positions a supervised block sees
``targets``    verifier logits [1,Q,V_d] on supervised slots
``logits``     draft logits [1,Q,V_d] on supervised slots
``loss``       total loss, aligned loss mask, per-slot weights per term (+ the gamma they imply)
``gradients``  every trainable parameter of the reference, tolerance relative to its scale
``metrics``    per-slot accuracy, full accuracy, acceptance length (never fails: metrics do
               not change training; a differing EAL definition is a warning naming both)

Rules every check follows:

* Only differences that can change training fail. Targets and logits are compared on the
  slots the reference trains on (its ``aligned_loss_mask``), masks on the rows of blocks with
  a supervised slot, the context on the positions those rows can attend.
* An output a candidate does not provide gives ``warn`` "not provided", never a crash.
* Tolerances are ``torch.testing.assert_close``-style, ``|c - r| <= atol + rtol * |r|``, from
  :data:`TOLERANCES` keyed by the dtype the case runs in.
* ``first_diff`` names the first differing element in the reference's coordinates: anchor j,
  slot s, packed position a_j + s, document, and the vocabulary / feature / kv index.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from deepdiff import DeepDiff

from dflash_audit.audit.anchor_draws import check_anchor_draws
from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.model.config import SLIDING_ATTENTION
from dflash_audit.model.drafter import FROZEN_PARAMETERS, block_indices
from dflash_audit.model.metrics import EAL_DEFINITIONS, dflash_metrics

#: assert_close-style tolerances per dtype the case runs in. fp32 on CPU is bit-reproducible
#: up to reduction order across two implementations of the same math (DESIGN.md sec. 3).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-7, "rtol": 1e-7},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}

#: Structure fields only one side reports that cannot change training (the reference's
#: adapter reports its verifier-norm class and how the case weights loaded).
ONE_SIDED_STRUCTURE_FIELDS = ("verifier_norm", "load_missing_keys", "load_unexpected_keys")
#: Buffers used only at inference (draft -> verifier vocabulary mapping).
INFERENCE_ONLY_BUFFERS = ("t2d", "d2t")
STATUS_ORDER = {PASS: 0, WARN: 1, FAIL: 2}


# ------------------------------------------------------------------------------ helpers
def worst(statuses) -> str:
    """The most severe of some statuses (fail > warn > pass); pass when empty."""
    return max(statuses, key=STATUS_ORDER.__getitem__, default=PASS)


def run_dtype(case: Case) -> torch.dtype:
    """The dtype the case runs in: that of ``fc.weight`` (else of ``hidden_states``)."""
    t = case.weights.get("fc.weight", case.inputs.get("hidden_states"))
    return t.dtype if t is not None else torch.float32


def tolerance(case: Case) -> dict[str, float]:
    """``{"atol", "rtol"}`` for the case's dtype (fp32's when the dtype is not in the table)."""
    return dict(TOLERANCES.get(run_dtype(case), TOLERANCES[torch.float32]))


@dataclass
class Closeness:
    """Elementwise comparison ``|c - r| <= atol + rtol * |r|`` (non-finite values never close)."""

    ok: bool
    max_abs: float
    max_rel: float
    num_bad: int
    first_bad: tuple[int, ...] | None  # index into the compared tensors


def closeness(cand: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> Closeness:
    """Compare two same-shape tensors (any float dtype; computed in fp32 or fp64)."""
    dtype = torch.float64 if torch.float64 in (cand.dtype, ref.dtype) else torch.float32
    c, r = cand.detach().to(dtype), ref.detach().to(dtype)
    if c.numel() == 0:
        return Closeness(True, 0.0, 0.0, 0, None)
    diff = (c - r).abs()  # NaN where either side is NaN
    r_abs = r.abs()
    bad = ~(diff <= atol + rtol * r_abs)  # NaN -> bad
    max_abs = float(diff.max())
    max_rel = float((diff / r_abs.clamp_min(torch.finfo(dtype).tiny)).max())
    if math.isnan(max_abs) or math.isnan(max_rel):
        max_abs = max_rel = math.inf
    num_bad = int(bad.sum())
    first = None
    if num_bad:
        flat = int(bad.reshape(-1).to(torch.uint8).argmax())  # first True
        first = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), bad.shape))
    return Closeness(num_bad == 0, max_abs, max_rel, num_bad, first)


def anchors(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``anchor_positions`` [A] int64 and ``anchor_valid`` [A] bool of the case."""
    return case.inputs["anchor_positions"].long(), case.inputs["anchor_valid"].bool()


def supervised_slots(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[Q] bool: the slots the reference trains on (its ``aligned_loss_mask``).

    Without that tensor, the reference contract: ``loss_mask[a_j + s] * anchor_valid_j`` with
    slot 0 zeroed unless ``sample_from_anchor`` (DESIGN.md sec. 3, "Loss")."""
    if "aligned_loss_mask" in ref.tensors:
        return ref.tensors["aligned_loss_mask"].reshape(-1).bool()
    B = case.config.block_size
    pos, valid = anchors(case)
    idx = block_indices(pos, B) % case.inputs["loss_mask"].shape[-1]
    m = case.inputs["loss_mask"][0, idx].bool() & valid.repeat_interleave(B)
    if not case.config.sample_from_anchor:
        m[::B] = False
    return m


def supervised_rows(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[Q] bool: query rows of blocks that hold at least one supervised slot (only these rows
    can change training: rows of other blocks feed no trained logit)."""
    B = case.config.block_size
    blocks = supervised_slots(case, ref).reshape(-1, B).any(-1)
    return blocks.repeat_interleave(B)


def slot_coordinates(case: Case, q: int) -> dict[str, int]:
    """Reference coordinates of query slot q: anchor j, its position, slot s, a_j + s, document."""
    B = case.config.block_size
    pos, _ = anchors(case)
    j, s = divmod(int(q), B)
    a = int(pos[j])
    doc = case.inputs["document_ids"].reshape(-1)
    return {"anchor": j, "anchor_position": a, "slot": s, "position": a + s,
            "document": int(doc[a])}


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A mask as [Q, T+Q] bool (True = may attend). Float masks are read as additive masks
    (0 = attend, -inf / large negative = blocked); leading size-1 axes are dropped."""
    while mask.ndim > 2 and mask.shape[0] == 1:
        mask = mask[0]
    return mask if mask.dtype == torch.bool else mask == 0


def reference_masks(ref: SideOutputs) -> dict[str, torch.Tensor]:
    """Layer type -> [Q, T+Q] bool mask of one side (keys ``mask.<layer type>``)."""
    return {k.split(".", 1)[1]: as_bool_mask(v) for k, v in ref.tensors.items()
            if k.startswith("mask.")}


def attended_positions(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[T] bool: context positions some supervised block may attend in a reference mask.

    The context elsewhere cannot change training. Without reference masks: every position
    with a document (``document_ids != -1``)."""
    T = case.inputs["document_ids"].shape[-1]
    masks = reference_masks(ref)
    if not masks:
        return case.inputs["document_ids"].reshape(-1) != -1
    rows = supervised_rows(case, ref)
    seen = torch.zeros(T, dtype=torch.bool)
    for m in masks.values():
        if m.shape[-1] >= T and m.shape[0] == rows.numel():
            seen |= m[rows, :T].any(0)
    return seen


def _not_provided(name: str, case: Case, what: str, side: str = "candidate",
                  **kw: Any) -> CheckResult:
    return CheckResult(name=name, case=case.name, status=WARN,
                       summary=f"not provided: the {side} returned no {what}", **kw)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# ---------------------------------------------------------------------------- structure
def expected_structure(case: Case) -> dict[str, Any]:
    """The structural fields the profile (``case.config``) implies for any conformant drafter:
    ``fc`` is ``Linear(n*H, H)`` over all n target layers (DESIGN.md sec. 3, "fc")."""
    c = case.config
    sliding = SLIDING_ATTENTION in c.effective_layer_types
    return {
        "fc_in_features": c.num_target_layers * c.hidden_size,
        "fc_out_features": c.hidden_size,
        "target_layer_ids": list(c.target_layer_ids),
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "layer_types": list(c.effective_layer_types),
        "sliding_window": c.sliding_window if sliding else None,
        "sliding_window_non_causal": c.sliding_window_non_causal,
        "sample_from_anchor": c.sample_from_anchor,
    }


def normalized_structure(structure: dict[str, Any]) -> dict[str, Any]:
    """A structure summary without what cannot change training: one-sided fields, and the
    window settings when no layer is sliding."""
    s = {k: v for k, v in structure.items() if k not in ONE_SIDED_STRUCTURE_FIELDS}
    if SLIDING_ATTENTION not in (s.get("layer_types") or []):
        s.pop("sliding_window", None)
        s.pop("sliding_window_non_causal", None)
    return s


def _state_dict_finding(key: str, attr: str | None, cand: dict, ref: dict) -> dict[str, Any]:
    """Classify one differing state-dict entry (a whole key when ``attr`` is None)."""
    c, r = cand.get(key), ref.get(key)
    inference_only = key in INFERENCE_ONLY_BUFFERS
    if attr is None:  # present on one side only
        side, entry = ("candidate", c) if c is not None else ("reference", r)
        trainable = bool(entry.get("trainable"))
        status = FAIL if trainable else WARN
        reason = (f"trainable parameter {key!r} exists only on the {side} side" if trainable
                  else f"{'inference-only buffer' if inference_only else 'frozen entry'} "
                       f"{key!r} exists only on the {side} side (cannot change training)")
        return {"field": f"state_dict.{key}", "candidate": c, "reference": r,
                "status": status, "reason": reason}
    cv, rv = (c or {}).get(attr), (r or {}).get(attr)
    if attr == "trainable":
        reason = (f"{key!r} is trained on the candidate side but frozen in the reference"
                  if cv else f"{key!r} is frozen on the candidate side but trained in the "
                             "reference")
        status = FAIL
    elif attr == "shape":
        status = WARN if inference_only else FAIL
        reason = f"{key!r} has shape {cv} on the candidate side, {rv} in the reference"
    else:
        status = WARN
        reason = f"{key!r} {attr} is {cv} on the candidate side, {rv} in the reference"
    return {"field": f"state_dict.{key}.{attr}", "candidate": cv, "reference": rv,
            "status": status, "reason": reason}


def structure_differences(cand: dict[str, Any], ref: dict[str, Any]) -> list[dict[str, Any]]:
    """DeepDiff of two normalized structure summaries, one finding per differing field or
    state-dict entry: ``{"field", "candidate", "reference", "status", "reason"}``."""
    diff = DeepDiff(cand, ref, view="tree", threshold_to_diff_deeper=0)  # never whole-object
    seen, findings = set(), []
    for levels in diff.tree.values():
        for level in levels:
            path = level.path(output_format="list")
            if path and path[0] == "state_dict" and len(path) >= 2:
                key, attr = path[1], (path[2] if len(path) >= 3 else None)
                ident = ("state_dict", key, attr)
                if ident not in seen:
                    seen.add(ident)
                    findings.append(_state_dict_finding(
                        key, attr, cand.get("state_dict", {}), ref.get("state_dict", {})))
                continue
            field = path[0] if path else "<root>"
            if field in seen:
                continue
            seen.add(field)
            if field not in cand or field not in ref:  # nothing to compare it with
                side = "reference" if field not in cand else "candidate"
                findings.append({"field": field, "candidate": cand.get(field),
                                 "reference": ref.get(field), "status": WARN,
                                 "reason": f"{field} reported only by the {side}"})
            else:
                findings.append({"field": field, "candidate": cand.get(field),
                                 "reference": ref.get(field), "status": FAIL,
                                 "reason": f"{field}: candidate {cand.get(field)!r}, "
                                           f"reference {ref.get(field)!r}"})
    return findings


def profile_differences(structure: dict[str, Any], case: Case, side: str
                        ) -> list[dict[str, Any]]:
    """Fields of one side's structure that contradict the profile (see
    :func:`expected_structure`); fields the side does not report are skipped."""
    expected = normalized_structure(expected_structure(case))
    out = []
    for field, want in expected.items():
        if field in structure and structure[field] != want:
            out.append({"field": field, side: structure[field], "profile": want,
                        "status": FAIL, "reason": f"{side} {field} = {structure[field]!r}, the "
                                                  f"profile implies {want!r}"})
    return out


def load_findings(ref: SideOutputs) -> list[dict[str, Any]]:
    """Case weights that did not load into the reference: a missing key ran with random
    initialisation, an unexpected one was ignored; either invalidates the comparison."""
    out = []
    for key in ref.structure.get("load_missing_keys") or []:
        out.append({"field": f"state_dict.{key}", "status": FAIL, "reference": "missing",
                    "reason": f"the case weights did not fill reference parameter {key!r} (it "
                              "ran with its random initialisation): state-dict names differ"})
    for key in ref.structure.get("load_unexpected_keys") or []:
        out.append({"field": f"state_dict.{key}", "status": FAIL, "reference": "unexpected",
                    "reason": f"the reference has no parameter {key!r} from the case weights "
                              "(ignored on its side): state-dict names differ"})
    return out


def check_structure(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Structure summaries (fc in/out features, target_layer_ids, block_size, mask_token_id,
    layer types and window, non-causal flag, sample_from_anchor, state-dict keys / shapes /
    trainable flags) of both sides, deepdiffed; the candidate (and the reference) also
    against the profile. Differences that cannot change training warn (dtype, inference-only
    buffers, frozen entries present on one side only)."""
    if not cand.structure:
        findings = profile_differences(ref.structure, case, "reference") + load_findings(ref)
        status = worst([WARN] + [f["status"] for f in findings])
        return CheckResult("structure", case.name, status,
                           "not provided: the candidate returned no structure summary"
                           + (f"; {findings[0]['reason']}" if findings else ""),
                           reference=normalized_structure(ref.structure),
                           details={"findings": findings})
    c_norm, r_norm = normalized_structure(cand.structure), normalized_structure(ref.structure)
    findings = structure_differences(c_norm, r_norm)
    findings += profile_differences(cand.structure, case, "candidate")
    findings += profile_differences(ref.structure, case, "reference")
    findings += load_findings(ref)
    status = worst(f["status"] for f in findings)
    top = [f for f in findings if f["status"] == status]
    if status == PASS:
        summary = (f"structures agree ({len(r_norm.get('state_dict', {}))} state-dict entries, "
                   "fc, target layers, block, mask token, layer layout) and match the profile")
    else:
        summary = f"{len(top)} {status}: " + "; ".join(f["reason"] for f in top[:3])
    first = top[0] if status != PASS else None
    return CheckResult(
        "structure", case.name, status, summary,
        candidate={k: v for k, v in c_norm.items() if k != "state_dict"},
        reference={k: v for k, v in r_norm.items() if k != "state_dict"},
        first_diff=({"field": first["field"], "candidate": first.get("candidate"),
                     "reference": first.get("reference", first.get("profile"))}
                    if first else None),
        details={"findings": findings})


# ----------------------------------------------------------------------------- defaults
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


def _same_default(a: Any, b: Any) -> bool:
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
    status = WARN if differing else PASS
    reported = "" if cand.defaults else "; the candidate reports no defaults"
    summary = ("defaults differ (both sides ran the profile's explicit values): "
               + "; ".join(differing) if differing else
               "both sides ran the profile's explicit values" + reported)
    return CheckResult("defaults", case.name, status, summary,
                       candidate=dict(cand.defaults), reference=dict(ref.defaults),
                       details={"fields": fields})


# --------------------------------------------------------------------------------- mask
def mask_coordinates(case: Case, q: int, kv: int) -> dict[str, Any]:
    """Reference coordinates of mask entry (q, kv): the query's anchor / slot / document and
    either the context position (kv < T) or the block key (anchor, slot) (kv >= T)."""
    B = case.config.block_size
    doc = case.inputs["document_ids"].reshape(-1)
    T = doc.numel()
    out: dict[str, Any] = slot_coordinates(case, q)
    if kv < T:
        out.update(kv_position=int(kv), kv_document=int(doc[kv]))
    else:
        kb, ks = divmod(int(kv) - T, B)
        out.update(block_key={"anchor": kb, "slot": ks})
    return out


def check_mask(case: Case, cand: SideOutputs, ref: SideOutputs, layer_type: str
               ) -> CheckResult:
    """Exact equality of one layer type's [Q, T+Q] bool mask on the rows of blocks with a
    supervised slot (other rows feed no trained logit: a difference there passes, noted)."""
    name, key = "mask", f"mask.{layer_type}"
    details: dict[str, Any] = {"layer_type": layer_type}
    if key not in ref.tensors:
        if layer_type not in case.config.effective_layer_types:
            return CheckResult(name, case.name, WARN,
                               f"the candidate returned a {layer_type} mask, but the profile has "
                               f"no {layer_type} layer (see structure: layer_types)",
                               details=details)
        return _not_provided(name, case, f"{layer_type} mask", side="reference", details=details)
    if key not in cand.tensors:
        return _not_provided(name, case, f"{layer_type} mask", details=details)
    c, r = as_bool_mask(cand.tensors[key]), as_bool_mask(ref.tensors[key])
    if c.shape != r.shape:
        return CheckResult(name, case.name, FAIL,
                           f"{layer_type} mask shape {list(c.shape)} != reference {list(r.shape)}",
                           candidate=list(c.shape), reference=list(r.shape), details=details)
    rows = supervised_rows(case, ref)
    differ = c != r
    trained = differ & rows[:, None]
    details.update(differing=int(differ.sum()), differing_on_supervised_rows=int(trained.sum()),
                   extra_attention=int((trained & c).sum()),
                   missing_attention=int((trained & r).sum()))
    if not trained.any():
        note = (f" ({int(differ.sum())} entries differ on blocks without supervised slots, "
                "which cannot change training)") if differ.any() else ""
        return CheckResult(name, case.name, PASS,
                           f"{layer_type} masks equal on all {int(rows.sum())} trained rows{note}",
                           details=details)
    q, kv = (int(i) for i in trained.nonzero()[0])
    first = {**mask_coordinates(case, q, kv), "layer_type": layer_type}
    summary = (f"{layer_type} masks differ at {int(trained.sum())} entries of trained rows "
               f"({details['extra_attention']} extra, {details['missing_attention']} missing "
               f"attention); first at anchor {first['anchor']} slot {first['slot']} "
               + (f"kv position {first['kv_position']}" if "kv_position" in first else
                  f"block key {first['block_key']}"))
    return CheckResult(name, case.name, FAIL, summary, candidate=bool(c[q, kv]),
                       reference=bool(r[q, kv]), tolerance={"atol": 0.0, "rtol": 0.0},
                       first_diff=first, details=details)


def check_masks(case: Case, cand: SideOutputs, ref: SideOutputs) -> list[CheckResult]:
    """:func:`check_mask` for every layer type of the profile (and any other either side
    returned)."""
    types = list(dict.fromkeys(case.config.effective_layer_types))
    for side in (ref, cand):
        types += [t for t in reference_masks(side) if t not in types]
    return [check_mask(case, cand, ref, t) for t in types]


# ------------------------------------------------------------------------------ tensors
def _tensor_result(name: str, case: Case, cand: SideOutputs, ref: SideOutputs,
                   select: Callable[[torch.Tensor], torch.Tensor], where: str,
                   locate: Callable[[tuple[int, ...]], dict[str, Any]]) -> CheckResult:
    """Shared body of the float tensor checks: presence, shape, closeness on a selection."""
    if name not in ref.tensors:
        return _not_provided(name, case, name, side="reference")
    if name not in cand.tensors:
        return _not_provided(name, case, name)
    c, r = cand.tensors[name], ref.tensors[name]
    tol = tolerance(case)
    if c.shape != r.shape:
        return CheckResult(name, case.name, FAIL,
                           f"{name} shape {list(c.shape)} != reference {list(r.shape)}",
                           candidate=list(c.shape), reference=list(r.shape), tolerance=tol)
    cs, rs = select(c), select(r)
    res = closeness(cs, rs, **tol)
    details = {"compared": where, "num_compared": int(rs.numel()), "num_bad": res.num_bad}
    if res.ok:
        return CheckResult(name, case.name, PASS,
                           f"{name} match on {where} (max abs {_fmt(res.max_abs)}, max rel "
                           f"{_fmt(res.max_rel)})", tolerance=tol, max_abs_diff=res.max_abs,
                           max_rel_diff=res.max_rel, details=details)
    first = locate(res.first_bad)
    cv, rv = float(cs[res.first_bad]), float(rs[res.first_bad])
    return CheckResult(name, case.name, FAIL,
                       f"{name} differ on {res.num_bad} of {rs.numel()} values ({where}); max "
                       f"abs {_fmt(res.max_abs)}, max rel {_fmt(res.max_rel)}; first at "
                       + ", ".join(f"{k} {v}" for k, v in first.items()),
                       candidate=cv, reference=rv, tolerance=tol, max_abs_diff=res.max_abs,
                       max_rel_diff=res.max_rel, first_diff=first, details=details)


def check_context(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """``context`` = hidden_norm(fc(hidden_states)) [1,T,H] on the positions a supervised block
    may attend (reference masks)."""
    seen = attended_positions(case, ref)
    positions = seen.nonzero().squeeze(-1)
    doc = case.inputs["document_ids"].reshape(-1)

    def locate(i):
        p = int(positions[i[1]])
        return {"position": p, "document": int(doc[p]), "feature": i[2]}

    return _tensor_result("context", case, cand, ref, lambda t: t[:, seen],
                          f"{int(seen.sum())} attended context positions", locate)


def _slot_check(name: str, case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Targets / logits [1,Q,V_d] on the reference's supervised slots."""
    sup = supervised_slots(case, ref)
    slots = sup.nonzero().squeeze(-1)

    def locate(i):
        return {**slot_coordinates(case, int(slots[i[1]])), "vocab": i[2]}

    result = _tensor_result(name, case, cand, ref, lambda t: t[:, sup],
                            f"{int(sup.sum())} supervised slots", locate)
    if name in cand.tensors and name in ref.tensors and \
            cand.tensors[name].shape == ref.tensors[name].shape and sup.any():
        same = cand.tensors[name][0, sup].argmax(-1) == ref.tensors[name][0, sup].argmax(-1)
        result.details["argmax_agreement"] = float(same.float().mean())
    return result


def check_targets(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Verifier target logits [1,Q,V_d] on supervised slots."""
    return _slot_check("targets", case, cand, ref)


def check_logits(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Draft logits [1,Q,V_d] on supervised slots."""
    return _slot_check("logits", case, cand, ref)


# --------------------------------------------------------------------------------- loss
def fit_decay(weights: torch.Tensor, supervised: torch.Tensor, block_size: int
              ) -> dict[str, float | None] | None:
    """Fit ``w_s = exp(-(s - s0) / gamma)`` to per-position weights on supervised slots.

    Args:
        weights: [1,Q] or [Q]; supervised: [Q] bool; block_size: B.

    Returns:
        ``{"gamma", "offset" (s0: 1 for exp(-(s-1)/g), 0 for exp(-s/g)), "w0" (weight of slot 0
        where seen, else None), "constant_per_slot" (same weight in every block)}``, gamma and
        offset None when fewer than two slots carry positive weight; None without supervised
        slots. Each slot's weight is its median over supervised positions.
    """
    w = weights.reshape(-1, block_size).double()
    m = supervised.reshape(-1, block_size)
    if not m.any():
        return None
    per_slot, constant = {}, True
    for s in range(block_size):
        vals = w[:, s][m[:, s]]
        if vals.numel():
            per_slot[s] = float(vals.median())
            constant &= bool((vals - vals.median()).abs().max() <= 1e-6 * max(1.0, abs(
                per_slot[s])))
    w0 = per_slot.get(0)
    pts = [(s, math.log(v)) for s, v in per_slot.items() if s >= 1 and v > 0]
    gamma = offset = None
    if len(pts) >= 2:
        n = len(pts)
        sx, sy = sum(p[0] for p in pts), sum(p[1] for p in pts)
        sxx, sxy = sum(p[0] ** 2 for p in pts), sum(p[0] * p[1] for p in pts)
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        intercept = (sy - slope * sx) / n
        if slope < 0:
            gamma = -1.0 / slope
            offset = intercept * gamma  # log w = (s0 - s)/g  =>  intercept = s0/g
    return {"gamma": gamma, "offset": offset, "w0": w0, "constant_per_slot": constant,
            "per_slot": per_slot}


def _compare_mask(case: Case, cand: SideOutputs, ref: SideOutputs) -> dict[str, Any]:
    if "aligned_loss_mask" not in cand.tensors or "aligned_loss_mask" not in ref.tensors:
        return {"status": WARN, "reason": "aligned_loss_mask not provided"}
    c = cand.tensors["aligned_loss_mask"].reshape(-1).bool()
    r = ref.tensors["aligned_loss_mask"].reshape(-1).bool()
    if c.shape != r.shape:
        return {"status": FAIL, "reason": f"aligned_loss_mask shape {list(c.shape)} != "
                                          f"reference {list(r.shape)}"}
    if torch.equal(c, r):
        return {"status": PASS, "supervised": int(r.sum())}
    q = int((c != r).nonzero()[0])
    return {"status": FAIL, "num_bad": int((c != r).sum()),
            "first_diff": {**slot_coordinates(case, q), "candidate": bool(c[q]),
                           "reference": bool(r[q])},
            "reason": f"aligned_loss_mask (which slots are trained) differs at "
                      f"{int((c != r).sum())} slots: candidate trains {int(c.sum())}, reference "
                      f"{int(r.sum())}"}


def _compare_weights(case: Case, cand: SideOutputs, ref: SideOutputs, key: str,
                     sup: torch.Tensor) -> dict[str, Any]:
    term = key.split(".", 1)[1]
    B = case.config.block_size
    r = ref.tensors[key].reshape(-1)
    out: dict[str, Any] = {"term": term, "reference_fit": fit_decay(r, sup, B)}
    if key not in cand.tensors:
        return {**out, "status": WARN, "reason": f"loss weights of {term!r} not provided"}
    c = cand.tensors[key].reshape(-1)
    if c.shape != r.shape:
        return {**out, "status": FAIL, "reason": f"loss weights of {term!r} shape "
                                                 f"{list(c.shape)} != reference {list(r.shape)}"}
    out["candidate_fit"] = fit_decay(c, sup, B)
    res = closeness(c[sup], r[sup], **tolerance(case))
    out.update(max_abs=res.max_abs, max_rel=res.max_rel)
    if res.ok:
        return {**out, "status": PASS}
    slots = sup.nonzero().squeeze(-1)
    q = int(slots[res.first_bad[0]])
    gc, gr = (out["candidate_fit"] or {}).get("gamma"), (out["reference_fit"] or {}).get("gamma")
    implied = (f" (implied gamma: candidate {_fmt(gc) if gc else '-'}, reference "
               f"{_fmt(gr) if gr else '-'})")
    return {**out, "status": FAIL, "num_bad": res.num_bad,
            "first_diff": {**slot_coordinates(case, q), "term": term,
                           "candidate": float(c[q]), "reference": float(r[q])},
            "reason": f"per-slot weights of {term!r} differ on {res.num_bad} supervised slots"
                      + implied}


def check_loss(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Total loss (scalar, assert_close tolerance), the aligned loss mask (exact: which slots
    are trained) and the per-position weights of every loss term on supervised slots, with the
    decay gamma each side's weights imply (:func:`fit_decay`)."""
    if "loss" not in ref.tensors:
        return _not_provided("loss", case, "loss", side="reference")
    tol = tolerance(case)
    sup = supervised_slots(case, ref)
    parts: dict[str, Any] = {"aligned_loss_mask": _compare_mask(case, cand, ref)}
    for key in sorted(k for k in ref.tensors if k.startswith("loss_weights.")):
        parts[key] = _compare_weights(case, cand, ref, key, sup)
    rl = float(ref.tensors["loss"])
    if "loss" not in cand.tensors:
        parts["total"] = {"status": WARN, "reason": "total loss not provided"}
        cl = max_abs = max_rel = None
    else:
        cl = float(cand.tensors["loss"])
        res = closeness(cand.tensors["loss"].reshape(()), ref.tensors["loss"].reshape(()), **tol)
        max_abs, max_rel = res.max_abs, res.max_rel
        parts["total"] = {"status": PASS if res.ok else FAIL, "candidate": cl, "reference": rl,
                          "reason": f"total loss {cl:.6g} vs reference {rl:.6g}"}
    status = worst(p["status"] for p in parts.values())
    bad = [p for p in parts.values() if p["status"] == status and status != PASS]
    fits = {k.split(".", 1)[1]: {"candidate": (p.get("candidate_fit") or {}).get("gamma"),
                                 "reference": (p.get("reference_fit") or {}).get("gamma")}
            for k, p in parts.items() if k.startswith("loss_weights.")}
    if status == PASS:
        summary = (f"loss {cl:.6g} matches ({int(sup.sum())} supervised slots, weights of "
                   f"{len(fits)} term(s) equal)")
    else:
        summary = "; ".join(p["reason"] for p in bad)
    first = next((p.get("first_diff") for p in bad if p.get("first_diff")), None)
    return CheckResult("loss", case.name, status, summary, candidate=cl, reference=rl,
                       tolerance=tol, max_abs_diff=max_abs, max_rel_diff=max_rel,
                       first_diff=first, details={"parts": parts, "implied_gamma": fits})


# ---------------------------------------------------------------------------- gradients
def _grad_tolerance(ref_grad: torch.Tensor, tol: dict[str, float]) -> dict[str, float]:
    """atol scaled by the gradient's magnitude: ``atol * max(1, max|g_ref|)``."""
    scale = float(ref_grad.abs().max()) if ref_grad.numel() else 0.0
    return {"atol": tol["atol"] * max(1.0, scale), "rtol": tol["rtol"]}


def _frozen_on_reference(ref: SideOutputs) -> set[str]:
    sd = ref.structure.get("state_dict", {})
    frozen = {k for k, v in sd.items() if not v.get("trainable")}
    return frozen | (set(FROZEN_PARAMETERS) - set(ref.trainable))


def check_gradients(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Gradient of every trainable parameter of the reference after one backward; a gradient
    on one side only fails (unless it is all zeros); a candidate gradient for a parameter the
    reference freezes fails (frozen weights being trained). Tolerance per parameter:
    ``atol * max(1, max|g_ref|)``, ``rtol`` from :data:`TOLERANCES`."""
    cg = {k[5:]: v for k, v in cand.tensors.items() if k.startswith("grad.")}
    rg = {k[5:]: v for k, v in ref.tensors.items() if k.startswith("grad.")}
    if not cg and not cand.trainable:
        return _not_provided("gradients", case, "gradients")
    tol = tolerance(case)
    names = list(dict.fromkeys([*ref.trainable, *rg]))
    per_param: dict[str, dict[str, Any]] = {}
    problems: list[tuple[str, str, dict | None]] = []  # (parameter, reason, first_diff)
    for n in names:
        c, r = cg.get(n), rg.get(n)
        if c is None or r is None:
            present = c if c is not None else r
            if present is None or not present.abs().max() > 0:
                note = "either side" if present is None else "one side, zero on the other"
                per_param[n] = {"status": PASS, "note": f"no gradient on {note}"}
                continue
            side = "candidate" if c is None else "reference"
            per_param[n] = {"status": FAIL, "reason": f"no gradient on the {side} side"}
            problems.append((n, f"{n}: no gradient on the {side} side", None))
            continue
        if c.shape != r.shape:
            per_param[n] = {"status": FAIL, "reason": f"shape {list(c.shape)} != {list(r.shape)}"}
            problems.append((n, f"{n}: gradient shape {list(c.shape)} != reference "
                                f"{list(r.shape)}", None))
            continue
        ptol = _grad_tolerance(r, tol)
        res = closeness(c, r, **ptol)
        per_param[n] = {"status": PASS if res.ok else FAIL, "max_abs": res.max_abs,
                        "max_rel": res.max_rel, "atol": ptol["atol"], "num_bad": res.num_bad}
        if not res.ok:
            problems.append((n, f"{n}: max abs {_fmt(res.max_abs)} (atol {_fmt(ptol['atol'])}), "
                                f"max rel {_fmt(res.max_rel)}",
                             {"parameter": n, "index": list(res.first_bad),
                              "candidate": float(c[res.first_bad]),
                              "reference": float(r[res.first_bad])}))
    frozen = _frozen_on_reference(ref)
    for n in sorted(set(cg) - set(names)):
        if n in cand.trainable or bool(cg[n].abs().max() > 0):
            why = "frozen in the reference" if n in frozen else "not a reference parameter"
            per_param[n] = {"status": FAIL, "reason": why}
            problems.append((n, f"{n}: {why} but trained by the candidate", {"parameter": n}))
    for n in sorted(set(cand.trainable) & frozen - set(per_param)):
        per_param[n] = {"status": FAIL, "reason": "frozen in the reference"}
        problems.append((n, f"{n}: frozen in the reference but trainable on the candidate "
                            "side", {"parameter": n}))
    if not problems:
        worst_abs = max((p.get("max_abs", 0.0) for p in per_param.values()), default=0.0)
        return CheckResult("gradients", case.name, PASS,
                           f"gradients of all {len(names)} trainable parameters match (max abs "
                           f"{_fmt(worst_abs)})", tolerance=tol, max_abs_diff=worst_abs,
                           details={"parameters": per_param})
    first_name, _, first = problems[0]
    max_abs = max((p.get("max_abs", 0.0) for p in per_param.values()), default=None)
    max_rel = max((p.get("max_rel", 0.0) for p in per_param.values()), default=None)
    return CheckResult(
        "gradients", case.name, FAIL,
        f"{len(problems)} of {len(per_param)} parameters differ; first: {problems[0][1]}",
        candidate=(first or {}).get("candidate"), reference=(first or {}).get("reference"),
        tolerance=tol, max_abs_diff=max_abs, max_rel_diff=max_rel,
        first_diff=first or {"parameter": first_name},
        details={"parameters": per_param, "failing": [p[0] for p in problems]})


# ------------------------------------------------------------------------------ metrics
def eal_value(metrics: dict[str, float]) -> float | None:
    """A side's reported expected acceptance length: ``eal_sum / eal_total`` or ``eal``."""
    if "eal_sum" in metrics and metrics.get("eal_total"):
        return metrics["eal_sum"] / metrics["eal_total"]
    return metrics.get("eal")


def eal_definitions(side: SideOutputs, case: Case, value: float | None = None) -> list[str]:
    """Which EAL definitions (:data:`EAL_DEFINITIONS`) reproduce a side's reported EAL from
    its own logits, targets and aligned loss mask (empty when none does or data is missing)."""
    value = eal_value(side.metrics) if value is None else value
    t = side.tensors
    if value is None or not {"logits", "targets", "aligned_loss_mask"} <= set(t):
        return []
    m = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"],
                       case.config.block_size, case.config.sample_from_anchor)
    computed = {"leading-run": m["eal_sum"] / m["eal_total"] if m["eal_total"] else None,
                "product-of-marginals": m["eal_product"]}
    return [name for name, v in computed.items()
            if v is not None and abs(v - value) <= 1e-5 * max(1.0, abs(value))]


def _count_keys(metrics: dict[str, float]) -> list[str]:
    return [k for k in metrics if (k.startswith("position_") or k.startswith("full_acc"))]


def check_metrics(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """Per-slot accuracy sums/totals, full accuracy, EAL and loss-valued metrics of both sides.

    Metrics are logged, not trained on, so this never fails: it warns where values differ
    (other than argmax near-ties of logits that agree within tolerance) and where the two
    sides' EAL follows different definitions — which one each side's number matches is
    detected from its own tensors and named (version-dependent: speculators 0.9.0 reports
    "leading-run", main@c05b95b "product-of-marginals")."""
    if not cand.metrics:
        return _not_provided("metrics", case, "metrics")
    diffs, missing = {}, []
    for k in sorted(set(_count_keys(ref.metrics)) | {"loss_sum"} |
                    {k for k in ref.metrics if k.endswith("_loss_sum")}):
        if k not in ref.metrics:
            continue
        c, r = cand.metrics.get(k), ref.metrics[k]
        if c is None:
            missing.append(k)
        elif abs(c - r) > 1e-5 * max(1.0, abs(r)):
            diffs[k] = {"candidate": c, "reference": r}
    ce, re_ = eal_value(cand.metrics), eal_value(ref.metrics)
    c_defs, r_defs = eal_definitions(cand, case, ce), eal_definitions(ref, case, re_)
    details = {"eal": {"candidate": ce, "reference": re_, "candidate_definition": c_defs,
                       "reference_definition": r_defs, "definitions": EAL_DEFINITIONS},
               "differences": diffs}
    reasons = []
    if ce is not None and re_ is not None and c_defs and r_defs and not set(c_defs) & set(r_defs):
        reasons.append(f"EAL definitions differ: candidate {c_defs[0]!r} "
                       f"({EAL_DEFINITIONS[c_defs[0]]}) = {ce:.4g}, reference {r_defs[0]!r} "
                       f"({EAL_DEFINITIONS[r_defs[0]]}) = {re_:.4g}")
    elif ce is not None and re_ is not None and abs(ce - re_) > 1e-5 * max(1.0, abs(re_)):
        diffs["eal"] = {"candidate": ce, "reference": re_}
    elif re_ is not None and ce is None:
        missing.append("eal")
    details["not_provided"] = missing
    value_diffs = {k: v for k, v in diffs.items() if k == "eal" or k in _count_keys(ref.metrics)}
    if value_diffs and _near_ties_only(case, cand, ref):
        details["near_ties"] = sorted(value_diffs)
        for k in value_diffs:
            diffs.pop(k)
    if diffs:
        shown = ", ".join(f"{k}: {v['candidate']} vs {v['reference']}"
                          for k, v in list(diffs.items())[:4])
        reasons.append(f"{len(diffs)} metric(s) differ ({shown})")
    if missing:
        reasons.append(f"not provided by the candidate: {', '.join(missing[:6])}"
                       + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else ""))
    if not reasons:
        note = (f"; differences only from argmax near-ties of logits equal within tolerance "
                f"({', '.join(details['near_ties'])})") if details.get("near_ties") else ""
        defs = f" (EAL definition: {r_defs[0]})" if r_defs else ""
        return CheckResult("metrics", case.name, PASS, f"metrics agree{defs}{note}",
                           candidate=ce, reference=re_, details=details)
    first_key = next(iter(diffs), "eal" if c_defs != r_defs else None)
    return CheckResult("metrics", case.name, WARN,
                       "; ".join(reasons) + " (metrics do not change training)",
                       candidate=ce, reference=re_,
                       first_diff=({"metric": first_key, **diffs.get(first_key, {})}
                                   if first_key else None),
                       details=details)


def _near_ties_only(case: Case, cand: SideOutputs, ref: SideOutputs) -> bool:
    """Whether both sides' logits and targets agree within tolerance on supervised slots and
    the candidate's metrics follow the reference's definitions on its own tensors — then any
    remaining count difference comes from argmax near-ties."""
    keys = ("logits", "targets", "aligned_loss_mask")
    if not all(k in cand.tensors and k in ref.tensors for k in keys):
        return False
    sup = supervised_slots(case, ref)
    tol = tolerance(case)
    for k in ("logits", "targets"):
        c, r = cand.tensors[k], ref.tensors[k]
        if c.shape != r.shape or not closeness(c[:, sup], r[:, sup], **tol).ok:
            return False
    own = dflash_metrics(cand.tensors["logits"], cand.tensors["targets"],
                         cand.tensors["aligned_loss_mask"], case.config.block_size,
                         case.config.sample_from_anchor)
    return all(abs(own[k] - cand.metrics[k]) <= 1e-6 for k in _count_keys(cand.metrics)
               if k in own)


# ------------------------------------------------------------------------------- runner
CHECKS: tuple[tuple[str, Callable[..., CheckResult | list[CheckResult]]], ...] = (
    ("structure", check_structure), ("defaults", check_defaults), ("mask", check_masks),
    ("context", check_context), ("targets", check_targets), ("logits", check_logits),
    ("loss", check_loss), ("gradients", check_gradients), ("metrics", check_metrics),
    ("anchors", check_anchor_draws),
)


def run_checks(case: Case, cand: SideOutputs, ref: SideOutputs) -> list[CheckResult]:
    """All checks on one case, in report order. A check that raises becomes a ``fail`` result
    naming the error (a malformed output must not hide the other checks)."""
    results: list[CheckResult] = []
    for name, check in CHECKS:
        try:
            out = check(case, cand, ref)
        except Exception as err:  # noqa: BLE001 - reported, not swallowed
            out = CheckResult(name, case.name, FAIL,
                              f"check could not run: {type(err).__name__}: {err}",
                              details={"error": repr(err)})
        results.extend(out if isinstance(out, list) else [out])
    return results
