"""The ``mask`` check: each layer type's [Q, T+Q] bool attention mask, one result per layer
type, by exact equality on the rows of blocks with a supervised slot (other rows feed no
trained logit). Fully masked query rows (no key visible; :mod:`dflash_audit.audit.masked_rows`)
are named wherever they are: a fail in trained blocks or where the candidate's NaN from them
reaches the loss or the gradients (an eager softmax over them), a warning where only its logits
there are NaN, a note on a pass where its outputs stay finite.

Hypotheses (the expected mask rebuilt with one rule changed, via ``dense_mask``) name: causal
attention inside the block where the reference is bidirectional (or the reverse), noise tokens
of other blocks visible (a causal mask over all Q noise positions, or no block rule), the
context rule kv <= anchor, kv < anchor - 1 or any other offset kv < anchor + k fitted from the
candidate's mask (k >= 2: the block's own verifier states leak, as in SpecForge issue 470), the
sliding window missing, applied in a full-attention layer, off by one or measured from the
query's own position (``kv >= a + s - W + 1``, the inference-time rule of SpecForge / ModelOpt /
z-lab), cross-document leakage (document_ids not applied), and context visibility keyed by block
index instead of the anchor's position (block j sees the positions of blocks 0..j-1, as in
SpecForge issue 470, or kv < j * block_size); every combination of them, so two at once are
named together. The fewest deviations that reproduce the candidate are named; where several
equally few do, all of them, as one cause the case cannot tell apart.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.compare_tensors import not_provided
from dflash_audit.audit.masked_rows import fully_masked_rows
from dflash_audit.audit.replay.mask_fit import fitted_context_offset, fitted_windows
from dflash_audit.audit.replay.evidence import Evidence
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.audit.slots import (
    as_bool_mask,
    mask_coordinates,
    reference_masks,
    supervised_rows,
)
from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_audit.model.mask import dense_mask

#: The class of :attr:`MaskHypothesis.context_key` other than "anchor" (its variants follow).
KEYED_BY_BLOCK = ("context visibility keyed by block index, not by the anchor's position "
                  "(reference: kv < a_j)")
#: A sliding window wider than any packed row: dense_mask then builds a causal block with no
#: window bound on the context.
NO_WINDOW = 1 << 62


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
        return not_provided(name, case, f"{layer_type} mask", side="reference", details=details)
    if key not in cand.tensors:
        return not_provided(name, case, f"{layer_type} mask", details=details)
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
    hollow = fully_masked_rows(case, cand, ref, [layer_type])
    if hollow is not None:
        details["fully_masked_rows"] = {
            "rows": int(hollow.rows.sum()), "padding_blocks": hollow.padding_blocks,
            "idle_blocks": hollow.idle_blocks, "trained_blocks": hollow.trained_blocks,
            "nan_rows": hollow.nan_rows, "reaches": hollow.reaches}
    if not trained.any():
        if hollow is not None and hollow.changes_training:  # NaN from untrained rows
            return CheckResult(name, case.name, FAIL, f"{layer_type} mask: {hollow.describe()}",
                               details=details)
        note = (f" ({int(differ.sum())} entries differ on blocks without supervised slots, "
                "which cannot change training)") if differ.any() else ""
        if hollow is not None:
            note = f"; {hollow.describe()}"
        return CheckResult(name, case.name, WARN if hollow is not None and hollow.nan_rows
                           else PASS,
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


@dataclass(frozen=True)
class MaskHypothesis:
    """Context part: kv < anchor + offset, window bound W (None: none) measured from the
    anchor (``kv >= a - W`` for every slot, the reference) or from the query's own position
    (``per_query``: ``kv >= a + s - W + 1``, i.e. ``a + s - kv < W``, the inference-time rule of
    SpecForge ``create_dflash_sdpa_mask``, ModelOpt ``_build_draft_attention_mask`` and z-lab
    ``_attention_mask``), documents respected or not. Block part: causal or bidirectional, over
    the query's own block (``blocks="own"``), its own and every earlier block (``"earlier"``)
    or all blocks (``"all"``). ``context_key``: what decides which context a block sees: its
    anchor's position (``"anchor"``, the reference: kv < a_j), or its index j among the
    anchors: the positions a_k..a_k+B-1 of the earlier valid blocks k < j (``"earlier_blocks"``:
    SpecForge before PR 473, issue 470) or kv < j * B (``"block_index"``: the rule of uniformly
    divided blocks); ``offset`` applies to ``"anchor"`` only."""

    offset: int = 0
    window: int | None = None
    documents: bool = True
    causal_block: bool = False
    blocks: str = "own"
    per_query: bool = False
    #: with ``per_query``: the window also bounds the block's own keys (slot s sees slot j
    #: only when s - j < W), as z-lab 0.1.0 ``_attention_mask`` applies query_pos - key_pos <
    #: W to every key; it differs from the context-only rule only when W < block_size
    window_in_block: bool = False
    context_key: str = "anchor"
    #: without ``documents``: padding positions (document -1) visible as well
    padding_visible: bool = False


def expected_mask_hypothesis(case: Case, layer_type: str) -> MaskHypothesis:
    """The reference's mask rule for one layer type (the hypothesis with no deviation)."""
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
    qa = a.repeat_interleave(B)[:, None]  # [Q, 1]
    kv = torch.arange(T)[None, :]  # [1, T]
    if h.per_query and h.window is not None:  # a + s - kv < W, s the query's slot
        s = (torch.arange(qa.shape[0]) % B)[:, None]
        base = dense_mask(docs, a, B, None)[:, :T] & (kv >= qa + s - h.window + 1)
    else:
        base = dense_mask(docs, a, B, h.window)[:, :T]
    if h.context_key != "anchor":  # the same document and window rules, no kv < a_j
        s = (torch.arange(qa.shape[0]) % B)[:, None]
        low = (qa + s - h.window + 1 if h.per_query else qa - h.window) if h.window is not None \
            else torch.zeros_like(qa)
        same = (docs[None, :] == docs[qa]) & (docs[qa] != -1)
        base = ((same | h.padding_visible) & (kv >= low)
                & block_keyed_context(case, h.context_key))
    block = dense_mask(docs, a, B, NO_WINDOW if h.causal_block else None)[:, T:]
    if h.offset > 0:  # kv < anchor + offset: positions at and after the anchor become visible
        base |= ((kv >= qa) & (kv < qa + h.offset) & (docs[None, :] == docs[qa])
                 & (docs[qa] != -1))
    elif h.offset < 0:  # kv < anchor + offset: positions just before the anchor are hidden
        base &= kv < qa + h.offset
    q, k = torch.arange(block.shape[0])[:, None], torch.arange(block.shape[1])[None, :]
    if h.blocks == "earlier":  # a causal mask over all Q noise positions, or block-causal
        block = k <= q if h.causal_block else k // B <= q // B
    elif h.blocks == "all":  # every noise token (the block rule is moot)
        block = torch.ones_like(block)
    if h.per_query and h.window_in_block and h.window is not None:
        block = block & ((q % B) - (k % B) < h.window)
    return torch.cat([base, block], 1)


