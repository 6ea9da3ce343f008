"""What a training framework's DFlash code supports (an adapter's ``CAPABILITIES``), and which
audit cases fall outside it.

A case outside a framework's capabilities is not a failure of the framework: the planner
(:mod:`dflash_audit.audit.cases.plan`) fills the case budget with cases it supports, cuts a
packed row to one document where packed rows are not supported
(:func:`single_document`), and lists the rest as "not supported by NAME VERSION: reason"
(only the checks that need no training step -- anchors, derivation -- run on them).
"""

from __future__ import annotations

import dataclasses
import re
import reprlib
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.model.config import SLIDING_ATTENTION
from dflash_audit.model.loss import LOSS_NAMES, WEIGHTINGS, parse_loss

LAYOUTS = ("full", "sliding", "mixed")
BLOCK_ATTENTION = ("causal", "non_causal")
DTYPES = ("fp32", "bf16")
#: The values a list-valued key may hold (None: any string, e.g. verifier model types).
_ALLOWED: dict[str, tuple[str, ...]] = {
    "layouts": LAYOUTS, "block_attention": BLOCK_ATTENTION, "losses": LOSS_NAMES,
    "weightings": WEIGHTINGS, "dtypes": DTYPES}


class CapabilitiesError(ValueError):
    """An adapter's CAPABILITIES has an unknown key or a value of the wrong kind."""


#: A transformers ``model_type`` (the values of ``verifier_families``).
_MODEL_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_BRIEF = reprlib.Repr()
_BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlevel, _BRIEF.maxlist = 60, 60, 3, 4


def brief(value: Any) -> str:
    """``repr(value)`` cut short (long strings, deep or long containers, one line): how an
    error message quotes what an adapter declared, whatever its size."""
    return " ".join(_BRIEF.repr(value).split())


