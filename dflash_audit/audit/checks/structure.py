"""The ``structure`` check: the two sides' structure summaries, deepdiffed, and each side
against the profile.

Compares fc in/out features, target_layer_ids, block_size, mask_token_id, layer types and
window, the non-causal flag, sample_from_anchor and the state dict (keys, shapes, trainable
flags); exact (no tolerance). Differences that cannot change training warn (dtype,
inference-only buffers, frozen entries on one side only, fields one side does not report); a
trainable parameter held in a coarser dtype than the reference's (bf16 where it keeps fp32
master weights) fails unless the candidate reports a master copy of the reference's precision
(``structure["master_weights"]``), since every optimizer update is then rounded.

Hypotheses name: fc fed a subset of the target layers or sized by draft depth, target layer
ids counted by decoder layer (z-lab's convention) / offset by one / negative ids wrapping, mask_token_id falling
back to pad / eos / bos, a window bound off by one, frozen weights being trained (or trained
weights frozen), an lm_head not reduced to the draft vocabulary, state-dict names that do not
load into the reference, trainable parameters without a float32 master copy (with the smallest
update that survives at the case's weights).
"""

from __future__ import annotations

from typing import Any

from deepdiff import DeepDiff

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.precision import (
    MASTER_WEIGHTS,
    lost_update_floor,
    torch_dtype,
    unmastered_parameters,
)
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.audit.tolerance import worst
from dflash_audit.model.config import SLIDING_ATTENTION

#: One layer-id convention, in neutral words (z-lab's, SpecForge's and ModelOpt's own ids; said
#: only when one of them is the candidate: :mod:`dflash_audit.audit.frameworks.rules`).
DECODER_LAYER_IDS = ("target layer ids counted by decoder layer, offset by one (id k = layer "
                     "k's output, hidden_states[k+1] = speculators id k+1)")
#: Structure fields only one side reports that cannot change training (the reference's
#: adapter reports its verifier-norm class and how the case weights loaded).
ONE_SIDED_STRUCTURE_FIELDS = ("verifier_norm", "load_missing_keys", "load_unexpected_keys",
                              MASTER_WEIGHTS)
#: Buffers used only at inference (draft -> verifier vocabulary mapping).
INFERENCE_ONLY_BUFFERS = ("t2d", "d2t")


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
        own = cand if c is not None else ref
        if entry.get("shares") or any(isinstance(e, dict) and e.get("shares") == key
                                      for e in own.values()):  # a second name of one tensor
            return {"field": f"state_dict.{key}", "candidate": c, "reference": r, "status": WARN,
                    "reason": f"{key!r} is another name of a tensor the {side} holds under "
                              f"{entry.get('shares') or 'other names'} too (cannot change "
                              "training)"}
        trainable = bool(entry.get("trainable"))
        status = FAIL if trainable else WARN
        reason = (f"trainable parameter {key!r} exists only on the {side} side" if trainable
                  else f"{'inference-only buffer' if inference_only else 'frozen entry'} "
                       f"{key!r} exists only on the {side} side (cannot change training)")
        return {"field": f"state_dict.{key}", "candidate": c, "reference": r,
                "status": status, "reason": reason}
    cv, rv = (c or {}).get(attr), (r or {}).get(attr)
    if attr == "shares":  # a FAIL where the other side holds both names as separate tensors
        reason = (f"{key!r} is the same trainable tensor as {cv!r} on the candidate side (one "
                  "module used for both: its gradient is the sum of both uses and one update "
                  f"moves both), a parameter of its own in the reference" if cv else
                  f"{key!r} is a parameter of its own on the candidate side, the same tensor "
                  f"as {rv!r} in the reference")
        status = FAIL if (cv in ref if cv else rv in cand) else WARN
    elif attr == "trainable":
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
    precision_findings(case, cand.structure, ref.structure, findings)
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


def _dtype_key(field: str) -> str | None:
    return field[len("state_dict."):-len(".dtype")] if field.startswith("state_dict.") and \
        field.endswith(".dtype") else None