def block_keyed_context(case: Case, key: str) -> torch.Tensor:
    """[Q, T] bool: the context positions block j = q // B sees when visibility is keyed by
    its index j instead of its anchor's position: the positions a_k..a_k+B-1 of the earlier
    valid blocks k < j (``"earlier_blocks"``) or kv < j * B (``"block_index"``)."""
    B = case.config.block_size
    T = case.inputs["document_ids"].numel()
    a = case.inputs["anchor_positions"].long()
    kv = torch.arange(T)[None, :]
    if key == "block_index":
        seen = kv < (torch.arange(a.numel()) * B)[:, None]
    else:
        valid = case.inputs["anchor_valid"].bool()
        span = (kv >= a[:, None]) & (kv < a[:, None] + B) & valid[:, None]  # [A, T]
        seen = (span.cumsum(0) - span.int()) > 0  # some earlier block covers kv
    return seen.repeat_interleave(B, 0)


def mask_hypotheses(case: Case, layer_type: str, fitted_offset: int | None = None,
                    fitted_window: list[int] | None = None) -> Iterator[MaskHypothesis]:
    """Block scope (own, earlier, all) x block rule (causal / bidirectional) x context offset
    (<, <=, < a-1, and ``fitted_offset``) x window (expected, none, W-1, W+1, W and the
    ``fitted_window`` sizes of :func:`fitted_windows`; each bound from the anchor or from the
    query's own position) x documents (respected, ignored): every combination, so two
    deviations at once (a per-query window without the same-document rule, as SpecForge and
    ModelOpt build it; a per-query window with a bidirectional block, as NeMo Automodel
    builds it) are named together. Then context keyed by block index (earlier blocks'
    positions, kv < j * B) x block rule x window (from the anchor) x documents (respected,
    ignored, ignored with padding visible)."""
    exp = expected_mask_hypothesis(case, layer_type)
    W = case.config.sliding_window
    windows = list(dict.fromkeys([exp.window, None] + ([W, W - 1, W + 1] if W else [])
                                 + list(fitted_window or [])))
    windows = [w for w in windows if w is None or w >= 0]
    offsets = list(dict.fromkeys([0, 1, -1] + ([fitted_offset] if fitted_offset is not None
                                               else [])))
    for blocks, causal, offset, window, docs, per_query in itertools.product(
            ("own", "earlier", "all"), (exp.causal_block, not exp.causal_block), offsets,
            windows, (True, False), (False, True)):
        if per_query and window is None:
            continue
        if blocks != "all" or causal == exp.causal_block:  # "all" ignores the block rule
            yield MaskHypothesis(offset, window, docs, causal, blocks, per_query)
            if per_query and window < case.config.block_size:
                yield MaskHypothesis(offset, window, docs, causal, blocks, per_query, True)
    for key, causal, window, (docs, pad) in itertools.product(
            ("earlier_blocks", "block_index"), (exp.causal_block, not exp.causal_block),
            windows, ((True, False), (False, False), (False, True))):
        yield MaskHypothesis(0, window, docs, causal, context_key=key, padding_visible=pad)


