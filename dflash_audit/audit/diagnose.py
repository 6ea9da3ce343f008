"""Naming the cause of a failing check (DESIGN.md sec. 5 bug classes).

:func:`diagnose` fills ``CheckResult.diagnosis`` of every non-passing result with named causes,
most likely first. Causes are found by testing hypotheses with our own primitives on the
case's inputs and weights: a hypothesis is a family member (all target sources x norm counts
x shifts, all subsets of target layers, all context-rule offsets x windows x document rules,
position conventions, draft-layer slips (:mod:`dflash_audit.audit.architecture`), loss names
x normalisations, a gamma fitted from the weights) whose prediction is compared with what the
candidate returned, within the check's tolerance. Where several hypotheses reproduce a loss,
only those with the fewest deviations are named.
A hypothesis that reproduces the candidate names the cause; a difference no hypothesis
reproduces is reported as "unexplained difference" with its numbers.

Downstream checks name the upstream difference they follow from ("follows from the mask
difference"), verified where possible by replaying our drafter with the candidate's own
context / masks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from dflash_audit.audit.architecture import COMMON_NORM_EPS, architecture_hypotheses
from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.checks import (
    FAIL,
    PASS,
    as_bool_mask,
    attended_positions,
    closeness,
    supervised_rows,
    supervised_slots,
    tolerance,
)
from dflash_audit.audit.result import CheckResult
from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_audit.model.drafter import FROZEN_PARAMETERS, DFlashDrafter, block_indices
from dflash_audit.model.layers import RMSNorm, RotaryEmbedding
from dflash_audit.model.loss import LOSS_REDUCTION_EPS, LOSSES, LossSpec, parse_loss, slot_weights
from dflash_audit.model.mask import dense_mask
from dflash_audit.model.metrics import EAL_DEFINITIONS, dflash_metrics

#: A sliding window wider than any packed row: dense_mask then builds a causal block with no
#: window bound on the context.
NO_WINDOW = 1 << 62
#: A hypothesis search first compares on SEARCH_SAMPLE slots / positions (and SEARCH_VOCAB
#: vocabulary columns), then confirms a match on up to CONFIRM_SAMPLE slots, every column:
#: cheap on real verifiers (V = 49152) and still exact where it matters.
SEARCH_SAMPLE, SEARCH_VOCAB, CONFIRM_SAMPLE = 8, 256, 512
#: Which checks a check's values depend on.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "logits": ("structure", "context", "mask"),
    "loss": ("structure", "context", "mask", "targets", "logits"),
    "gradients": ("structure", "context", "mask", "targets", "logits", "loss"),
    "metrics": ("targets", "logits", "loss"),
}


@dataclass
class Evidence:
    """One case's inputs and both sides' outputs, with the derived quantities diagnoses share."""

    case: Case
    cand: SideOutputs
    ref: SideOutputs
    failing: set[str] = field(default_factory=set)

    @cached_property
    def tol(self) -> dict[str, float]:
        return tolerance(self.case)

    @cached_property
    def sup(self) -> torch.Tensor:  # [Q] bool
        return supervised_slots(self.case, self.ref)

    @cached_property
    def rows(self) -> torch.Tensor:  # [Q] bool
        return supervised_rows(self.case, self.ref)

    @property
    def config(self):
        return self.case.config

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return self.case.inputs

    @cached_property
    def block_idx(self) -> torch.Tensor:  # [Q] a_j + s
        return block_indices(self.inputs["anchor_positions"].long(), self.config.block_size)

    def close(self, cand: torch.Tensor, predicted: torch.Tensor,
              tol: dict[str, float] | None = None) -> bool:
        return cand.shape == predicted.shape and closeness(cand, predicted,
                                                           **(tol or self.tol)).ok


def sample(indices: torch.Tensor, k: int = SEARCH_SAMPLE) -> torch.Tensor:
    """Up to k evenly spread entries of a 1-D index tensor."""
    if indices.numel() <= k:
        return indices
    return indices[torch.linspace(0, indices.numel() - 1, k).round().long()]


def _names(items) -> str:
    return ", ".join(str(i) for i in items)


def _and(items) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def follows_from(check: str, ev: Evidence) -> str | None:
    """"follows from the X and Y difference" for the failing checks upstream of ``check``."""
    upstream = [u for u in UPSTREAM.get(check, ()) if u in ev.failing]
    return f"follows from the {_and(upstream)} difference" if upstream else None


# ------------------------------------------------------------------------------ targets
@dataclass(frozen=True)
class TargetHypothesis:
    """targets = verifier_lm_head(norm^k(source[a + s - shift])).

    source: None = verifier_last_hidden_states (layer N), i = target-layer slice i of
    hidden_states. norms: 0, 1, 2 applications of verifier_norm; flipped: the other gain
    convention (x*(1+w) vs x*w); eps: the norm's eps when not the verifier's."""

    source: int | None
    norms: int
    shift: int
    flipped: bool = False
    eps: float | None = None


def reference_shift(case: Case) -> int:
    """Slot s is taught by the verifier's prediction at a+s-1 (a+s with sample_from_anchor)."""
    return 0 if case.config.sample_from_anchor else 1