@dataclass(frozen=True)
class Capabilities:
    """What a framework's code can be configured to run (defaults: everything, as the
    reference). A profile value the framework runs as its OWN variant (SpecForge's hard
    cross-entropy on the data tokens for ``kl_div`` or ``ce``, ModelOpt's soft cross-entropy for
    ``kl_div``) is supported: the audit names the difference. Only what the framework cannot
    express at all is left out here.

    packed_rows: several documents (and padding) in one row [1, T] with ``document_ids``.
    layouts: draft-layer layouts among ``full`` / ``sliding`` / ``mixed``.
    block_attention: within-block attention of sliding layers: ``causal`` (the reference's
        default) and / or ``non_causal`` (``sliding_window_non_causal``).
    verifier_families: verifier ``model_type`` values (:mod:`dflash_audit.data.families`);
        None = all.
    draft_vocab: a draft vocabulary V_d < V (``t2d`` / ``d2t``).
    losses: loss names of :mod:`dflash_audit.model.loss` (every term of a mix must be
        listed); None = all.
    loss_mixes: a JSON mix of several loss terms.
    weightings: ``none`` / ``fixed-exp-decay`` / ``dpace``; None = all.
    sample_from_anchor: ``sample_from_anchor=True`` (slot s taught by position a+s).
    dtypes: ``fp32`` / ``bf16``.
    any_target_layer_count: any number n of target layers for the draft depth (False: exactly
        one target layer per draft layer, as ModelOpt; the planner then gives each case as
        many draft layers as target layers, :mod:`dflash_audit.audit.cases.supported`).
    embedding_layer: target layer id 0 (the embedding output, HF ``hidden_states[0]``; z-lab id
        -1, which z-lab-convention frameworks cannot name).
    last_layer: target layer id N (the last decoder layer's output BEFORE the final norm;
        z-lab id N-1 reads HF ``hidden_states[N]``, after it).
    window_below_block: a sliding window W smaller than the block size B.
    separate_draft_head: a draft ``lm_head`` that differs from ``verifier_lm_head`` (False:
        the framework has one head for both roles).
    """

    packed_rows: bool = True
    layouts: tuple[str, ...] = LAYOUTS
    block_attention: tuple[str, ...] = BLOCK_ATTENTION
    verifier_families: tuple[str, ...] | None = None
    draft_vocab: bool = True
    losses: tuple[str, ...] | None = None
    loss_mixes: bool = True
    weightings: tuple[str, ...] | None = None
    sample_from_anchor: bool = True
    dtypes: tuple[str, ...] = DTYPES
    any_target_layer_count: bool = True
    embedding_layer: bool = True
    last_layer: bool = True
    window_below_block: bool = True
    separate_draft_head: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Capabilities:
        """Capabilities from an adapter's ``CAPABILITIES`` dict (lists become tuples).

        Raises:
            CapabilitiesError: an unknown key (the known ones are named), a non-list value
                where a list is expected, or a list value outside the known ones (named).
        """
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise CapabilitiesError(f"CAPABILITIES must be a dict of capability fields, got "
                                    f"{brief(data)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(data) - names)
        if unknown:
            raise CapabilitiesError(f"unknown CAPABILITIES key(s) {brief(unknown)}; known: "
                                    f"{sorted(names)}")
        out: dict[str, Any] = {}
        for key, value in data.items():
            default = getattr(cls, key)
            if isinstance(default, bool):
                if not isinstance(value, bool):  # bool("false") is True: never guessed
                    raise CapabilitiesError(f"CAPABILITIES[{key!r}] must be true or false, "
                                            f"got {brief(value)}")
                out[key] = value
            elif value is None:
                out[key] = None
            elif isinstance(value, (list, tuple)):
                out[key] = tuple(v if isinstance(v, str) else brief(v) for v in value)
                if not out[key]:  # a framework that can run no case at all
                    raise CapabilitiesError(f"CAPABILITIES[{key!r}] is empty: the framework "
                                            "could run no case; list what it runs (None: all)")
                bad = [v for v in out[key] if (v not in _ALLOWED[key] if key in _ALLOWED
                                               else not _MODEL_TYPE.match(v))]
                if bad:
                    raise CapabilitiesError(
                        f"CAPABILITIES[{key!r}]: unknown value(s) {brief(bad)}; "
                        + (f"known: {list(_ALLOWED[key])}" if key in _ALLOWED else
                           "not a model_type (letters, digits, '_', '-', '.')"))
            else:
                raise CapabilitiesError(f"CAPABILITIES[{key!r}] must be a list, got "
                                        f"{brief(value)}")
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    def unsupported(self, case: Any) -> list[str]:
        """Why ``case`` (a :class:`dflash_audit.audit.case.Case`) is outside these
        capabilities, one reason each; empty when the framework can run it."""
        return [reason for _, reason in self.unsupported_by(case)]

    def unsupported_by(self, case: Any) -> list[tuple[str, str]]:
        """:meth:`unsupported` with the capability each reason comes from: ``(field of this
        class, reason)`` pairs, in the same order."""
        cfg, inputs, why = case.config, case.inputs, []
        doc = inputs["document_ids"]
        documents = int(doc.max()) + 1 if bool((doc >= 0).any()) else 0
        if not self.packed_rows and (documents > 1 or bool((doc < 0).any())):
            why.append(("packed_rows", f"packed rows ({documents} documents"
                        + (", padding" if bool((doc < 0).any()) else "") + " in one row)"))
        types = set(cfg.effective_layer_types)
        layout = "mixed" if len(types) > 1 else ("sliding" if SLIDING_ATTENTION in types
                                                 else "full")
        if layout not in self.layouts:
            why.append(("layouts", f"{layout} draft-layer layout (supported: "
                                   f"{', '.join(self.layouts)})"))
        if SLIDING_ATTENTION in types:
            block = "non_causal" if cfg.sliding_window_non_causal else "causal"
            if block not in self.block_attention:
                why.append(("block_attention",
                            f"{block.replace('_', '-')} block attention in sliding layers"))
        family = cfg.verifier_model_type
        if self.verifier_families is not None and family not in self.verifier_families:
            why.append(("verifier_families", f"verifier family {family!r} (supported: "
                                             f"{', '.join(self.verifier_families)})"))
        if cfg.uses_draft_vocab and not self.draft_vocab:
            why.append(("draft_vocab", f"a draft vocabulary (V_d={cfg.effective_draft_vocab_size}"
                                       f" < V={cfg.vocab_size})"))
        why += self._target_layers(cfg)
        if (SLIDING_ATTENTION in types and not self.window_below_block
                and cfg.sliding_window < cfg.block_size):
            why.append(("window_below_block", f"a sliding window W={cfg.sliding_window} smaller "
                                              f"than the block (B={cfg.block_size})"))
        heads = [case.weights.get(k) for k in ("lm_head.weight", "verifier_lm_head.weight")]
        if (not self.separate_draft_head and all(h is not None for h in heads)
                and not torch.equal(heads[0], heads[1])):
            why.append(("separate_draft_head", "a draft lm_head that differs from the "
                                               "verifier's (one head for both)"))
        terms = list(parse_loss(case.loss.loss))
        if self.losses is not None and any(t not in self.losses for t in terms):
            why.append(("losses", f"loss {case.loss.loss!r} (supported: "
                                  f"{', '.join(self.losses)})"))
        if len(terms) > 1 and not self.loss_mixes:
            why.append(("loss_mixes", f"a mix of loss terms {case.loss.loss!r} (one term only)"))
        if self.weightings is not None and case.loss.weighting not in self.weightings:
            why.append(("weightings", f"loss weighting {case.loss.weighting!r} (supported: "
                                      f"{', '.join(self.weightings)})"))
        if cfg.sample_from_anchor and not self.sample_from_anchor:
            why.append(("sample_from_anchor", "sample_from_anchor=True"))
        if case.dtype not in self.dtypes:
            why.append(("dtypes", f"dtype {case.dtype} (supported: {', '.join(self.dtypes)})"))
        return why

    def _target_layers(self, cfg: Any) -> list[tuple[str, str]]:
        """Why the case's target layer ids (speculators convention) cannot be given."""
        ids, n, why = list(cfg.target_layer_ids), cfg.num_verifier_layers, []
        if not self.any_target_layer_count and len(ids) != cfg.num_hidden_layers:
            why.append(("any_target_layer_count",
                        f"{len(ids)} target layers for {cfg.num_hidden_layers} draft layer(s) "
                        "(it takes exactly one target layer per draft layer)"))
        if not self.embedding_layer and 0 in ids:
            why.append(("embedding_layer", "target layer id 0 (the embedding output: z-lab id "
                                           "-1, which it cannot name)"))
        if not self.last_layer and n in ids:
            why.append(("last_layer", f"target layer id {n} (the last layer's output before the "
                                      f"final norm: its id {n - 1} reads HF hidden_states[{n}], "
                                      "after the norm)"))
        return why

    def lacking(self) -> list[str]:
        """The fields where these capabilities fall short of the reference's (a flag False, a
        list that leaves a known value out, a restriction where the default is None = all),
        in field order: what a latent difference (:mod:`.latent`) can be declared for."""
        full = Capabilities()
        every = {"losses": LOSS_NAMES, "weightings": WEIGHTINGS}
        out = []
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), getattr(full, f.name)
            if isinstance(default, bool):
                short = not value
            elif default is None:
                short = value is not None and (f.name not in every
                                               or not set(every[f.name]) <= set(value))
            else:
                short = not set(default) <= set(value)
            if short:
                out.append(f.name)
        return out


