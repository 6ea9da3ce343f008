"""Where a difference no hypothesis explains starts: which part of the drafter's forward the
candidate's gradients disagree with most.

A difference inside one component (e.g. the query/key path of the draft attention: a RoPE
layout, a score scale) changes every gradient through the loss, but the gradients of that
component's own parameters the most, relative to their scale. :func:`where_it_starts` ranks the
components by ``max |g_cand - g_ref| / max |g_ref|`` and names the first in forward order
among those within a factor 2 of the worst, with the upstream checks that conform.
"""

from __future__ import annotations

import re

import torch

#: Parameter name pattern -> (component label, position in the forward within a layer).
_PARTS = ((re.compile(r"self_attn\.(q_proj|k_proj|q_norm|k_norm)\."), "attention, the query/key "
           "path", 1), (re.compile(r"self_attn\.(v_proj|o_proj)\."), "attention, the "
                        "value/output path", 2),
          (re.compile(r"input_layernorm\."), "attention input norm", 0),
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


def where_it_starts(cand_grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor],
                    conforming: list[str]) -> str | None:
    """``"where it starts: draft layer 0 attention, the query/key path (q_proj, k_proj
    gradients differ most relative to their scale: 0.91, 0.85; every other parameter <=
    0.31); the masks, context and targets conform"``, or None without gradients to compare.

    Args:
        cand_grads, ref_grads: parameter name -> gradient (the reference's trainable ones).
        conforming: the upstream quantities whose checks pass (``["masks", "context"]``).
    """
    rel = relative_grad_diffs(cand_grads, ref_grads)
    if not rel or max(rel.values()) <= 0:
        return None
    top = max(rel.values())
    worst = sorted((n for n, v in rel.items() if v >= 0.5 * top), key=lambda n: component(n))
    first = component(worst[0])[1]
    names = [n for n in worst if component(n)[1] == first]
    short = [n.rsplit(".", 2)[-2] if n.count(".") >= 2 else n for n in names]
    rest = [v for n, v in rel.items() if component(n)[1] != first]
    others = f"; every other parameter <= {max(rest):.2g}" if rest else ""
    conform = ""
    if conforming:
        conform = "; the " + (conforming[0] if len(conforming) == 1 else
                              ", ".join(conforming[:-1]) + " and " + conforming[-1]) + " conform"
    return (f"where it starts: {first} ({', '.join(short)} gradients differ most relative to "
            f"their scale: {', '.join(f'{rel[n]:.2g}' for n in names)}{others}){conform}")
