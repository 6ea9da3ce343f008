"""Fully masked query rows: rows of a candidate's [Q, T+Q] mask through which a query sees no
key at all, where the reference lets every query see at least its own block.

An eager softmax over such a row (every score -inf) gives 0/0 = NaN; SDPA's math path and flex
attention return 0 there instead. Whether the rows can change training depends on where they
are and where their values go: rows of trained blocks always can; rows of blocks without a
supervised slot (the blocks of padding anchors, ``anchor_valid`` False, as NeMo Automodel PR
2826 masked them and SpecForge's first DFlash mask did) can only through non-finite values that
reach the loss or the gradients (``0 * NaN`` is NaN: a loss mask applied afterwards does not
remove them). The candidate's logits being non-finite on every slot of those rows is the
fingerprint of an eager softmax over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.slots import (
    anchors,
    reference_masks,
    supervised_rows,
    supervised_slots,
)

#: The class, as the audit names it.
FULLY_MASKED = "fully masked query rows"


@dataclass
class MaskedRows:
    """The fully masked query rows of a candidate's masks on one case.

    ``rows``: [Q] bool, rows no key is visible from (in any of ``layer_types``' masks);
    ``padding_blocks`` / ``idle_blocks`` / ``trained_blocks``: the anchors j whose block holds
    such rows: padding anchors, valid anchors without a supervised slot, trained blocks;
    ``nan_rows``: the candidate's logits are non-finite on every slot of those rows (None: no
    logits returned); ``reaches``: what training uses that holds non-finite values (the loss,
    the gradients, the logits of supervised slots)."""

    rows: torch.Tensor
    layer_types: list[str]
    padding_blocks: list[int]
    idle_blocks: list[int]
    trained_blocks: list[int]
    nan_rows: bool | None
    reaches: list[str] = field(default_factory=list)

    @property
    def changes_training(self) -> bool:
        """Rows of trained blocks, or non-finite values that reach what training uses."""
        return bool(self.trained_blocks or self.reaches)

    def which(self) -> str:
        """``the blocks of padding anchors (anchor_valid False) j = 5, 6`` and the others."""
        parts = [(self.padding_blocks, "the blocks of padding anchors (anchor_valid False)"),
                 (self.idle_blocks, "blocks of valid anchors without a supervised slot"),
                 (self.trained_blocks, "trained blocks")]
        return "; ".join(f"{text} j = {_listed(js)}" for js, text in parts if js)

    def describe(self) -> str:
        """The cause, in the audit's words, with what it does on this case."""
        n, types = int(self.rows.sum()), " and ".join(self.layer_types)
        text = (f"fully masked query rows: {n} query rows see no key at all in the {types} mask "
                f"({self.which()}), where the reference lets every query see at least its own "
                "block; an eager softmax over a row whose scores are all -inf turns it into NaN "
                "(0/0)")
        if self.trained_blocks:
            return text + "; rows of trained blocks lose their own block and context"
        if self.reaches:
            return f"{text}; here {self._how()}, and non-finite values reach {self._reached()}"
        if self.nan_rows:
            return (f"{text}; here the candidate's logits are NaN on those rows, but its loss "
                    "and gradients stay finite")
        return (f"{text}; here the candidate's outputs and gradients stay finite (a softmax that "
                "gives 0 for such rows, or a finite fill), so they cannot change training")

    def _how(self) -> str:
        if self.nan_rows:
            return ("the candidate's logits are NaN on those rows (0 * NaN is NaN: a loss mask "
                    "applied afterwards does not remove them)")
        if self.nan_rows is False:
            return ("the candidate's logits are finite on those rows but its gradients are not "
                    "(zeroing the attention output of those rows afterwards leaves NaN in the "
                    "backward pass, where the NaN weights multiply the values' gradient; "
                    "zeroing the weights themselves, a finite fill such as finfo.min, or a "
                    "softmax that gives 0 there does not)")
        return "the candidate returned no logits"

    def _reached(self) -> str:
        return " and ".join(self.reaches)

    def consequence(self) -> str:
        """What a downstream check's non-finite values follow from."""
        return (f"follows from the {FULLY_MASKED} (see mask): {int(self.rows.sum())} rows see "
                f"no key ({self.which()}), an eager softmax over them gives NaN, and non-finite "
                f"values reach {self._reached()}")


def _listed(js: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, js[:limit])) + (f" (+{len(js) - limit} more)"
                                               if len(js) > limit else "")


def _non_finite(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t) if t.is_floating_point() else torch.zeros_like(t, dtype=torch.bool)


def fully_masked_rows(case: Case, cand: SideOutputs, ref: SideOutputs,
                      layer_types: list[str] | None = None) -> MaskedRows | None:
    """The candidate's fully masked query rows in the masks of ``layer_types`` (default: every
    layer type both sides returned a mask for, of the same shape), or None when there are none.
    """
    c_masks, r_masks = reference_masks(cand), reference_masks(ref)
    types = [t for t in (layer_types or list(c_masks)) if t in c_masks and t in r_masks
             and c_masks[t].shape == r_masks[t].shape and c_masks[t].ndim == 2]
    hollow = {t: ~c_masks[t].any(1) & r_masks[t].any(1) for t in types}
    types = [t for t in types if hollow[t].any()]
    if not types:
        return None
    rows = torch.stack([hollow[t] for t in types]).any(0)
    B = case.config.block_size
    if rows.numel() != anchors(case)[0].numel() * B:
        return None
    _, valid = anchors(case)
    trained = supervised_rows(case, ref).reshape(-1, B).any(1)
    blocks = rows.reshape(-1, B).any(1)
    logits = cand.tensors.get("logits")
    nan_rows = None
    reaches = []
    if isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.shape[1] == rows.numel():
        bad = _non_finite(logits[0]).any(-1)  # [Q]
        nan_rows = bool(bad[rows].all())
        sup = supervised_slots(case, ref)
        if bad[sup].any():
            reaches.append("the logits of supervised slots")
    if "loss" in cand.tensors and _non_finite(cand.tensors["loss"]).any():
        reaches.insert(0, "the loss")
    if any(_non_finite(v).any() for k, v in cand.tensors.items() if k.startswith("grad.")):
        reaches.insert(1 if reaches[:1] == ["the loss"] else 0, "the gradients")
    js = blocks.nonzero().squeeze(-1).tolist()
    return MaskedRows(rows, types, [j for j in js if not valid[j]],
                      [j for j in js if valid[j] and not trained[j]],
                      [j for j in js if trained[j]], nan_rows, reaches)