def target_hypotheses(case: Case) -> Iterator[TargetHypothesis]:
    """Every source (layer N, each target layer) x norm (once, none, twice, flipped gain)
    x shift (reference shift -2..+2), the reference formula first; then the reference
    formula with a commonly hard-coded norm eps."""
    k = reference_shift(case)
    sources = [None, *range(case.config.num_target_layers)]
    norms = [(1, False), (2, False), (0, False), (1, True)]
    for src, (n, flip), d in itertools.product(sources, norms, (0, -1, 1, -2, 2)):
        yield TargetHypothesis(src, n, k + d, flip)
    for eps in COMMON_NORM_EPS:
        if eps != case.config.rms_norm_eps:
            yield TargetHypothesis(None, 1, k, eps=eps)


def predict_targets(case: Case, h: TargetHypothesis, slots: torch.Tensor,
                    vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[1, len(slots), V_d] targets of hypothesis h on the given query slots (only the
    ``vocab`` columns when given)."""
    c, H = case.config, case.config.hidden_size
    if h.source is None:
        states = case.inputs["verifier_last_hidden_states"]
    else:
        states = case.inputs["hidden_states"][..., h.source * H:(h.source + 1) * H]
    T = states.shape[1]
    idx = block_indices(case.inputs["anchor_positions"].long(), c.block_size)[slots]
    x = states[:, (idx - h.shift) % T].float()
    norm = RMSNorm(H, c.rms_norm_eps if h.eps is None else h.eps,
                   one_plus_weight=c.verifier_norm_one_plus_weight ^ h.flipped)
    with torch.no_grad():
        norm.weight.copy_(case.weights["verifier_norm.weight"])
        for _ in range(h.norms):
            x = norm(x)
        head = case.weights["verifier_lm_head.weight"].float()
        return x @ (head if vocab is None else head[vocab]).T


def describe_target_hypothesis(case: Case, h: TargetHypothesis) -> list[str]:
    """The named deviations of h from the reference formula (empty for the reference)."""
    c = case.config
    N, out = c.num_verifier_layers, []
    if h.source is not None:
        L = c.target_layer_ids[h.source]
        out.append(f"targets from target layer {L} (hidden_states slice {h.source}), not the "
                   f"verifier's last layer N={N}: L = N-{N - L}, a proxy distribution "
                   f"{N - L} layer(s) short")
    if h.norms == 2:
        out.append("targets from post-norm states: the verifier's final norm is applied twice "
                   "(Hugging Face output_hidden_states[-1] is already normed)")
    elif h.norms == 0:
        out.append("targets without the verifier's final norm (pre-norm states fed to the "
                   "lm_head directly)")
    if h.flipped:
        conv = "x*w" if c.verifier_norm_one_plus_weight else "x*(1+w)"
        ref_conv = "x*(1+w)" if c.verifier_norm_one_plus_weight else "x*w"
        out.append(f"verifier_norm gain convention {conv} (reference {ref_conv} for "
                   f"{c.verifier_model_type!r})")
    if h.eps is not None:
        out.append(f"verifier_norm eps {h.eps:g}, not the verifier's rms_norm_eps")
    delta = h.shift - reference_shift(case)
    ref_pos = "a+s" if reference_shift(case) == 0 else "a+s-1"
    pos = f"a+s{-h.shift:+d}" if h.shift else "a+s"
    if delta == -1 and not c.sample_from_anchor:
        out.append(f"targets not shifted: slot s is taught by the verifier's prediction at {pos} "
                   f"instead of {ref_pos}")
    elif delta == 1 and not c.sample_from_anchor:
        out.append(f"targets shifted twice: slot s is taught by the prediction at {pos} instead "
                   f"of {ref_pos}")
    elif delta:
        out.append(f"targets offset by {-delta:+d} position(s): slot s taught by the prediction "
                   f"at {pos} instead of {ref_pos}" + (" (sample_from_anchor)" if
                                                        c.sample_from_anchor else ""))
    return out


def _search(ev: Evidence, hypotheses, predict: Callable[[Any, Any], torch.Tensor],
            observed: Callable[[Any], torch.Tensor], stages: list) -> list:
    """Hypotheses whose prediction ``predict(h, selection)`` matches ``observed(selection)``
    within tolerance at every stage (cheap selections first)."""
    return [h for h in hypotheses
            if all(ev.close(observed(sel), predict(h, sel)) for sel in stages)]


def vocab_sample(size: int, k: int = SEARCH_VOCAB) -> torch.Tensor | None:
    """k evenly spread vocabulary columns, or None (all) for a small vocabulary."""
    return None if size <= k else torch.linspace(0, size - 1, k).round().long()


def diagnose_vocab(ev: Evidence, key: str) -> list[str]:
    """A targets / logits tensor over the full vocabulary where the reference has V_d: which
    d2t reading restricts it to the reference's (offsets i + d2t[i], or absolute ids)."""
    c, r = ev.cand.tensors[key], ev.ref.tensors[key]
    V, Vd = ev.config.vocab_size, ev.config.effective_draft_vocab_size
    if c.shape[-1] != V or r.shape[-1] != Vd or "d2t" not in ev.case.weights:
        return [f"{key} over {c.shape[-1]} vocabulary entries, reference {r.shape[-1]} "
                f"(verifier vocab V={V}, draft vocab V_d={Vd})"]
    d2t = ev.case.weights["d2t"].long()
    readings = {"offsets (target id = i + d2t[i], the reference convention)":
                torch.arange(Vd) + d2t, "absolute ids (target id = d2t[i])": d2t.clamp(0, V - 1)}
    sup = ev.sup
    for label, ids in readings.items():
        if ev.close(c[:, sup][..., ids], r[:, sup]):
            if label.startswith("offsets"):
                return [f"{key} not reduced to the draft vocabulary: over all V={V} verifier ids; "
                        f"restricted with d2t as {label} they equal the reference's"]
            return [f"draft-vocab mapping: d2t read as {label}; the reference stores offsets "
                    "(target id = i + d2t[i])"]
    return [f"{key} over the full vocabulary V={V} where the reference uses the draft vocabulary "
            f"V_d={Vd}; no d2t reading reproduces the reference's values"]


def diagnose_targets(ev: Evidence, result: CheckResult) -> list[str]:
    """Search every (source, norm, shift) formula for the candidate's targets."""
    c = ev.cand.tensors["targets"]
    if c.shape != ev.ref.tensors["targets"].shape:
        return diagnose_vocab(ev, "targets")
    slots = ev.sup.nonzero().squeeze(-1)
    stages = [(sample(slots), vocab_sample(c.shape[-1])), (sample(slots, CONFIRM_SAMPLE), None)]
    found = _search(ev, target_hypotheses(ev.case),
                    lambda h, sel: predict_targets(ev.case, h, *sel),
                    lambda sel: c[:, sel[0]] if sel[1] is None else c[:, sel[0]][..., sel[1]],
                    stages)
    causes = [d for h in found for d in describe_target_hypothesis(ev.case, h)]
    return list(dict.fromkeys(causes))


# ------------------------------------------------------------------------------ context
@dataclass(frozen=True)
class ContextHypothesis:
    """context = hidden_norm^norms(hidden_states[slices] @ fc.weight[:, columns]^T)."""

    slices: tuple[int, ...]  # target-layer slices read, in order
    columns: tuple[int, ...]  # fc.weight column blocks used (in H units)
    norms: int = 1
    eps: float | None = None  # hidden_norm's eps when not the verifier's


def context_hypotheses(ev: Evidence) -> Iterator[ContextHypothesis]:
    """All subsets of the n target layers (of the candidate's fc width when reported) with the
    matching or the leading fc.weight columns; no / double hidden_norm; descending layer order;
    a commonly hard-coded eps."""
    n = ev.config.num_target_layers
    all_ = tuple(range(n))
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
    hs = case.inputs["hidden_states"][:, positions].float()
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
    c = case.config
    n, ids = c.num_target_layers, c.target_layer_ids
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


def diagnose_context(ev: Evidence, result: CheckResult) -> list[str]:
    c = ev.cand.tensors["context"]
    if c.shape != ev.ref.tensors["context"].shape:
        return [f"context shape {list(c.shape)}, reference {list(ev.ref.tensors['context'].shape)}"]
    positions = attended_positions(ev.case, ev.ref).nonzero().squeeze(-1)
    found = _search(ev, context_hypotheses(ev), lambda h, p: predict_context(ev.case, h, p),
                    lambda p: c[:, p], [sample(positions), positions])
    return [describe_context_hypothesis(ev.case, h) for h in found]


# --------------------------------------------------------------------------------- mask
@dataclass(frozen=True)
class MaskHypothesis:
    """Context part: kv < anchor + offset, window bound W (None: none), documents respected or
    not. Block part: causal or bidirectional."""

    offset: int = 0
    window: int | None = None
    documents: bool = True
    causal_block: bool = False


def expected_mask_hypothesis(case: Case, layer_type: str) -> MaskHypothesis:
    c = case.config
    sliding = layer_type == SLIDING_ATTENTION
    return MaskHypothesis(0, c.sliding_window if sliding else None, True,
                          sliding and not c.sliding_window_non_causal)


def build_mask(case: Case, h: MaskHypothesis) -> torch.Tensor:
    """[Q, T+Q] bool mask of hypothesis h, from :func:`dense_mask` with edited inputs/columns:
    the context part from the window (and documents) of h, the block part from its block rule."""
    B = case.config.block_size
    doc = case.inputs["document_ids"].reshape(-1)
    T = doc.numel()
    a = case.inputs["anchor_positions"].long()
    docs = doc if h.documents else torch.where(doc != -1, 0, -1)
    base = dense_mask(docs, a, B, h.window)[:, :T]
    block = dense_mask(docs, a, B, NO_WINDOW if h.causal_block else None)[:, T:]
    q = torch.arange(base.shape[0])
    qa = a.repeat_interleave(B)
    if h.offset == 1:  # kv <= anchor
        base[q, qa] |= docs[qa] != -1
    elif h.offset == -1:  # kv < anchor - 1
        keep = qa >= 1
        base[q[keep], qa[keep] - 1] = False
    return torch.cat([base, block], 1)


def mask_hypotheses(case: Case, layer_type: str) -> Iterator[MaskHypothesis]:
    """Block rule (causal / bidirectional) x context offset (<, <=, < a-1) x window (expected,
    none, W-1, W+1, W) x documents (respected, ignored)."""
    exp = expected_mask_hypothesis(case, layer_type)
    W = case.config.sliding_window
    windows = list(dict.fromkeys([exp.window, None] + ([W, W - 1, W + 1] if W else [])))
    windows = [w for w in windows if w is None or w >= 0]
    for causal, offset, window, docs in itertools.product(
            (exp.causal_block, not exp.causal_block), (0, 1, -1), windows, (True, False)):
        yield MaskHypothesis(offset, window, docs, causal)


def describe_mask_hypothesis(case: Case, layer_type: str, h: MaskHypothesis) -> list[str]:
    exp = expected_mask_hypothesis(case, layer_type)
    out = []
    if h.causal_block != exp.causal_block:
        if h.causal_block:
            why = ("full-attention layer" if layer_type == FULL_ATTENTION else
                   "sliding layer with sliding_window_non_causal=True")
            out.append(f"causal attention inside the block in a {why} (reference: "
                       "bidirectional block)")
        else:
            out.append("bidirectional attention inside the block in a sliding layer (reference: "
                       "causal, sliding_window_non_causal=False)")
    if h.offset == 1:
        out.append("context rule kv <= anchor (reference: kv < anchor): queries also see the "
                   "context at their own anchor position")
    elif h.offset == -1:
        out.append("context rule kv < anchor - 1 (reference: kv < anchor): the position just "
                   "before the anchor is hidden")
    if h.window != exp.window:
        if h.window is None:
            out.append(f"sliding window missing (reference: kv >= anchor - {exp.window})")
        elif exp.window is None:
            out.append(f"a sliding window W={h.window} applied in a full-attention layer")
        else:
            out.append(f"window bound off by {h.window - exp.window:+d}: kv >= anchor - "
                       f"{h.window} (reference W={exp.window})")
    if not h.documents:
        out.append("cross-document leakage: queries see context of other packed documents "
                   "(document_ids not applied)")
    return out


def diagnose_mask(ev: Evidence, result: CheckResult) -> list[str]:
    layer_type = result.details.get("layer_type")
    key = f"mask.{layer_type}"
    if key not in ev.cand.tensors or key not in ev.ref.tensors:
        return []
    c = as_bool_mask(ev.cand.tensors[key])
    if c.shape != as_bool_mask(ev.ref.tensors[key]).shape:
        return [f"mask shape {list(c.shape)} (Q x T+Q expected {list(ev.ref.tensors[key].shape)})"]
    rows = ev.rows
    expected = expected_mask_hypothesis(ev.case, layer_type)
    for h in mask_hypotheses(ev.case, layer_type):
        if h != expected and torch.equal(build_mask(ev.case, h)[rows], c[rows]):
            return describe_mask_hypothesis(ev.case, layer_type, h)
    return []


# ------------------------------------------------------------------------------- replay
def drafter_with_weights(config, weights: dict[str, torch.Tensor]) -> DFlashDrafter:
    """Our drafter holding the case's weights (shared, not copied: forward-only use), built
    on the meta device so a real vocabulary costs no random initialisation."""
    with torch.device("meta"):
        model = DFlashDrafter(config)
    model.load_state_dict(weights, strict=True, assign=True)
    model.rotary_emb = RotaryEmbedding(config)  # its inv_freq buffer is not in the state dict
    return model


class SlotHead(torch.nn.Module):
    """An lm_head applied to some query slots only: [1,Q,H] -> [1,len(slots),V_d]."""

    def __init__(self, head: torch.nn.Module, slots: torch.Tensor):
        super().__init__()
        self.head, self.slots = head, slots

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h[:, self.slots])


