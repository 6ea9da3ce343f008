"""Where a difference no hypothesis explains starts: which part of the drafter's forward the
candidate's gradients disagree with most.

A difference inside one component (e.g. the query/key path of the draft attention: a RoPE
layout, a score scale) changes every gradient through the loss, but the gradients of that
component's own parameters the most, relative to their scale. :func:`where_it_starts` ranks the
components by ``max |g_cand - g_ref| / max |g_ref|`` and names the first in forward order
among those near the worst, with the upstream checks that conform. A component whose forward
output is known to conform (the context, when its check passes) is not named: its gradient
differs only through what reads it. The attention's input norm counts with the query/key path
(it feeds the queries; a score difference moves both).
"""

from __future__ import annotations

import re

import torch

#: Parameter name pattern -> (component label, position in the forward within a layer).
_PARTS = ((re.compile(r"(self_attn\.(q_proj|k_proj|q_norm|k_norm)|input_layernorm)\."),
           "attention, the query/key path", 1),
          (re.compile(r"self_attn\.(v_proj|o_proj)\."), "attention, the value/output path", 2),
          (re.compile(r"(mlp\.|post_attention_layernorm\.)"), "MLP", 3))


def component(name: str) -> tuple[int, str]:
    """(forward order, label) of a trainable parameter: the context (fc, hidden_norm), draft
    layer i's attention input norm / query-key path / value-output path / MLP, the final norm."""
    if name.startswith(("fc.", "hidden_norm.")):
        return 0, "the context (fc, hidden_norm)"
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        i = int(m.group(1))
        for pattern, label, order in _PARTS:
            if pattern.search(name):
                return 1 + 4 * i + order, f"draft layer {i} {label}"
        return 1 + 4 * i, f"draft layer {i}"
    return 10**6, "the final norm" if name.startswith("norm.") else name


def relative_grad_diffs(cand: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                        ) -> dict[str, float]:
    """``max |g_c - g_r| / max |g_r|`` per parameter both sides give a finite gradient of."""
    out = {}
    for name, r in ref.items():
        c = cand.get(name)
        if c is None or c.shape != r.shape or not bool(torch.isfinite(c).all()
                                                       and torch.isfinite(r).all()):
            continue
        scale = float(r.abs().max())
        if scale > 0:
            out[name] = float((c.double() - r.double()).abs().max()) / scale
    return out


#: A component stands out when its worst relative gradient difference is at least STANDS_OUT x
#: the median over components; the first in forward order within NEAR x the worst is named.
STANDS_OUT, NEAR = 1.5, 0.8


def where_it_starts(cand_grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor],
                    conforming: list[str]) -> str | None:  # noqa: C901
    """``"where it starts: draft layer 0 attention, the query/key path (the first component in
    forward order whose gradients differ most relative to their scale: q_norm 0.54, k_norm
    0.47; largest anywhere 0.64, median component 0.35); the masks, context and targets
    conform"``; where no component stands out, says so; None without gradients to compare.

    Args:
        cand_grads, ref_grads: parameter name -> gradient (the reference's trainable ones).
        conforming: the upstream quantities whose checks pass (``["masks", "context"]``).
    """
    rel = relative_grad_diffs(cand_grads, ref_grads)
    if not rel or max(rel.values()) <= 0:
        return None
    scores: dict[tuple[int, str], float] = {}
    for name, value in rel.items():
        key = component(name)
        if key[0] == 0 and "context" in conforming:  # its forward conforms
            continue
        scores[key] = max(scores.get(key, 0.0), value)
    if not scores:
        return None
    top = max(scores.values())
    ranked = sorted(scores.values())
    median = ranked[len(ranked) // 2]
    conform = ""
    if conforming:
        conform = "; the " + (conforming[0] if len(conforming) == 1 else
                              ", ".join(conforming[:-1]) + " and " + conforming[-1]) + " conform"
    if len(scores) > 1 and top < STANDS_OUT * median:
        return (f"where it starts: no one component of the drafter stands out (every "
                f"component's gradients differ by {ranked[0]:.2g} to {top:.2g} relative to "
                f"their scale){conform}")
    first = min(k for k, v in scores.items() if v >= NEAR * top)
    names = sorted((n for n in rel if component(n) == first), key=lambda n: -rel[n])
    short = [n.rsplit(".", 2)[-2] if n.count(".") >= 2 else n for n in names]
    grads = ", ".join(f"{n} {rel[m]:.2g}" for n, m in zip(short, names))
    return (f"where it starts: {first[1]} (the first component in forward order whose "
            f"gradients differ most relative to their scale: {grads}; largest anywhere "
            f"{top:.2g}, median component {median:.2g}){conform}")