def precision_findings(case: Case, cand: dict[str, Any], ref: dict[str, Any],
                       findings: list[dict[str, Any]]) -> None:
    """Dtype findings (in place) of trainable parameters: one held in a coarser dtype than the
    reference's with no master copy of the reference's precision reported
    (:func:`dflash_audit.audit.precision.unmastered_parameters`) fails, since every optimizer
    update is then rounded to that dtype; one whose dtype the candidate does not report warns
    and says what to report."""
    gaps = unmastered_parameters(cand, ref)
    sd = cand.get("state_dict") or {}
    for f in findings:
        key = _dtype_key(f["field"])
        if key in gaps:
            f["status"] = FAIL
            f["reason"] = (f"{key!r} is trained in {gaps[key]} with no {f.get('reference')} "
                           f"master copy reported (the reference trains {f.get('reference')} "
                           "weights)")
        elif key and f.get("candidate") is None and (sd.get(key) or {}).get("trainable"):
            f["reason"] = (f"the dtype of trainable {key!r} is not reported: whether its updates "
                           "keep a float32 master copy cannot be checked (report "
                           f"state_dict[{key!r}]['dtype'], and structure[{MASTER_WEIGHTS!r}] "
                           "when the optimizer keeps its own copy)")


def master_weights_cause(ev: Evidence, keys: list[str], cand: dict[str, Any]) -> str:
    """The class "trainable parameters in <dtype> with no fp32 master copy" with the smallest
    update that survives at this case's weights (:func:`dflash_audit.audit.precision.
    lost_update_floor`) and what a candidate whose optimizer keeps a master copy reports."""
    sd = cand.get("state_dict") or {}
    dtypes = sorted({str(sd[k]["dtype"]).replace("torch.", "") for k in keys})
    low = torch_dtype(dtypes[0])
    floors = sorted((lost_update_floor(ev.case.weights[k], low), k) for k in keys
                    if k in ev.case.weights)
    trainable = sum(1 for e in sd.values() if isinstance(e, dict) and e.get("trainable"))
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    under = f" under {ev.case.dtype} training" if ev.case.dtype != "fp32" else ""
    floor = (f"; an update below {floors[0][0]:.2g} at {floors[0][1]}'s median entry, "
             f"{floors[-1][0]:.2g} at {floors[-1][1]}'s, leaves the weight unchanged"
             if floors and low is not None else "")
    return (f"trainable parameters in {' and '.join(dtypes)} with no float32 master copy"
            f"{under} (on this case: {len(keys)} of {trainable}, {shown}{floor}): every "
            f"optimizer update is rounded to {dtypes[0]}, so an Adam step, about the learning "
            "rate, rounds away once the rate falls below that and those weights stop learning; "
            "the reference keeps float32 master weights" + (" and runs the step under autocast"
                                                             if under else "") +
            ". A candidate whose optimizer keeps a float32 master copy (a mixed-precision "
            f"optimizer) reports it as structure[{MASTER_WEIGHTS!r}] = 'float32' (or "
            "{parameter: dtype})")


def diagnose_fc(ev: Evidence, fc_in: int) -> list[str]:
    """fc in_features k*H against n*H: a subset of the target layers, or the draft depth."""
    c = ev.config
    H, n, depth = c.hidden_size, c.num_target_layers, c.num_hidden_layers
    if fc_in % H:
        return [f"fc in_features {fc_in} is not a multiple of hidden_size {H}"]
    k = fc_in // H
    out = []
    if k < n:
        out.append(f"fc fed {k} of {n} target layers: Linear({k}*H, H) instead of "
                   f"Linear({n}*H, H)")
    elif k > n:
        out.append(f"fc reads {k} layers' features, the profile has n={n} target layers")
    if k == depth:
        out.append(f"fc sized by draft depth: in_features = num_hidden_layers ({depth}) * H "
                   f"instead of the number of target layers ({n}) * H")
    return out