def replay(case: Case, *, config=None, weights: dict | None = None, inputs: dict | None = None,
           context: torch.Tensor | None = None, masks: dict | None = None,
           positions: Callable[[torch.Tensor], torch.Tensor] | None = None,
           inv_freq: torch.Tensor | None = None,
           edit: Callable[[DFlashDrafter], None] | None = None,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """Our drafter's logits on the case, with parts replaced by a hypothesis: another config,
    rearranged weights, edited inputs, a given context [1,T,H], given masks {layer type:
    [Q,T+Q]}, a transform of the [1, T+Q] position ids fed to RoPE, RoPE inverse frequencies,
    or an ``edit`` of the built drafter's modules (:mod:`dflash_audit.audit.architecture`).

    Returns [1, Q, V_d], or [1, len(slots), V_d] with ``slots`` (the lm_head and the targets,
    the costly parts on a real vocabulary, then run on those slots only / not at all)."""
    model = drafter_with_weights(config or case.config, weights or case.weights)
    if edit is not None:
        edit(model)
    if slots is not None:
        model.lm_head = SlotHead(model.lm_head, slots)
        model.targets = lambda states, indices: None
    if inv_freq is not None:
        model.rotary_emb.inv_freq = inv_freq
    if context is not None:
        model.context = lambda hidden_states: context
    if masks is not None:
        own = model.attention_masks
        model.attention_masks = lambda d, a: {**own(d, a), **masks}
    if positions is not None:
        rope = model.rotary_emb.forward
        model.rotary_emb.forward = lambda pos, dtype: rope(positions(pos), dtype)
    with torch.no_grad():
        out = model(**{**case.inputs, **(inputs or {})})
    return out.logits


def position_hypotheses(ev: Evidence) -> Iterator[tuple[str, Callable]]:
    """Mixed position conventions (a uniform shift of all positions cannot change RoPE
    attention, so only conventions that differ between context and noise are visible)."""
    T = ev.inputs["position_ids"].shape[-1]
    absolute_noise = ev.block_idx[None]
    context = {"restart per document": None,
               "not restarting per document (0..T-1)": lambda p: torch.arange(T)[None],
               "1-indexed": lambda p: p + 1,
               "not rotated (RoPE applied to the noise block only)": torch.zeros_like}
    noise = {"position_ids[a]+s": None, "a+s (packed position, not restarting per document)":
             lambda p: absolute_noise, "position_ids[a]+s+1 (1-indexed slots)": lambda p: p + 1,
             "position_ids[a]+s-1": lambda p: p - 1}
    for (cl, cf), (nl, nf) in itertools.product(context.items(), noise.items()):
        if cf is None and nf is None:
            continue

        def transform(pos, cf=cf, nf=nf):
            ctx, nz = pos[:, :T], pos[:, T:]
            return torch.cat([cf(ctx) if cf else ctx, nf(nz) if nf else nz], 1)

        yield (f"position ids: context {cl}, noise block {nl} (reference: context restarts at 0 "
               f"per document, slot s of anchor a at position_ids[a]+s)", transform)


def logit_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """Counterfactual replays of our drafter: positions, noise-block tokens, mask_token_id, RoPE
    partial factor, (when the candidate returned no masks) mask variants, then the draft
    layers' internals (:func:`dflash_audit.audit.architecture.architecture_hypotheses`)."""
    c, inputs = ev.config, ev.inputs
    for label, transform in position_hypotheses(ev):
        yield label, {"positions": transform}
    anchors = inputs["anchor_positions"].long()
    ids = inputs["input_ids"].clone()
    ids[0, anchors] = c.mask_token_id
    yield ("noise block slot 0 holds mask_token_id instead of the anchor token "
           "input_ids[a]"), {"inputs": {"input_ids": ids}}
    for d in (1, -1):
        yield (f"noise block slot 0 holds input_ids[a{d:+d}] instead of input_ids[a]",
               {"inputs": {"input_ids": torch.roll(inputs["input_ids"], -d, 1)}})
    others = {"pad_token_id": c.pad_token_id, **{k: v for k, v in c.extra.items()
                                                 if k in ("eos_token_id", "bos_token_id")},
              "the candidate's reported mask_token_id": ev.cand.structure.get("mask_token_id"),
              "token id 0": 0}
    for label, tok in others.items():
        if isinstance(tok, int) and tok != c.mask_token_id and 0 <= tok < c.vocab_size:
            yield (f"mask_token_id falls back to {label} ({tok}); the profile's is "
                   f"{c.mask_token_id}"), {"config": c.replace(mask_token_id=tok)}
    yield from rope_hypotheses(ev)
    if not any(k.startswith("mask.") for k in ev.cand.tensors):
        yield from mask_replay_hypotheses(ev)
    yield from architecture_hypotheses(c, ev.case.weights, inputs["input_ids"].shape[-1])


def rotary_inv_freq(config, rotary_dim: int) -> torch.Tensor:
    """Default RoPE inverse frequencies over the first ``rotary_dim`` head dimensions."""
    return 1.0 / (config.rope_theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))