def describe_mask_hypothesis(case: Case, layer_type: str, h: MaskHypothesis) -> list[str]:
    """The named deviations of h from the layer type's expected mask."""
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
    if h.blocks == "earlier":
        out.append("queries also see the noise tokens of earlier blocks (a mask over all Q noise "
                   "positions, not per block; reference: own block only)")
    elif h.blocks == "all":
        out.append("queries see the noise tokens of every block (no block rule; reference: own "
                   "block only)")
    if h.context_key == "earlier_blocks":
        out.append(f"{KEYED_BY_BLOCK}: block j sees the positions a_k..a_k+block_size-1 of the "
                   "earlier blocks k < j, so a block overlapping the previous one sees the "
                   "verifier states of the tokens it predicts (a leak that never occurs at "
                   "inference) and the first block sees no context")
    elif h.context_key == "block_index":
        out.append(f"{KEYED_BY_BLOCK}: block j sees kv < j * block_size, the rule of uniformly "
                   "divided blocks")
    if h.offset == 1:
        out.append("context rule kv <= anchor (reference: kv < anchor): queries also see the "
                   "context at their own anchor position")
    elif h.offset == -1:
        out.append("context rule kv < anchor - 1 (reference: kv < anchor): the position just "
                   "before the anchor is hidden")
    elif h.offset == case.config.block_size:
        out.append("context rule kv < anchor + block_size (reference: kv < anchor): each block "
                   "sees the verifier states of its own positions, the tokens it predicts (a "
                   "leak that never occurs at inference)")
    elif h.offset > 1:
        out.append(f"context rule kv < anchor + {h.offset} (reference: kv < anchor): queries see "
                   f"the verifier states of positions anchor..anchor+{h.offset - 1}, the tokens "
                   "their block predicts (a leak that never occurs at inference)")
    elif h.offset < -1:
        out.append(f"context rule kv < anchor - {-h.offset} (reference: kv < anchor): the "
                   f"{-h.offset} positions before the anchor are hidden")
    if h.per_query and h.window is not None:
        where = ("" if exp.window is not None else
                 " (in a full-attention layer, where the reference has no window)")
        ref_rule = ("the reference's kv >= a - W for every slot of the block"
                    if exp.window is not None else "no window")
        off = "" if h.window == exp.window or exp.window is None else (
            f"; and W off by {h.window - exp.window:+d}")
        block = (f"; it also bounds the block itself (slot s sees slot j only when s - j < W; "
                 f"reference: the whole {'causal ' if exp.causal_block else ''}block)"
                 if h.window_in_block else "")
        out.append(f"sliding window measured from the query's own position: kv >= a + s - W + 1 "
                   f"(a + s - kv < W, the inference-time rule) instead of {ref_rule}{where}"
                   f"{off} (W = {h.window}){block}")
    elif h.window != exp.window:
        if h.window is None:
            out.append(f"sliding window missing (reference: kv >= anchor - {exp.window})")
        elif exp.window is None:
            out.append(f"a sliding window W={h.window} applied in a full-attention layer")
        else:
            out.append(f"window bound off by {h.window - exp.window:+d}: kv >= anchor - "
                       f"{h.window} (reference W={exp.window})")
    if not h.documents:
        out.append("cross-document leakage: queries see context of other packed documents "
                   "(document_ids not applied" + ("; padding positions visible too)"
                                                  if h.padding_visible else ")"))
    return out


