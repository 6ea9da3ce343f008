"""The candidate protocol, our drafter as the default candidate, and loading a user's one.

A candidate is any object with

    run_case(config: DFlashConfig, loss: LossSpec, weights: dict[str, Tensor],
             inputs: dict[str, Tensor]) -> SideOutputs

that builds its model from ``config`` (the profile's drafter fields), loads ``weights``
(reference state-dict keys: ``fc.weight``, ``layers.{i}.self_attn.q_proj.weight``, ...),
runs one training step's forward and backward on ``inputs`` (batch tensors with the
reference's names plus the injected ``anchor_positions`` / ``anchor_valid``) and returns
the output tensors listed in :mod:`dflash_audit.audit.case` with its metrics and a
structure summary. Optionally it also has ``select_anchors(loss_mask [1,T], max_anchors,
block_size[, generator][, document_ids=[1,T]]) -> (anchor_positions [A], anchor_valid [A])``,
its own anchor sampler (``document_ids`` is passed when its signature names it, so a
per-document sampler can be audited),
which the audit compares with the reference's by distribution, and
``derive_config(verifier_config, config) -> dict``, its own drafter-config derivation from a
verifier config (``config`` carries the drafter-only fields: draft layers and layout, block
size, target layers, mask token) as the flat dict of
:func:`dflash_audit.model.derivation.derivation_fields` (RoPE the draft layers run, head
geometry, eps, norm convention, vocabularies, and ``saved.<key>`` for what its checkpoint's
``config.json`` says), which the ``derivation`` check compares field by field with the
reference's own derivation. ``--candidate module:attr``
or ``--candidate path/file.py:attr`` names such an object (or a zero-argument factory
returning one).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dflash_audit.audit.case import SideOutputs
from dflash_audit.candidate_spec import is_our_drafter, spec_problem  # noqa: F401 (re-exported)
from dflash_audit.model.anchors import select_anchors
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter, DraftOutputs
from dflash_audit.model.loss import LossSpec, dflash_loss, uses_data_targets
from dflash_audit.model.metrics import dflash_metrics


class CandidateError(Exception):
    """A candidate could not be loaded or does not follow the protocol."""


class Candidate(Protocol):
    def run_case(self, config: DFlashConfig, loss: LossSpec, weights: dict[str, torch.Tensor],
                 inputs: dict[str, torch.Tensor]) -> SideOutputs: ...


def structure_summary(model: nn.Module, config: DFlashConfig) -> dict[str, Any]:
    """Structural facts of a drafter module, in the same form the reference adapter reports.

    Facts come from the built model's own ``config`` when it has one (a candidate may build
    something other than the profile asks for), else from the profile's ``config``. A
    candidate whose optimizer keeps a master copy of parameters the module holds in bf16 adds
    ``"master_weights": "float32"`` (or ``{name: dtype}``); without it such parameters fail the
    structure check (:func:`dflash_audit.audit.precision.unmastered_parameters`). A trainable
    entry that is the same tensor as an earlier one (``ModuleList([layer] * n)``) carries
    ``"shares": <that entry's key>`` (frozen aliases, e.g. a tied head, change no training and
    are not marked); ``reference/adapter.py`` marks the reference's the same way.
    """
    config = getattr(model, "config", None) if isinstance(
        getattr(model, "config", None), DFlashConfig) else config
    params = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}  # a trainable tensor under two names (a module used twice)
    shares = {k: first.setdefault(id(p), k) for k, p in params.items() if p.requires_grad}
    return {
        "fc_in_features": model.fc.in_features,
        "fc_out_features": model.fc.out_features,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "layer_types": list(config.effective_layer_types),
        "sliding_window": config.sliding_window if "sliding_attention" in
        config.effective_layer_types else None,
        "sliding_window_non_causal": config.sliding_window_non_causal,
        "sample_from_anchor": config.sample_from_anchor,
        "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                           "trainable": bool(params[k].requires_grad) if k in params else False,
                           **({"shares": shares[k]} if shares.get(k, k) != k else {})}
                       for k, v in model.state_dict().items()},
    }


def side_outputs(model: nn.Module, config: DFlashConfig, out: DraftOutputs, loss_spec: LossSpec
                 ) -> SideOutputs:
    """Loss, backward and packaging of one forward's outputs (shared by drafter candidates)."""
    result = dflash_loss(out.logits, out.targets, out.aligned_loss_mask, config.block_size,
                         loss_spec, config.sample_from_anchor, target_ids=out.target_ids)
    result.loss.backward()
    tensors = {"context": out.context.detach(), "targets": out.targets.detach().float(),
               "logits": out.logits.detach().float(),
               "aligned_loss_mask": out.aligned_loss_mask.detach().float(),
               "loss": result.loss.detach().reshape(())}
    if uses_data_targets(loss_spec.loss):  # a hard-label loss: the tokens it teaches
        tensors["target_ids"] = out.target_ids.detach().long()
    tensors.update({f"mask.{k}": m for k, m in out.masks.items()})
    tensors.update({f"loss_weights.{k}": w.detach().float() for k, w in result.weights.items()})
    named = list(model.named_parameters(remove_duplicate=False))  # every name of a shared one
    trainable = [n for n, p in named if p.requires_grad]
    tensors.update({f"grad.{n}": p.grad.detach().clone() for n, p in named
                    if p.requires_grad and p.grad is not None})
    metrics = dflash_metrics(out.logits, out.targets, out.aligned_loss_mask, config.block_size,
                             config.sample_from_anchor)
    metrics["loss_sum"], metrics["loss_total"] = float(result.loss.detach()), 1.0
    if len(result.terms) > 1:
        for name, value in result.terms.items():
            metrics[f"{name}_loss_sum"], metrics[f"{name}_loss_total"] = float(value), 1.0
    return SideOutputs(tensors=tensors, metrics=metrics,
                       structure=structure_summary(model, config), trainable=trainable,
                       defaults=our_defaults())