def rope_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """The profile's ``partial_rotary_factor`` honoured where our drafter (like the reference's
    Qwen3 draft layers) does not, or ignored where it is honoured."""
    c = ev.config
    factor = (c.rope_parameters or {}).get("partial_rotary_factor")
    if factor is None or (c.rope_parameters or {}).get("rope_type", "default") != "default":
        return
    ours = RotaryEmbedding(c).inv_freq.numel() * 2
    partial = int(c.head_dim * factor) // 2 * 2
    if ours == c.head_dim and partial < c.head_dim:
        yield (f"RoPE partial_rotary_factor {factor} applied: {partial} of {c.head_dim} head "
               "dimensions rotated, where the reference's draft layers ignore the factor and "
               "rotate all of them"), {"inv_freq": rotary_inv_freq(c, partial)}
    elif ours < c.head_dim:
        yield (f"RoPE partial_rotary_factor {factor} ignored: all {c.head_dim} head dimensions "
               f"rotated, the reference rotates {ours}"),\
            {"inv_freq": rotary_inv_freq(c, c.head_dim)}


def mask_replay_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict]]:
    """Single deviations from each layer type's expected mask (context offset, documents
    ignored, block rule flipped, window none / W-1 / W+1), applied to every layer type at once
    and, with several layer types, to each alone."""
    types = list(dict.fromkeys(ev.config.effective_layer_types))
    W = ev.config.sliding_window
    deviations = [{"offset": 1}, {"offset": -1}, {"documents": False}, {"causal_block": None},
                  {"window": None}] + ([{"window": W - 1}, {"window": W + 1}] if W else [])
    scopes = [types] + ([[t] for t in types] if len(types) > 1 else [])
    for change, scope in itertools.product(deviations, scopes):
        masks, labels = {}, []
        for layer_type in scope:
            exp = expected_mask_hypothesis(ev.case, layer_type)
            kw = {"causal_block": not exp.causal_block} if "causal_block" in change else change
            h = dataclasses.replace(exp, **kw)
            if h == exp:
                continue
            masks[layer_type] = build_mask(ev.case, h)
            labels += describe_mask_hypothesis(ev.case, layer_type, h)
        if masks:
            yield f"{_and(list(masks))} mask: {'; '.join(dict.fromkeys(labels))}", {"masks": masks}


