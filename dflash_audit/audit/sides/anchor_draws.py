"""Drawing a side's own anchor sampler many times on a case, in that side's process: what the
``anchors`` check compares by distribution (:mod:`dflash_audit.audit.checks.anchors`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from dflash_audit.audit.case import ANCHOR_DRAWS, Case


def _sampler_arguments(select: Callable) -> tuple[bool, bool]:
    """(takes a generator, takes ``document_ids``) of a sampler, from its signature: a 4th
    positional parameter other than ``document_ids`` is the generator; ``document_ids`` is
    passed by name when the sampler names it (or takes ``**kwargs``)."""
    try:
        params = inspect.signature(select).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): pass a generator
        return True, False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [n for n, p in params.items() if p.kind in kinds and n != "document_ids"]
    var_positional = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params.values())
    takes_docs = "document_ids" in params or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    return len(positional) >= 4 or var_positional, takes_docs


def draw_anchors(select: Callable, case: Case, draws: int = ANCHOR_DRAWS, seed: int = 0
                 ) -> dict[str, torch.Tensor]:
    """``draws`` anchor selections of ``select(loss_mask, max_anchors, block_size[, generator]
    [, document_ids=])`` on the case's loss_mask (and packed-document ids, when the sampler
    names ``document_ids``), from one seeded generator: {``anchor_draws`` [K,A'] int64,
    ``anchor_draws_valid`` [K,A'] bool}, A' the most slots one draw returned (shorter draws
    padded with invalid slots). A sampler with the reference's signature (no generator: it
    uses the global RNG) is called without one, after ``torch.manual_seed``."""
    A = case.inputs["anchor_positions"].numel()
    args = (case.inputs["loss_mask"], A, case.config.block_size)
    takes_generator, takes_docs = _sampler_arguments(select)
    kwargs = {"document_ids": case.inputs["document_ids"].clone()} if takes_docs else {}
    g = torch.Generator().manual_seed(seed)
    if not takes_generator:
        torch.manual_seed(seed)
    out = [select(args[0].clone(), *args[1:], *([g] if takes_generator else []), **kwargs)
           for _ in range(draws)]
    width = max(int(a.numel()) for a, _ in out)

    def pad(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = t.reshape(-1).to(dtype)
        return torch.cat([t, torch.zeros(width - t.numel(), dtype=dtype)])

    return {"anchor_draws": torch.stack([pad(a, torch.long) for a, _ in out]),
            "anchor_draws_valid": torch.stack([pad(v, torch.bool) for _, v in out])}