def diagnose_layer_ids(ev: Evidence, ids: list[int]) -> str:
    """Name the convention that turns the reference's target_layer_ids into ``ids``."""
    ref = list(ev.config.target_layer_ids)
    N = ev.config.num_verifier_layers
    if len(ids) == len(ref):
        if [i + 1 for i in ids] == ref:
            return f"{DECODER_LAYER_IDS}: {ids} instead of {ref}"
        if [i - 1 for i in ids] == ref:
            return (f"target layer ids offset by +1 ({ids} instead of {ref}): speculators ids "
                    "converted as if they were decoder-layer ids (id k = speculators id k+1)")
        if any(i < 0 for i in ids):
            for base, label in ((N, "N+id"), (N + 1, "N+1+id")):
                if [i + base if i < 0 else i for i in ids] == ref:
                    return (f"negative target layer ids {ids} wrap python-style ({label}); the "
                            f"reference needs explicit ids {ref}")
            return f"negative target layer ids {ids} (reference {ref})"
    return f"target layer ids {ids} differ from the reference's {ref}"


def diagnose_structure_finding(ev: Evidence, f: dict[str, Any]) -> list[str] | str | None:
    """The cause(s) of one failing structure finding, or None (the finding is its own cause)."""
    field, c = f["field"], f.get("candidate")
    cfg = ev.config
    if field in ("fc_in_features", "state_dict.fc.weight.shape") and c is not None:
        return diagnose_fc(ev, c if field == "fc_in_features" else c[1])
    if field == "target_layer_ids" and c is not None:
        return diagnose_layer_ids(ev, list(c))
    if field == "mask_token_id" and c is not None:
        named = {"pad_token_id": cfg.pad_token_id, **cfg.extra}
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if named.get(name) == c:
                return (f"mask_token_id falls back to {name} ({c}); the profile's is "
                        f"{cfg.mask_token_id}")
        return f"mask_token_id {c}, the profile's is {cfg.mask_token_id}"
    if field == "sliding_window" and c is not None and cfg.sliding_window:
        return (f"window bound off by {c - cfg.sliding_window:+d}: W={c}, reference "
                f"W={cfg.sliding_window}")
    if field.endswith(".shares"):
        return _shared_cause(ev, f)
    if field.endswith(".trainable"):
        key = field[len("state_dict."):-len(".trainable")]
        return (f"frozen weights being trained: {key} is trainable on the candidate side"
                if c else f"{key} frozen on the candidate side (the reference trains it)")
    if field in ("state_dict.lm_head.weight.shape", "state_dict.verifier_lm_head.weight.shape"):
        return (f"{field.split('.')[1]} has {c[0]} rows: not reduced to the draft vocabulary "
                f"(V_d={cfg.effective_draft_vocab_size})")
    if f.get("reference") in ("missing", "unexpected"):
        return f["reason"]
    return None


def _shared_cause(ev: Evidence, f: dict[str, Any]) -> str:
    """One cause per pair of modules whose weights are shared: ``layers.1`` shares
    ``layers.0``'s, from the first entry of the pair (the key's module prefixes)."""
    key, other = f["field"][len("state_dict."):-len(".shares")], f.get("candidate")
    if not other:
        return f["reason"]
    a, b = key.split("."), str(other).split(".")
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1  # the common parameter path (self_attn.q_proj.weight)
    mine, theirs = ".".join(a[:len(a) - n]) or key, ".".join(b[:len(b) - n]) or str(other)
    return (f"{mine} shares its trainable weights with {theirs} on the candidate side (one "
            f"module used twice, e.g. nn.ModuleList([layer] * n)); the reference trains "
            f"separate weights")


def diagnose_structure(ev: Evidence, result: CheckResult) -> list[str]:
    """The causes of every failing structure finding."""
    causes: list[str] = []
    findings = result.details.get("findings", [])
    unmastered = [_dtype_key(f["field"]) for f in findings
                  if f["status"] == FAIL and _dtype_key(f["field"])]
    if unmastered:
        causes.append(master_weights_cause(ev, unmastered, ev.cand.structure))
    for f in findings:
        if f["status"] == FAIL and not _dtype_key(f["field"]):
            found = diagnose_structure_finding(ev, f) or [f["reason"]]  # the field is the cause
            causes += [found] if isinstance(found, str) else found
    return list(dict.fromkeys(causes))