def diagnose_logits(ev: Evidence, result: CheckResult) -> list[str]:
    c = ev.cand.tensors["logits"]
    if c.shape != ev.ref.tensors["logits"].shape:
        return diagnose_vocab(ev, "logits")
    sup = ev.sup
    upstream = [u for u in ("context", "mask") if u in ev.failing]
    given = {}
    if "context" in upstream and "context" in ev.cand.tensors:
        given["context"] = ev.cand.tensors["context"]
    if "mask" in upstream:
        masks = {k.split(".", 1)[1]: as_bool_mask(v) for k, v in ev.cand.tensors.items()
                 if k.startswith("mask.")}
        if masks:
            given["masks"] = masks
    slots = sup.nonzero().squeeze(-1)
    stages = [sample(slots), sample(slots, CONFIRM_SAMPLE)]

    def matches(kw: dict) -> bool:
        return all(ev.close(c[:, s], replay(ev.case, slots=s, **kw)) for s in stages)

    parts = " and ".join(given)
    if given and matches(given):
        return [f"follows from the {_and(upstream)} difference: our drafter fed the "
                f"candidate's own {parts} reproduces the candidate's logits"]
    found = [label for label, kw in logit_hypotheses(ev) if matches(kw)]
    if found:
        return found
    if given:  # the upstream difference is real but does not account for the logits
        return [unexplained(result), f"not only the {_and(upstream)} difference: our drafter "
                f"fed the candidate's own {parts} does not reproduce the candidate's logits, "
                "so its draft layers differ as well"]
    upstream = follows_from("logits", ev)
    return [upstream] if upstream else []