def single_document(case: Any, seed: int = 0) -> Any | None:
    """``case`` cut to one document -- the first whose tokens leave a valid anchor (a short
    first document often leaves none) -- without padding, with its anchors redrawn on the cut
    row (same slot count A, seeded), for a framework without packed rows; None when no
    document leaves a valid anchor. The name gains ``-doc<d>``, the description says what was
    cut, and ``document_ids`` become 0 (positions already restart per document).

    Shapes: every [1, T] / [1, T, *] input becomes [1, T_d], T_d = length of document d.
    """
    from dflash_audit.model.anchors import select_anchors, valid_anchor_mask

    doc = case.inputs["document_ids"][0]
    T = int(case.inputs["input_ids"].shape[-1])
    for d in range(int(doc.max()) + 1 if bool((doc >= 0).any()) else 0):
        where = (doc == d).nonzero().reshape(-1)
        if not where.numel():
            continue
        start, end = int(where.min()), int(where.max()) + 1  # documents are contiguous
        inputs = {k: v[:, start:end].clone() for k, v in case.inputs.items()
                  if k not in ("anchor_positions", "anchor_valid")}
        if not bool(valid_anchor_mask(inputs["loss_mask"], case.config.block_size).any()):
            continue
        inputs["document_ids"] = torch.zeros_like(inputs["document_ids"])
        g = torch.Generator().manual_seed(seed)
        A = int(case.inputs["anchor_positions"].numel())
        anchors, valid = select_anchors(inputs["loss_mask"], A, case.config.block_size, g)
        return dataclasses.replace(
            case, name=f"{case.name}-doc{d}", inputs={**inputs, "anchor_positions": anchors,
                                                      "anchor_valid": valid},
            description=f"{case.description}; cut to its document {d} (T={end - start} of "
                        f"{T}): the framework takes one document per row")
    return None
