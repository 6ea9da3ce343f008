"""What a training framework's DFlash code supports (an adapter's ``CAPABILITIES``), and which
audit cases fall outside it.

A case outside a framework's capabilities is not a failure of the framework: the planner
(:mod:`dflash_audit.audit.cases.plan`) fills the case budget with cases it supports, cuts a
packed row to its first document where packed rows are not supported
(:func:`single_document`), and lists the rest as "not supported by NAME VERSION: reason"
(only the checks that need no training step -- anchors, derivation -- run on them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.model.config import SLIDING_ATTENTION
from dflash_audit.model.loss import parse_loss

LAYOUTS = ("full", "sliding", "mixed")
BLOCK_ATTENTION = ("causal", "non_causal")


class CapabilitiesError(ValueError):
    """An adapter's CAPABILITIES has an unknown key or a value of the wrong kind."""


@dataclass(frozen=True)
class Capabilities:
    """What a framework's code can run (defaults: everything, as the reference).

    packed_rows: several documents (and padding) in one row [1, T] with ``document_ids``.
    layouts: draft-layer layouts among ``full`` / ``sliding`` / ``mixed``.
    block_attention: within-block attention of sliding layers: ``causal`` (the reference's
        default) and / or ``non_causal`` (``sliding_window_non_causal``).
    verifier_families: verifier ``model_type`` values (:mod:`dflash_audit.data.families`);
        None = all.
    draft_vocab: a draft vocabulary V_d < V (``t2d`` / ``d2t``).
    losses: loss names of :mod:`dflash_audit.model.loss` (every term of a mix must be
        listed); None = all.
    weightings: ``fixed-exp-decay`` / ``dpace``; None = all.
    sample_from_anchor: ``sample_from_anchor=True`` (slot s taught by position a+s).
    dtypes: ``fp32`` / ``bf16``.
    """

    packed_rows: bool = True
    layouts: tuple[str, ...] = LAYOUTS
    block_attention: tuple[str, ...] = BLOCK_ATTENTION
    verifier_families: tuple[str, ...] | None = None
    draft_vocab: bool = True
    losses: tuple[str, ...] | None = None
    weightings: tuple[str, ...] | None = None
    sample_from_anchor: bool = True
    dtypes: tuple[str, ...] = ("fp32", "bf16")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Capabilities:
        """Capabilities from an adapter's ``CAPABILITIES`` dict (lists become tuples).

        Raises:
            CapabilitiesError: an unknown key (the known ones are named) or a non-list value
                where a list is expected.
        """
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise CapabilitiesError(f"unknown CAPABILITIES key(s) {unknown}; known: "
                                    f"{sorted(names)}")
        out: dict[str, Any] = {}
        for key, value in data.items():
            default = getattr(cls, key)
            if isinstance(default, bool):
                out[key] = bool(value)
            elif value is None:
                out[key] = None
            elif isinstance(value, (list, tuple)):
                out[key] = tuple(str(v) for v in value)
            else:
                raise CapabilitiesError(f"CAPABILITIES[{key!r}] must be a list, got {value!r}")
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    def unsupported(self, case: Any) -> list[str]:
        """Why ``case`` (a :class:`dflash_audit.audit.case.Case`) is outside these
        capabilities, one reason each; empty when the framework can run it."""
        cfg, inputs, why = case.config, case.inputs, []
        doc = inputs["document_ids"]
        documents = int(doc.max()) + 1 if bool((doc >= 0).any()) else 0
        if not self.packed_rows and (documents > 1 or bool((doc < 0).any())):
            why.append(f"packed rows ({documents} documents"
                       + (", padding" if bool((doc < 0).any()) else "") + " in one row)")
        types = set(cfg.effective_layer_types)
        layout = "mixed" if len(types) > 1 else ("sliding" if SLIDING_ATTENTION in types
                                                 else "full")
        if layout not in self.layouts:
            why.append(f"{layout} draft-layer layout (supported: {', '.join(self.layouts)})")
        if SLIDING_ATTENTION in types:
            block = "non_causal" if cfg.sliding_window_non_causal else "causal"
            if block not in self.block_attention:
                why.append(f"{block.replace('_', '-')} block attention in sliding layers")
        family = cfg.verifier_model_type
        if self.verifier_families is not None and family not in self.verifier_families:
            why.append(f"verifier family {family!r} (supported: "
                       f"{', '.join(self.verifier_families)})")
        if cfg.uses_draft_vocab and not self.draft_vocab:
            why.append(f"a draft vocabulary (V_d={cfg.effective_draft_vocab_size} < "
                       f"V={cfg.vocab_size})")
        terms = list(parse_loss(case.loss.loss))
        if self.losses is not None and any(t not in self.losses for t in terms):
            why.append(f"loss {case.loss.loss!r} (supported: {', '.join(self.losses)})")
        if self.weightings is not None and case.loss.weighting not in self.weightings:
            why.append(f"loss weighting {case.loss.weighting!r} (supported: "
                       f"{', '.join(self.weightings)})")
        if cfg.sample_from_anchor and not self.sample_from_anchor:
            why.append("sample_from_anchor=True")
        if case.dtype not in self.dtypes:
            why.append(f"dtype {case.dtype} (supported: {', '.join(self.dtypes)})")
        return why


def single_document(case: Any, seed: int = 0) -> Any | None:
    """``case`` cut to its first document (tokens of ``document_ids == 0``, no padding), with
    its anchors redrawn on the cut row (same slot count A, seeded), for a framework without
    packed rows; None when the first document leaves no valid anchor. The name gains ``-doc0``
    and the description says what was cut.

    Shapes: every [1, T] / [1, T, *] input becomes [1, T0], T0 = length of document 0.
    """
    from dflash_audit.model.anchors import select_anchors, valid_anchor_mask

    doc = case.inputs["document_ids"][0]
    first = (doc == 0).nonzero()
    if not first.numel():
        return None
    T0 = int(first.max()) + 1  # documents are contiguous and start at position 0
    inputs = {k: v[:, :T0].clone() for k, v in case.inputs.items()
              if k not in ("anchor_positions", "anchor_valid")}
    if not bool(valid_anchor_mask(inputs["loss_mask"], case.config.block_size).any()):
        return None
    g = torch.Generator().manual_seed(seed)
    A = int(case.inputs["anchor_positions"].numel())
    anchors, valid = select_anchors(inputs["loss_mask"], A, case.config.block_size, g)
    T = int(case.inputs["input_ids"].shape[-1])
    return dataclasses.replace(
        case, name=f"{case.name}-doc0", inputs={**inputs, "anchor_positions": anchors,
                                                  "anchor_valid": valid},
        description=f"{case.description}; cut to its first document (T={T0} of {T}): the "
                    "framework takes one document per row")