# --------------------------------------------------------------------------------- loss
def aligned_mask_hypotheses(ev: Evidence) -> Iterator[tuple[str, torch.Tensor]]:
    """loss_mask[a+s+d] (d = -1, 0, 1) x slot 0 (zeroed / kept) x anchor_valid (applied /
    ignored), as [Q] bool."""
    B, T = ev.config.block_size, ev.inputs["loss_mask"].shape[-1]
    valid = ev.inputs["anchor_valid"].bool().repeat_interleave(B)
    slot0 = torch.arange(ev.block_idx.numel()) % B == 0
    zero0 = not ev.config.sample_from_anchor
    for d, keep0, use_valid in itertools.product((0, 1, -1), (not zero0, zero0), (True, False)):
        m = ev.inputs["loss_mask"][0, (ev.block_idx + d) % T].bool()
        if use_valid:
            m = m & valid
        if not keep0:
            m = m & ~slot0
        causes = []
        if keep0 and zero0:
            causes.append("slot 0 (the anchor itself) not masked out of the loss")
        if not keep0 and not zero0:
            causes.append("slot 0 masked out although sample_from_anchor trains it")
        if not use_valid:
            causes.append("padding anchors (anchor_valid False) not masked out of the loss")
        if d:
            causes.append(f"loss mask misaligned: loss_mask[a+s{d:+d}] instead of loss_mask[a+s]")
        if causes:
            yield "; ".join(causes), m


def diagnose_weights(ev: Evidence, part: dict[str, Any]) -> list[str]:
    """Name a per-slot weight difference from the fitted decay of the candidate's weights."""
    spec = ev.case.loss
    fit = part.get("candidate_fit")
    if not fit:
        return []
    if spec.weighting == "fixed-exp-decay" and not fit["constant_per_slot"]:
        return ["per-slot weights vary between blocks (D-PACE-like) where the profile says "
                "fixed-exp-decay"]
    if spec.weighting == "dpace":
        return (["fixed per-slot weights where the profile says D-PACE"]
                if fit["constant_per_slot"] else [])
    out = []
    s0_ref = 0.0 if ev.config.sample_from_anchor else 1.0
    w0 = fit.get("w0")
    if not ev.config.sample_from_anchor and w0 is not None and w0 > 0:
        out.append(f"slot 0 weighted (w_0 = {w0:.3g}; reference 0): the anchor slot is not "
                   "masked out of the loss")
    g, s0 = fit.get("gamma"), fit.get("offset")
    if g is None:
        return out
    if abs(g - spec.gamma) > 1e-3 * spec.gamma:
        out.append(f"decay gamma {g:.4g} (fitted from the weights: w_(s+1)/w_s = exp(-1/gamma)), "
                   f"reference {spec.gamma:g}")
    if abs(s0 - s0_ref) > 1e-3:
        if abs(s0 - (s0_ref - 1)) <= 1e-3:
            out.append(f"decay formula exp(-s/gamma) instead of exp(-(s-{s0_ref:g})/gamma)"
                       if s0_ref else "decay formula exp(-(s+1)/gamma)")
        elif abs(s0 - (s0_ref + 1)) <= 1e-3:
            out.append(f"decay formula exp(-(s-{s0_ref + 1:g})/gamma) instead of "
                       f"exp(-(s-{s0_ref:g})/gamma)")
        else:
            scale = math.exp((s0 - s0_ref) / g)
            out.append(f"per-slot weights scaled by {scale:.4g} (e.g. normalised per block)")
    return out


def loss_formula_hypotheses(ev: Evidence) -> Iterator[tuple[str, dict[str, float], str]]:
    """(label, loss mix, denominator) for every single loss and the profile's mix, under the
    token-count (reference), weight-sum and all-slot denominators; the reference first."""
    profile = parse_loss(ev.case.loss.loss)
    mixes = [("profile", profile)] + [(n, {n: 1.0}) for n in LOSSES if {n: 1.0} != profile]
    for (name, mix), denom in itertools.product(mixes, ("tokens", "weights", "slots")):
        yield name, mix, denom


