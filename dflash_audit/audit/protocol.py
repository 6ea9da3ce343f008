"""The output protocol (per key: shape, dtype, meaning) and its validation, plus non-finite
values as findings. Both run on each side's SideOutputs BEFORE any comparison: a comparison
of a misread output (an int 0/1 mask read as an additive one, NaN compared as a number)
explains nothing.

:data:`OUTPUT_SPEC` is the one place the expected outputs are defined. Dimension symbols,
from the case (:func:`case_dims`): ``T`` tokens of the row, ``H`` hidden size, ``A`` anchor
slots, ``B`` block size, ``Q = A * B`` query slots, ``V_d`` draft vocabulary size, ``K``
anchor draws (any). ``float`` means the case dtype (that of ``fc.weight``; fp32 today).

Policy on non-finite values (NaN, +-inf), on either side: a non-finite value in any output
that feeds training -- logits, loss, loss weights, gradients, context, targets -- is a FAIL;
so is a non-finite metric (a NaN acceptance metric means the candidate's training signal is
broken). NaN never compares as equal or "within tolerance" (:func:`dflash_audit.audit.
tolerance.closeness`), never counts as "no gradient" and is never read as a boolean True.
Compare reports all findings of both sides as the first check of each case (``protocol``,
:mod:`dflash_audit.audit.checks.output_protocol`) and does not compare the keys that break
the protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.result import FAIL, WARN, CheckResult
from dflash_audit.model.loss import parse_loss


@dataclass(frozen=True)
class OutputSpec:
    """One output key (or family ``prefix.<name>``) of the protocol.

    ``shape``: dimension symbols (see the module docstring); ``None`` = the shape of the
    parameter in the case's weights (gradients). ``dtype``: ``float`` (the case dtype),
    ``bool``, ``int`` (any integer dtype) or ``mask01`` (bool, or the case dtype holding 0/1).
    """

    key: str
    shape: tuple[str, ...] | None
    dtype: str
    meaning: str
    required: bool = True


OUTPUT_SPEC: tuple[OutputSpec, ...] = (
    OutputSpec("context", ("1", "T", "H"), "float", "hidden_norm(fc(hidden_states))"),
    OutputSpec("mask.<layer type>", ("Q", "T+Q"), "bool",
               "attention mask of that layer type, True = attend"),
    OutputSpec("targets", ("1", "Q", "V_d"), "float", "verifier target logits per slot"),
    OutputSpec("logits", ("1", "Q", "V_d"), "float", "draft logits per slot"),
    OutputSpec("aligned_loss_mask", ("1", "Q"), "mask01", "1 = the slot is trained"),
    OutputSpec("loss", (), "float", "total loss of the step"),
    OutputSpec("loss_weights.<term>", ("1", "Q"), "float", "per-slot weight of a loss term"),
    OutputSpec("grad.<parameter>", None, "float", "gradient of a trainable parameter",
               required=False),
    OutputSpec("target_ids", ("1", "Q"), "int", "the token each slot is taught (verifier "
               "vocabulary): hard-label trainers, instead of or besides targets",
               required=False),
    OutputSpec("anchor_draws", ("K", "A"), "int", "the side's own anchor positions, K draws",
               required=False),
    OutputSpec("anchor_draws_valid", ("K", "A"), "bool", "validity of those anchors",
               required=False),
)


@dataclass
class Finding:
    """A protocol violation or non-finite values of one side's output ``key``.

    ``kind``: ``protocol`` | ``non_finite``; ``count``: offending values; ``first``: the
    first one's coordinates in the reference's terms (anchor, slot, position, ...).
    """

    kind: str
    side: str
    key: str
    message: str
    status: str = FAIL
    count: int | None = None
    first: dict[str, Any] | None = None

    def to_check_result(self, case_name: str) -> CheckResult:
        """As a report row: check ``protocol`` / ``non_finite`` of the case."""
        return CheckResult(name=self.kind, case=case_name, status=self.status,
                           summary=self.message, first_diff=self.first,
                           details={"side": self.side, "key": self.key, "count": self.count})


def case_dtype(case: Case) -> torch.dtype:
    """The dtype float outputs must have: that of ``fc.weight`` (else ``hidden_states``)."""
    t = case.weights.get("fc.weight", case.inputs.get("hidden_states"))
    return t.dtype if t is not None else torch.float32


def case_dims(case: Case) -> dict[str, int]:
    """Sizes of the dimension symbols of :data:`OUTPUT_SPEC` for ``case`` (K is free)."""
    T = int(case.inputs["input_ids"].shape[-1])
    A = int(case.inputs["anchor_positions"].numel())
    Q = A * case.config.block_size
    return {"1": 1, "T": T, "H": case.config.hidden_size, "A": A, "B": case.config.block_size,
            "Q": Q, "T+Q": T + Q, "V_d": case.config.effective_draft_vocab_size}


def spec_for(key: str) -> OutputSpec | None:
    """The :class:`OutputSpec` of an output key (``mask.full_attention`` -> the mask family)."""
    for spec in OUTPUT_SPEC:
        if spec.key == key or ("<" in spec.key and key.startswith(spec.key.split("<")[0])):
            return spec
    return None


def required_keys(case: Case) -> list[str]:
    """Keys every side must return for ``case``: the fixed ones, one mask per layer type of
    the profile and one ``loss_weights.<term>`` per loss term."""
    keys = []
    for spec in OUTPUT_SPEC:
        if not spec.required:
            continue
        if spec.key.startswith("mask."):
            keys += [f"mask.{t}" for t in dict.fromkeys(case.config.effective_layer_types)]
        elif spec.key.startswith("loss_weights."):
            keys += [f"loss_weights.{t}" for t in parse_loss(case.loss.loss)]
        else:
            keys.append(spec.key)
    return keys


def label(key: str) -> str:
    """How the report names an output: ``masks['full_attention']``, ``logits``, ..."""
    family, _, name = key.partition(".")
    if not name:
        return key
    return f"{ {'mask': 'masks', 'grad': 'gradients'}.get(family, family)}[{name!r}]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_values(t: torch.Tensor) -> str:
    """``0/1``, ``additive (0 = attend, -inf = blocked)`` or ``with values [...]`` for a
    mask that is not bool."""
    floating = t.is_floating_point()
    finite = t[torch.isfinite(t)] if floating else t
    values = torch.unique(finite.reshape(-1)).tolist() if finite.numel() else []
    blocked = floating and (bool(torch.isneginf(t).any()) or any(v <= -1e4 for v in values))
    if blocked and all(v == 0 or v <= -1e4 for v in values):
        return "additive (0 = attend, -inf = blocked)"
    if not blocked and set(values) <= {0, 1}:
        return "0/1"
    return f"with values {values[:6]}"


def _expected_text(spec: OutputSpec, dtype: torch.dtype) -> str:
    return {"float": f"{_dtype_name(dtype)} (the case dtype)", "bool": "bool, True = attend"
            if spec.key.startswith("mask.") else "bool", "int": "an integer dtype",
            "mask01": f"bool or {_dtype_name(dtype)} 0/1 (1 = trained)"}[spec.dtype]


def misread_keys(out: SideOutputs, case: Case) -> set[str]:
    """Keys of ``out`` a comparison would misread: not a tensor, or a dtype the protocol does
    not allow (an int 0/1 mask read as additive, float16 logits at fp32 tolerance). Wrong
    shapes are not listed: the checks compare and diagnose those themselves."""
    dtype = case_dtype(case)
    bad = set()
    for key, t in out.tensors.items():
        spec = spec_for(key)
        if not isinstance(t, torch.Tensor) or (spec is not None and not _dtype_ok(spec, t,
                                                                                dtype)):
            bad.add(key)
    return bad


def _dtype_ok(spec: OutputSpec, t: torch.Tensor, dtype: torch.dtype) -> bool:
    if spec.dtype == "float":
        return t.dtype == dtype
    if spec.dtype == "bool":
        return t.dtype == torch.bool
    if spec.dtype == "int":
        return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    return t.dtype in (torch.bool, dtype)


def _expected_shape(spec: OutputSpec, key: str, case: Case) -> list[int] | None:
    if spec.shape is None:
        param = case.weights.get(key.partition(".")[2])
        return list(param.shape) if param is not None else None
    dims = case_dims(case)
    return [dims.get(s, -1) for s in spec.shape]  # -1: any size (K)


#: Bytes of outputs outside OUTPUT_SPEC a side may return: up to it a protocol warning (they
#: are ignored, never copied into the report folder); past it a protocol failure.
MAX_EXTRA_OUTPUT_BYTES = 16 * 2**20


def extra_output_finding(out: SideOutputs, side: str) -> Finding | None:
    """A warning naming the outputs outside :data:`OUTPUT_SPEC` (a failure when they hold more
    than :data:`MAX_EXTRA_OUTPUT_BYTES`); None when there are none."""
    extra = {k: t for k, t in out.tensors.items()
             if spec_for(k) is None and isinstance(t, torch.Tensor)}
    if not extra:
        return None
    size = sum(t.numel() * t.element_size() for t in extra.values())
    first = next(iter(sorted(extra)))
    over = size > MAX_EXTRA_OUTPUT_BYTES
    return Finding("protocol", side, first, f"{side} returned {len(extra)} output(s) outside "
                   f"the protocol (first {first!r} {list(extra[first].shape)}; "
                   f"{size / 2**20:.1f} MiB){'; more than the ' if over else ': ignored'}"
                   + (f"{MAX_EXTRA_OUTPUT_BYTES // 2**20} MiB allowed" if over else ""),
                   status=FAIL if over else WARN, count=len(extra))


def validate_outputs(out: SideOutputs, case: Case, side: str = "candidate") -> list[Finding]:
    """Protocol findings of one side's outputs: a missing required key (fail: an output the
    audit cannot compare must not pass; only a missing ``loss_weights.<term>`` beside another
    term's weights warns, as the loss check names the other loss), no metrics (fail), values
    that are not tensors / metrics that are not numbers, and per key a wrong dtype, shape or
    meaning (fail). Empty when all conform."""
    findings: list[Finding] = []
    dtype = case_dtype(case)
    has_weights = any(k.startswith("loss_weights.") for k in out.tensors)
    for key in required_keys(case):
        if key == "targets" and "target_ids" in out.tensors:
            continue  # a hard-label trainer: its target_ids are compared instead
        if key not in out.tensors:
            spec = spec_for(key)
            other_term = key.startswith("loss_weights.") and has_weights
            findings.append(Finding("protocol", side, key, f"{side} returned no {label(key)}; "
                                    f"expected {_shape_text(spec, key, case)} "
                                    f"{_expected_text(spec, dtype)}: {spec.meaning}",
                                    status=WARN if other_term else FAIL))
    if not out.metrics:
        findings.append(Finding("protocol", side, "metrics", f"{side} returned no metrics; "
                                "expected the per-slot accuracies and acceptance length of the "
                                "step (dflash_audit.model.metrics)"))
    for key, t in out.tensors.items():
        spec = spec_for(key)
        if not isinstance(t, torch.Tensor):
            findings.append(Finding("protocol", side, key, f"{side} {label(key)} is a "
                                    f"{type(t).__name__}; expected a torch.Tensor"))
            continue
        if spec is None:  # outside the protocol: extra_output_finding
            continue
        if not _dtype_ok(spec, t, dtype):
            what = _dtype_name(t.dtype)
            if spec.dtype in ("bool", "mask01") and t.dtype != torch.bool:
                what += " " + describe_values(t)
            findings.append(Finding("protocol", side, key, f"{side} {label(key)} is {what}; "
                                    f"expected {_expected_text(spec, dtype)}"))
        expected = _expected_shape(spec, key, case)
        if expected is not None and (len(expected) != t.ndim or any(
                e not in (-1, s) for e, s in zip(expected, t.shape))):
            findings.append(Finding("protocol", side, key, f"{side} {label(key)} has shape "
                                    f"{list(t.shape)}; expected {_shape_text(spec, key, case)}"))
        elif spec.dtype == "mask01" and t.dtype != torch.bool:
            odd = torch.isfinite(t) & (t != 0) & (t != 1)
            if odd.any():
                first = tuple(int(i) for i in odd.nonzero()[0])
                findings.append(Finding("protocol", side, key, f"{side} {label(key)} holds "
                                        f"{int(odd.sum())} values other than 0/1 (first "
                                        f"{float(t[first]):.4g} at "
                                        f"{coordinates_text(locate(key, first, case, t))})",
                                        count=int(odd.sum()), first=locate(key, first, case, t)))
    odd_metrics = {k: v for k, v in out.metrics.items()
                   if isinstance(v, bool) or not isinstance(v, (int, float))}
    if odd_metrics:
        k, v = next(iter(odd_metrics.items()))
        findings.append(Finding("protocol", side, "metrics", f"{side} metrics: "
                                f"{len(odd_metrics)} value(s) are not numbers (first "
                                f"{k!r} = {v!r}); expected float", count=len(odd_metrics),
                                first={"metric": k}))
    extra = extra_output_finding(out, side)
    return findings + ([extra] if extra is not None else [])


def _shape_text(spec: OutputSpec, key: str, case: Case) -> str:
    expected = _expected_shape(spec, key, case)
    if spec.shape is None:
        return f"{expected} (the parameter's shape)"
    sizes = ", ".join("K" if e == -1 else str(e) for e in expected)
    return f"[{', '.join(spec.shape)}] = [{sizes}]"


# ------------------------------------------------------------------------ non-finite
def locate(key: str, index: tuple[int, ...], case: Case, t: torch.Tensor) -> dict[str, Any]:
    """Coordinates of element ``index`` of output ``key`` in the reference's terms: anchor /
    slot / position / document for slot tensors, kv position or block key for masks, the
    position and feature for context, the parameter and index for gradients."""
    from dflash_audit.audit.slots import mask_coordinates, slot_coordinates

    dims = case_dims(case)
    shape = list(t.shape)
    spec = spec_for(key)
    if key.startswith("grad."):
        return {"parameter": key[5:], "index": list(index)}
    if spec is not None and spec.shape is not None and [
            dims.get(s, n) for s, n in zip(spec.shape, shape)] == shape \
            and len(shape) == len(spec.shape):
        if key == "context":
            doc = case.inputs["document_ids"].reshape(-1)
            return {"position": index[1], "document": int(doc[index[1]]), "feature": index[2]}
        if spec.shape[:2] == ("1", "Q"):
            out = slot_coordinates(case, index[1])
            return {**out, "vocab": index[2]} if len(index) == 3 else out
        if spec.shape == ("Q", "T+Q"):
            return mask_coordinates(case, index[0], index[1])
    return {"index": list(index)}


def coordinates_text(coords: dict[str, Any]) -> str:
    """``anchor 3 slot 2 (position 17, document 1)``-style text of :func:`locate`'s dict."""
    if "anchor" in coords:
        extra = ", ".join(f"{k} {v}" for k, v in coords.items()
                          if k in ("position", "document", "vocab", "kv_position", "block_key"))
        return f"anchor {coords['anchor']} slot {coords['slot']}" + (f" ({extra})" if extra
                                                                       else "")
    return " ".join(f"{k} {v}" for k, v in coords.items())