def our_defaults() -> dict[str, Any]:
    """Defaults of our drafter's API (LossSpec and DFlashConfig field defaults)."""
    spec = LossSpec()
    block_size = next(f.default for f in dataclasses.fields(DFlashConfig) if f.name == "block_size")
    return {"gamma": spec.gamma, "loss": spec.loss, "weighting": spec.weighting,
            "dpace_alpha": spec.dpace_alpha, "block_size": block_size}


class DrafterCandidate:
    """Our own drafter (:class:`DFlashDrafter`); subclasses override :meth:`build` to
    reproduce bugs (see examples/candidates)."""

    name = "dflash-audit drafter"

    def build(self, config: DFlashConfig) -> nn.Module:
        return DFlashDrafter(config)

    def select_anchors(self, loss_mask, max_anchors, block_size, generator, document_ids=None):
        """Our anchor sampler (:func:`dflash_audit.model.anchors.select_anchors`), audited by
        distribution against the reference's (:mod:`dflash_audit.audit.checks.anchors`)."""
        return select_anchors(loss_mask, max_anchors, block_size, generator, document_ids)

    def derive_config(self, verifier_config: Any, config: DFlashConfig) -> dict[str, Any]:
        """Our derivation of the drafter config from ``verifier_config`` (flat dict, see
        :func:`dflash_audit.model.derivation.derivation_fields`), audited against the
        reference's own by the ``derivation`` check."""
        from dflash_audit.model.derivation import derivation_fields, rederive

        return derivation_fields(rederive(verifier_config, config))

    def run_case(self, config, loss, weights, inputs) -> SideOutputs:
        # the bound method, not the class's: a build set on the instance is the candidate's too
        if getattr(self.build, "__func__", None) is DrafterCandidate.build:  # ours: every
            model = DFlashDrafter(config, initialize=False)  # weight is loaded next, strictly
        else:  # the candidate's own model, as it builds it
            model = self.build(config)
        model = model.float().to(inputs["input_ids"].device)
        model.load_state_dict(weights, strict=True)
        model.train()
        out = model(**{k: inputs[k] for k in (
            "hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
            "document_ids", "position_ids", "anchor_positions", "anchor_valid")})
        return side_outputs(model, config, out, loss)


def load_candidate(spec: str | None) -> Candidate:
    """Resolve ``None`` (our drafter), ``module:attr`` or ``path/to/file.py:attr``.

    Raises:
        CandidateError: the module/file/attribute is missing or the object has no run_case.
    """
    if is_our_drafter(spec):
        return DrafterCandidate()
    problem = spec_problem(spec)
    if problem:
        raise CandidateError(problem)
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            mod_name = f"dflash_audit_candidate_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except CandidateError:
        raise
    except Exception as err:  # noqa: BLE001 - user code; report what failed
        raise CandidateError(f"could not import candidate {target!r}: {type(err).__name__}: {err}"
                             ) from err
    obj = getattr(module, attr, None)
    if obj is None:
        offered = sorted((n for n, v in vars(module).items() if not n.startswith("_") and (
            n == "candidate" or (hasattr(v, "run_case") and getattr(
                v, "__module__", module.__name__) == module.__name__))),  # not imported ones
            key=lambda n: (n != "candidate", n))
        hint = (f"; it offers {', '.join(f'{target}:{n}' for n in offered)}" if offered else
                "; a candidate is an object with run_case(config, loss, weights, inputs), or a "
                "class / factory returning one")
        raise CandidateError(f"{target!r} has no attribute {attr!r}{hint}")
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "run_case")):
        obj = obj()
    if not hasattr(obj, "run_case"):
        raise CandidateError(f"candidate {spec!r} has no run_case(config, loss, weights, inputs)")
    return obj