def recompute_loss(ev: Evidence, mix: dict[str, float], denom: str,
                   cache: dict[str, torch.Tensor] | None = None) -> float | None:
    """The loss of the candidate's own logits / targets / aligned mask / weights under a mix
    and a denominator (tokens: sum(m) + 1e-5; weights: sum(m*w); slots: Q). ``cache`` keeps
    each divergence's elementwise values [1,Q] between calls."""
    t = ev.cand.tensors
    if "logits" not in t or "targets" not in t or t["logits"].shape != t["targets"].shape:
        return None
    cache = {} if cache is None else cache
    m = t.get("aligned_loss_mask", ev.ref.tensors.get("aligned_loss_mask")).reshape(1, -1).float()
    B, spec = ev.config.block_size, ev.case.loss
    total = 0.0
    own_weights = [v for k, v in t.items() if k.startswith("loss_weights.")]
    for name, coef in mix.items():
        if name not in cache:
            cache[name] = LOSSES[name](t["logits"], t["targets"]) * m
        el = cache[name]
        if f"loss_weights.{name}" in t:
            w = t[f"loss_weights.{name}"].reshape(1, -1)
        elif own_weights and spec.weighting == "fixed-exp-decay":
            w = own_weights[0].reshape(1, -1)
        else:
            w = slot_weights(LossSpec(name, spec.weighting, spec.gamma, spec.dpace_alpha), el, m,
                             B, ev.config.sample_from_anchor)
        d = {"tokens": m.sum() + LOSS_REDUCTION_EPS, "weights": (m * w).sum() + LOSS_REDUCTION_EPS,
             "slots": torch.tensor(float(m.numel()))}[denom]
        total += coef * float((el * w).sum() / d)
    return total


def diagnose_loss_total(ev: Evidence) -> list[str]:
    cl = float(ev.cand.tensors["loss"])
    tol = ev.tol
    found, cache = [], {}
    for name, mix, denom in loss_formula_hypotheses(ev):
        value = recompute_loss(ev, mix, denom, cache)
        if value is None:
            return []
        if abs(value - cl) <= tol["atol"] + tol["rtol"] * abs(cl):
            if name == "profile" and denom == "tokens":
                upstream = follows_from("loss", ev)
                why = f"; the difference {upstream}" if upstream else ""
                return ["the candidate's loss formula conforms (the reference's formula on "
                        "the candidate's own logits, targets, mask and weights reproduces its "
                        "loss)" + why]
            causes = []
            if name != "profile":
                hard = name == "ce" and "ce" not in parse_loss(ev.case.loss.loss)
                causes.append(f"loss computed as {name!r} where the profile says "
                              f"{ev.case.loss.loss!r}" + (" (hard-label CE instead of soft "
                                                         "divergence)" if hard else ""))
            if denom == "weights":
                causes.append("loss normalised by the sum of weights instead of the number of "
                              "supervised tokens")
            elif denom == "slots":
                causes.append("loss averaged over all Q slots instead of the supervised tokens")
            found.append(causes)
    # the fewest deviations that reproduce the loss: two losses can agree numerically on a
    # case (rkl ~ kl_div near uniform targets), a second deviation is then not evidence
    fewest = min(map(len, found), default=0)
    return ["; ".join(causes) for causes in found if len(causes) == fewest]


def diagnose_loss(ev: Evidence, result: CheckResult) -> list[str]:
    parts = result.details.get("parts", {})
    causes: list[str] = []
    if parts.get("aligned_loss_mask", {}).get("status") == FAIL:
        c = ev.cand.tensors["aligned_loss_mask"].reshape(-1).bool()
        causes += [label for label, m in aligned_mask_hypotheses(ev) if torch.equal(m, c)][:1]
    for key, part in parts.items():
        if key.startswith("loss_weights.") and part.get("status") == FAIL:
            causes += diagnose_weights(ev, part)
    if parts.get("total", {}).get("status") == FAIL:
        total = diagnose_loss_total(ev)
        if causes and total and total[0].startswith("the candidate's loss formula conforms"):
            total = []  # the named weight / mask cause already explains the total
        causes += total
    return list(dict.fromkeys(causes))


# ---------------------------------------------------------------------------- gradients
def diagnose_gradients(ev: Evidence, result: CheckResult) -> list[str]:
    params = result.details.get("parameters", {})
    frozen = [n for n, p in params.items() if p.get("reason") == "frozen in the reference"]
    causes = []
    if frozen:
        causes.append(f"frozen weights being trained: {_names(frozen)} receive gradients on the "
                      f"candidate side (the reference freezes {_names(FROZEN_PARAMETERS)})")
    cg = {k[5:]: v for k, v in ev.cand.tensors.items() if k.startswith("grad.")}
    no_grad = [n for n, p in params.items() if n not in frozen and p["status"] == FAIL and (
        n not in cg or not cg[n].abs().max() > 0)]
    if no_grad:
        causes.append(f"no gradient reaches {_names(no_grad)} on the candidate side (detached or "
                      "frozen; the reference trains them)")
    upstream = follows_from("gradients", ev)
    rest = [n for n in result.details.get("failing", []) if n not in frozen + no_grad]
    if rest and upstream:
        causes.append(upstream)
    return causes


