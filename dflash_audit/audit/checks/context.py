"""The ``context`` check: hidden_norm(fc(hidden_states)) [1,T,H] on the context positions a
supervised block may attend (reference masks), at the dtype's assert_close tolerance
(:data:`dflash_audit.audit.tolerance.TOLERANCES`).

Hypotheses name: hidden_states shifted against the loss mask / positions (EAGLE-3-style,
either direction), fc fed a subset of the target layers (and which fc.weight columns it kept),
target layers concatenated in descending order, hidden_norm missing or applied twice, a
hard-coded hidden_norm eps, and dropout left on in training mode (:func:`dropout_rate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.compare_tensors import tensor_result
from dflash_audit.audit.replay.architecture import COMMON_NORM_EPS
from dflash_audit.audit.replay.evidence import (
    Evidence,
    sample,
    search_hypotheses,
    shifted,
)
from dflash_audit.audit.result import CheckResult
from dflash_audit.audit.slots import attended_positions
from dflash_audit.audit.tolerance import closeness
from dflash_audit.model.layers import RMSNorm


def check_context(case: Case, cand: SideOutputs, ref: SideOutputs) -> CheckResult:
    """``context`` = hidden_norm(fc(hidden_states)) [1,T,H] on the positions a supervised block
    may attend (reference masks)."""
    seen = attended_positions(case, ref)
    positions = seen.nonzero().squeeze(-1)
    doc = case.inputs["document_ids"].reshape(-1)

    def locate(i):
        p = int(positions[i[1]])
        return {"position": p, "document": int(doc[p]), "feature": i[2]}

    return tensor_result("context", case, cand, ref, lambda t: t[:, seen],
                         f"{int(seen.sum())} attended context positions", locate)


@dataclass(frozen=True)
class ContextHypothesis:
    """context = hidden_norm^norms(hidden_states[slices] @ fc.weight[:, columns]^T)."""

    slices: tuple[int, ...]  # target-layer slices read, in order
    columns: tuple[int, ...]  # fc.weight column blocks used (in H units)
    norms: int = 1
    eps: float | None = None  # hidden_norm's eps when not the verifier's
    shift: int = 0  # context position p reads hidden_states[p + shift] (zeros past the end)


def context_hypotheses(ev: Evidence) -> Iterator[ContextHypothesis]:
    """All subsets of the n target layers (of the candidate's fc width when reported) with the
    matching or the leading fc.weight columns; no / double hidden_norm; descending layer order;
    a commonly hard-coded eps."""
    n = ev.config.num_target_layers
    all_ = tuple(range(n))
    for shift in (1, -1):  # EAGLE-3-style shifted inputs against the loss mask / positions
        yield ContextHypothesis(all_, all_, 1, shift=shift)
    yield ContextHypothesis(all_, all_, 0)
    yield ContextHypothesis(all_, all_, 2)
    yield ContextHypothesis(all_[::-1], all_, 1)
    for eps in COMMON_NORM_EPS:
        if eps != ev.config.rms_norm_eps:
            yield ContextHypothesis(all_, all_, 1, eps)
    fc_in = ev.cand.structure.get("fc_in_features")
    H = ev.config.hidden_size
    sizes = [fc_in // H] if fc_in and fc_in % H == 0 and fc_in // H < n else range(n - 1, 0, -1)
    for k in sizes:
        for subset in itertools.combinations(all_, k):
            yield ContextHypothesis(subset, subset)
            if subset != all_[:k]:
                yield ContextHypothesis(subset, all_[:k])


def predict_context(case: Case, h: ContextHypothesis, positions: torch.Tensor) -> torch.Tensor:
    """[1, len(positions), H] context of hypothesis h."""
    c, H = case.config, case.config.hidden_size
    hs = shifted(case.inputs["hidden_states"], h.shift)[:, positions].float()
    w = case.weights["fc.weight"].float()
    x = torch.cat([hs[..., i * H:(i + 1) * H] for i in h.slices], -1)
    cols = torch.cat([torch.arange(i * H, (i + 1) * H) for i in h.columns])
    x = x @ w[:, cols].T
    norm = RMSNorm(H, c.rms_norm_eps if h.eps is None else h.eps)
    with torch.no_grad():
        norm.weight.copy_(case.weights["hidden_norm.weight"])
        for _ in range(h.norms):
            x = norm(x)
    return x


def describe_context_hypothesis(case: Case, h: ContextHypothesis) -> str:
    """The named deviation of h from the reference's context formula."""
    c = case.config
    n, ids = c.num_target_layers, c.target_layer_ids
    if h.shift:
        return (f"hidden_states shifted {'left' if h.shift > 0 else 'right'} by {abs(h.shift)} "
                f"relative to loss_mask / position_ids: context position p reads "
                f"hidden_states[p{h.shift:+d}]")
    if h.eps is not None:
        return f"hidden_norm eps {h.eps:g}, not the verifier's rms_norm_eps"
    if h.norms == 0:
        return "hidden_norm missing: the context is fc(hidden_states) without its RMSNorm"
    if h.norms == 2:
        return "hidden_norm applied twice to the context"
    if len(h.slices) == n:
        return ("target layers concatenated in descending id order (reference: ascending "
                f"{list(ids)})")
    read = [ids[i] for i in h.slices]
    missed = [ids[i] for i in range(n) if i not in h.slices]
    cols = ("" if h.columns == h.slices else
            f"; the candidate kept fc.weight's first {len(h.columns)}*H columns")
    return (f"fc fed {len(h.slices)} of {n} target layers: it reads layers {read} "
            f"(hidden_states slices {list(h.slices)}) and misses {missed}{cols}")


def dropout_rate(cand: torch.Tensor, ref: torch.Tensor, tol: dict[str, float]) -> float | None:
    """The dropout probability p when ``cand`` is ``ref`` under inverted dropout (exact zeros
    where ``ref`` is not, every other value ``ref / (1 - p)`` within tolerance), else None.
    Needs at least 1 % zeroed values (fewer is no evidence)."""
    dropped = (cand == 0) & (ref != 0)
    kept = ~dropped & (ref != 0)
    if int(dropped.sum()) < max(2, 0.01 * ref.numel()) or not bool(kept.any()):
        return None
    scale = float((cand[kept].double() * ref[kept].double()).sum() / (ref[kept].double() ** 2
                                                                       ).sum())
    if scale <= 1.0 or not bool(closeness(cand[kept], ref[kept] * scale, **tol).ok):
        return None
    return 1.0 - 1.0 / scale


def diagnose_context(ev: Evidence, result: CheckResult) -> list[str]:
    """Search every context hypothesis (:func:`context_hypotheses`) for the candidate's context."""
    c = ev.cand.tensors["context"]
    if c.shape != ev.ref.tensors["context"].shape:
        return [f"context shape {list(c.shape)}, reference "
                f"{list(ev.ref.tensors['context'].shape)}"]
    positions = attended_positions(ev.case, ev.ref).nonzero().squeeze(-1)
    p = dropout_rate(c[:, positions], ev.ref.tensors["context"][:, positions], ev.tol)
    if p is not None:
        return [f"dropout on the context in training mode (p ~ {p:.2g}: that share of the "
                f"values is zero, the rest scaled by 1/(1-p)); the reference trains the drafter "
                "without dropout (e.g. a dropout probability read from the verifier config)"]
    found = search_hypotheses(ev, context_hypotheses(ev),
                              lambda h, p: predict_context(ev.case, h, p),
                              lambda p: c[:, p], [sample(positions), positions])
    return [describe_context_hypothesis(ev.case, h) for h in found]