def diagnose_mask(ev: Evidence, result: CheckResult) -> list[str]:
    """The mask hypotheses (:func:`mask_hypotheses`) equal to the candidate's mask on the
    trained rows with the fewest deviations (a fitted context offset after the fixed rules):
    their deviations when one does; when several equally few do, one cause naming them all."""
    layer_type = result.details.get("layer_type")
    key = f"mask.{layer_type}"
    if key not in ev.cand.tensors or key not in ev.ref.tensors:
        return []
    c = as_bool_mask(ev.cand.tensors[key])
    if c.shape != as_bool_mask(ev.ref.tensors[key]).shape:
        return [f"mask shape {list(c.shape)} (Q x T+Q expected {list(ev.ref.tensors[key].shape)})"]
    rows, first = ev.rows, []
    hollow = fully_masked_rows(ev.case, ev.cand, ev.ref, [layer_type])
    if hollow is not None and (hollow.changes_training or hollow.nan_rows):
        # named first (where they cannot change training they are a note, not a cause); the
        # other rows are searched for other rules
        rows, first = rows & ~hollow.rows, [hollow.describe()]
        if torch.equal(c[rows], as_bool_mask(ev.ref.tensors[key])[rows]):
            return first
    fixed = (0, 1, -1, ev.config.block_size)  # a fitted offset / window ranks after fixed
    W = ev.config.sliding_window  # rules
    fixed_w = {expected_mask_hypothesis(ev.case, layer_type).window, None} | (
        {W, W - 1, W + 1} if W else set())
    named = [((len(labels), h.offset not in fixed or h.window not in fixed_w), labels, h)
             for labels, h in ((describe_mask_hypothesis(ev.case, layer_type, h), h)
                               for h in mask_hypotheses(
                                   ev.case, layer_type, fitted_context_offset(ev.case, c, rows),
                                   fitted_windows(ev.case, c, rows)))]
    for level in sorted({rank for rank, labels, _ in named if labels}):
        found = list(dict.fromkeys(tuple(labels) for rank, labels, h in named if rank == level
                                   and torch.equal(build_mask(ev.case, h)[rows], c[rows])))
        if len(found) == 1:
            return first + list(found[0])
        if found:  # equally few deviations reproduce it: one cause this case cannot resolve
            return first + [alternatives(["; ".join(f) for f in found])]
    return first


def alternatives(labels: list[str]) -> str:
    """One cause from several rules that reproduce the same trained rows: ``A or B (...)``, or
    ``class: variant A or variant B (...)`` when they share a class (a common text up to
    ": ")."""
    head = os.path.commonprefix(labels).rpartition(": ")[0]
    text = (f"{head}: " + " or ".join(label[len(head) + 2:] for label in labels) if head
            else " or ".join(labels))
    return (f"{text} ({len(labels)} rules this case cannot tell apart: they agree on every "
            "trained row; one cause, not several)")