# ---------------------------------------------------------------------------- structure
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
    ref = list(ev.config.target_layer_ids)
    N = ev.config.num_verifier_layers
    if len(ids) == len(ref):
        if [i + 1 for i in ids] == ref:
            return ("target layer ids in the z-lab convention (offset by one: z-lab id k = "
                    f"speculators id k+1): {ids} instead of {ref}")
        if [i - 1 for i in ids] == ref:
            return (f"target layer ids offset by +1 ({ids} instead of {ref}): speculators ids "
                    "converted as if they were z-lab ids")
        if any(i < 0 for i in ids):
            for base, label in ((N, "N+id"), (N + 1, "N+1+id")):
                if [i + base if i < 0 else i for i in ids] == ref:
                    return (f"negative target layer ids {ids} wrap python-style ({label}); the "
                            f"reference needs explicit ids {ref}")
            return f"negative target layer ids {ids} (reference {ref})"
    return f"target layer ids {ids} differ from the reference's {ref}"


def diagnose_structure_finding(ev: Evidence, f: dict[str, Any]) -> list[str] | str | None:
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


def diagnose_structure(ev: Evidence, result: CheckResult) -> list[str]:
    causes: list[str] = []
    for f in result.details.get("findings", []):
        if f["status"] == FAIL:
            found = diagnose_structure_finding(ev, f) or [f["reason"]]  # the field is the cause
            causes += [found] if isinstance(found, str) else found
    return list(dict.fromkeys(causes))


# ------------------------------------------------------------------------ defaults, metrics
def diagnose_defaults(ev: Evidence, result: CheckResult) -> list[str]:
    out = []
    for name, v in result.details.get("fields", {}).items():
        c, r = v["candidate_default"], v["reference_default"]
        if c is not None and r is not None and str(c).split()[0] != str(r).split()[0]:
            out.append(f"the candidate's default {name} {c!r} differs from the reference's "
                       f"{r!r}: a run without an explicit profile would train differently")
    return out


def diagnose_metrics(ev: Evidence, result: CheckResult) -> list[str]:
    eal = result.details.get("eal", {})
    out = []
    cd, rd = eal.get("candidate_definition") or [], eal.get("reference_definition") or []
    if cd and rd and not set(cd) & set(rd):
        out.append(f"acceptance-length definitions differ: the candidate's EAL is {cd[0]!r} "
                   f"({EAL_DEFINITIONS[cd[0]]}), the reference's {rd[0]!r} "
                   f"({EAL_DEFINITIONS[rd[0]]}); the reference changed definitions between "
                   "versions (0.9.0: leading-run, main@c05b95b: product-of-marginals)")
    t = ev.cand.tensors
    if {"logits", "targets", "aligned_loss_mask"} <= set(t):
        own = dflash_metrics(t["logits"], t["targets"], t["aligned_loss_mask"],
                             ev.config.block_size, ev.config.sample_from_anchor)
        odd = [k for k in result.details.get("differences", {})
               if k in own and k in ev.cand.metrics and abs(own[k] - ev.cand.metrics[k]) > 1e-6]
        if odd:
            out.append(f"the candidate computes {_names(odd)} differently: the reference's "
                       f"definition on its own logits gives "
                       + ", ".join(f"{k}={own[k]:g} (reported {ev.cand.metrics[k]:g})"
                                   for k in odd[:3]))
    upstream = follows_from("metrics", ev)
    if upstream and result.details.get("differences"):
        out.append(f"metric values {upstream.replace('follows', 'follow')}")
    return out


# ------------------------------------------------------------------------------- driver
DIAGNOSERS: dict[str, Callable[[Evidence, CheckResult], list[str]]] = {
    "structure": diagnose_structure, "defaults": diagnose_defaults, "mask": diagnose_mask,
    "context": diagnose_context, "targets": diagnose_targets, "logits": diagnose_logits,
    "loss": diagnose_loss, "gradients": diagnose_gradients, "metrics": diagnose_metrics,
    "anchors": lambda ev, result: result.details.get("causes", []),  # named by the check
}


def unexplained(result: CheckResult) -> str:
    """The fallback cause, with the numbers."""
    nums = []
    if result.max_abs_diff is not None:
        nums.append(f"max abs {result.max_abs_diff:.3g}")
    if result.max_rel_diff is not None:
        nums.append(f"max rel {result.max_rel_diff:.3g}")
    if result.first_diff:
        nums.append("first at " + ", ".join(f"{k} {v}" for k, v in result.first_diff.items()))
    return (f"unexplained difference in {result.name}: no tested hypothesis reproduces the "
            f"candidate ({'; '.join(nums) or result.summary})")


def diagnose(case: Case, cand: SideOutputs, ref: SideOutputs,
             results: list[CheckResult]) -> None:
    """Fill ``diagnosis`` of every failing or warning result of one case (in place).

    Results marked "not provided" get none. A diagnoser that raises records that it could not
    run instead of hiding the result."""
    ev = Evidence(case, cand, ref, {r.name for r in results if r.status == FAIL})
    for result in results:
        if result.status == PASS or result.summary.startswith("not provided"):
            continue
        try:
            causes = DIAGNOSERS.get(result.name, lambda e, r: [])(ev, result)
        except Exception as err:  # noqa: BLE001 - a diagnosis must not hide the finding
            causes = [f"diagnosis could not run: {type(err).__name__}: {err}"]
        if not causes and result.status == FAIL:
            causes = [unexplained(result)]
        result.diagnosis = causes