def _non_finite(t: torch.Tensor) -> tuple[int, int, tuple[int, ...] | None]:
    """(NaN count, inf count, first non-finite index) of a floating tensor."""
    from dflash_audit.audit.tolerance import all_finite

    if all_finite(t):  # the common case: one pass over the tensor
        return 0, 0, None
    nan, inf = torch.isnan(t), torch.isinf(t)
    bad = nan | inf
    first = tuple(int(i) for i in bad.nonzero()[0]) if t.ndim else ()
    return int(nan.sum()), int(inf.sum()), first


def _counts_text(nan: int, inf: int) -> str:
    return ", ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if p)


def non_finite_findings(out: SideOutputs, case: Case, side: str = "candidate"
                        ) -> list[Finding]:
    """Non-finite values (NaN, +-inf) of one side: one finding per float tensor (gradients
    summed into one), one for the metrics, each with counts and the first coordinates
    (``candidate logits: 12 non-finite values (12 NaN), first at anchor 3 slot 2 ...``).

    Float masks are skipped (a -inf in an additive mask is its meaning; the protocol check
    already names a float mask)."""
    findings: list[Finding] = []
    grads: list[tuple[str, int, int, tuple[int, ...]]] = []
    for key, t in out.tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or key.startswith("mask."):
            continue
        nan, inf, first = _non_finite(t)
        if first is None:
            continue
        if key.startswith("grad."):
            grads.append((key, nan, inf, first))
            continue
        coords = locate(key, first, case, t)
        where = f", first at {coordinates_text(coords)}" if first else ""
        findings.append(Finding("non_finite", side, key, f"{side} {label(key)}: {nan + inf} "
                                f"non-finite values ({_counts_text(nan, inf)}) of {t.numel()}"
                                f"{where}", count=nan + inf, first=coords))
    if grads:
        nan, inf = sum(g[1] for g in grads), sum(g[2] for g in grads)
        key, _, _, first = grads[0]
        total = sum(1 for k in out.tensors if k.startswith("grad."))
        findings.append(Finding("non_finite", side, "gradients", f"{side} gradients: "
                                f"{nan + inf} non-finite values ({_counts_text(nan, inf)}) in "
                                f"{len(grads)} of {total} parameters, first in {key[5:]} at "
                                f"index {list(first)}", count=nan + inf,
                                first={"parameter": key[5:], "index": list(first)}))
    bad = {k: v for k, v in out.metrics.items()
           if isinstance(v, (int, float)) and not math.isfinite(v)}
    if bad:
        k, v = next(iter(bad.items()))
        findings.append(Finding("non_finite", side, "metrics", f"{side} metrics: {len(bad)} "
                                f"non-finite values of {len(out.metrics)}, first {k} = {v}",
                                count=len(bad), first={"metric": k}))
    return findings


def output_findings(out: SideOutputs, case: Case, side: str) -> list[Finding]:
    """Protocol then non-finite findings of one side (what compare runs before the checks)."""
    return validate_outputs(out, case, side) + non_finite_findings(out, case, side)
