"""SpecForge 0.2.0 (``specforge`` on PyPI) as a dflash-audit candidate: its real DFlash training
code (``OnlineDFlashModel`` / ``DFlashDraftModel``) driven on the audit's cases, and what it
computes recorded (contract: :mod:`dflash_audit.audit.frameworks`).

Runs INSIDE the candidate's process with ``specforge`` importable (``--candidate
dflash_audit/audit/frameworks/specforge_adapter.py:candidate``). Citations are to
``specforge==0.2.0``: ``dfm`` = ``specforge/algorithms/common/dflash_family_model.py``,
``dflash.py`` = ``specforge/modeling/draft/dflash.py``.

What is SpecForge's and what the adapter adds:

* SpecForge's: the draft model and its forward, the frozen target embedding / head module
  (``TargetEmbeddingsAndHead``), the noise block, positions, masks (its module-level builder,
  recorded), labels (data tokens ``input_ids[a+s]``, returned as ``target_ids``), weight mask,
  loss weights, loss, backward, accuracy, its anchor sampler (``select_anchors``) and its draft
  config derivation (``derive_config``, :mod:`.specforge_config`).
* The adapter's: the anchors of a case are injected through a replaced
  ``_sample_anchor_positions`` (``dfm:179-210``); the case's weights are loaded by name
  (identical state-dict names, ``dflash.py:338-372``); the draft config is built from the
  case's drafter fields, with target layer ids converted from the speculators convention to
  SpecForge's z-lab one (SpecForge id k reads HF ``output_hidden_states[k+1]``,
  ``dflash.py:284-293``: k = speculators id - 1), and reported back converted.
* Not computed by SpecForge and not returned: verifier target logits (``targets``; SpecForge
  trains on data tokens, there is no verifier head or norm in its DFlash path), per-slot
  accuracy and acceptance length (SpecForge's DFlash logs one accuracy, ``dfm:448-461``).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.frameworks.kit import qwen3_draft_config, state_dict_entries
from dflash_audit.audit.frameworks.specforge_capture import (
    recorded_masks,
    recorded_objective,
)
from dflash_audit.audit.frameworks.specforge_config import (
    derive_config,
    read_run_config,
)
from dflash_audit.audit.frameworks.specforge_latent import LATENT  # noqa: F401 - contract
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.layer_ids import from_zlab_ids, to_zlab_ids
from dflash_audit.model.loss import parse_loss

NAME = "SpecForge"
VERSION = "0.2.0"
#: Imports with torch + transformers alone (no extra package; research sec. 2.10).
REQUIREMENTS = ["specforge==0.2.0"]
#: The framework modules run_case and derive_config import: imported when the candidate
#: loads, so a missing dependency is a setup error before any case.
FRAMEWORK_MODULES = ["specforge.algorithms.common.dflash_family_model",
                     "specforge.modeling.draft.dflash", "specforge.modeling.target.target_utils",
                     "specforge.algorithms.dflash.providers", "specforge.config.schema",
                     "specforge.training.model_loading"]
#: What SpecForge 0.2.0's DFlash training can be configured to run (keys of
#: :class:`dflash_audit.audit.frameworks.capabilities.Capabilities`; None = all). Any profile
#: loss and weighting is supported: SpecForge runs its own variant (hard cross-entropy on the
#: data tokens, its loss types "dflash" / "dpace") and the audit names the difference.
CAPABILITIES: dict[str, Any] = {
    # one conversation per row, zero-padded (algorithms/common/collation.py:24-68): no
    # document mask (dfm:47-88 has no document rule), context positions arange(T) (dfm:294)
    "packed_rows": False,
    # config.layer_types per layer (dflash.py:38-67); sliding layers are causal in the block
    # (dfm:81-83): no non-causal sliding option
    "layouts": ["full", "sliding", "mixed"],
    "block_attention": ["causal"],
    # the DFlash path has no family-specific code: targets are data tokens, no verifier norm
    "verifier_families": None,
    # no t2d / d2t in DFlash: logits over the target head's full vocabulary (dfm:343-345)
    "draft_vocab": False,
    # its only loss, hard CE against the data tokens input_ids[a+s] (dfm:343-349, 406-416),
    # runs for every profile loss: the difference is the audit's finding, not a refusal
    "losses": None,
    # loss_type "dflash" without / with loss_decay_gamma, and "dpace" (dfm:350-373)
    "weightings": ["none", "fixed-exp-decay", "dpace"],
    # labels are always input_ids[a+s] (dfm:406-416)
    "sample_from_anchor": False,
    # SpecForge's bf16 is bf16 parameters (model.to(dtype), model_providers.py:367), not the
    # audit's fp32 master weights under bf16 autocast
    "dtypes": ["fp32"],
    # z-lab ids (id k reads HF output_hidden_states[k+1], dflash.py:284-293): speculators id 0
    # would be SpecForge id -1, and id N-1 reads the state after the final norm
    "embedding_layer": False,
    "last_layer": False,
}
#: Who computed each output (key or key prefix).
PROVENANCE: dict[str, str] = {
    "context": "framework", "mask.": "framework", "logits": "framework",
    "target_ids": "framework", "aligned_loss_mask": "framework", "loss": "framework",
    "loss_weights.": "framework", "grad.": "framework", "metrics": "framework",
    "anchor_draws": "framework", "anchor_draws_valid": "framework",
    "structure.target_layer_ids": "adapter",
}
DRAFT_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.")


class NotSupported(ValueError):
    """A case outside :data:`CAPABILITIES` given to the adapter directly (the audit's planner
    never sends one); the message starts "not supported by SpecForge 0.2.0:" and says why."""


def check_supported(config: DFlashConfig, inputs: dict[str, torch.Tensor]) -> list[int]:
    """SpecForge's target layer ids (z-lab convention) for a case, after refusing what
    :data:`CAPABILITIES` excludes (the same rule, :class:`.capabilities.Capabilities`).

    Raises:
        NotSupported: the case is outside :data:`CAPABILITIES` (the reasons named).
    """
    from dflash_audit.audit.frameworks.capabilities import Capabilities

    case = SimpleNamespace(config=config, inputs=inputs, weights={}, dtype="fp32",
                           loss=SimpleNamespace(loss="ce-data", weighting="none"))
    why = Capabilities.from_dict(CAPABILITIES).unsupported(case)
    if why:
        raise NotSupported(f"not supported by {NAME} {VERSION}: {'; '.join(why)}")
    return to_zlab_ids(config.target_layer_ids)


def draft_config(config: DFlashConfig, ids: list[int], backend: str) -> Any:
    """The ``Qwen3Config`` SpecForge's ``DFlashDraftModel`` is built from (``dflash.py:
    338-372``: ``layer_types``, ``num_target_layers``, ``block_size``, ``dflash_config``), with
    the case's geometry and RoPE and SpecForge's z-lab ``ids``."""
    return qwen3_draft_config(  # Qwen3Config drops the window when no layer slides
        config, num_target_layers=config.num_verifier_layers, block_size=config.block_size,
        dflash_config={"target_layer_ids": list(ids), "mask_token_id": config.mask_token_id},
        _attn_implementation=backend)


def loss_arguments(loss: Any) -> dict[str, Any]:
    """``OnlineDFlashModel`` loss arguments (``dfm:139-152``) for the case's weighting:
    ``fixed-exp-decay`` -> ``loss_type="dflash"`` with ``loss_decay_gamma=gamma``; ``none`` ->
    ``"dflash"`` without a gamma (SpecForge's default); ``dpace`` -> ``loss_type="dpace"`` with
    ``dpace_alpha``. The divergence is always SpecForge's hard cross-entropy (its only one)."""
    weighting = getattr(loss, "weighting", "fixed-exp-decay")
    if weighting == "dpace":
        return {"loss_type": "dpace", "loss_decay_gamma": None,
                "dpace_alpha": float(loss.dpace_alpha)}
    gamma = None if weighting == "none" else float(loss.gamma)
    return {"loss_type": "dflash", "loss_decay_gamma": gamma,
            "dpace_alpha": float(loss.dpace_alpha)}


def api_defaults() -> dict[str, Any]:
    """SpecForge's own defaults (``OnlineDFlashModel.__init__`` signature, ``dfm:139-152``):
    no position decay (``loss_decay_gamma=None``), loss_type ``dflash``, block 16, 512
    anchors; its loss is cross-entropy against data tokens (``ce-data``)."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel

    p = inspect.signature(OnlineDFlashModel.__init__).parameters
    gamma = p["loss_decay_gamma"].default
    return {"gamma": gamma, "loss": "ce-data", "loss_type": p["loss_type"].default,
            "weighting": "none" if gamma is None else "fixed-exp-decay",
            "block_size": p["block_size"].default, "max_anchors": p["num_anchors"].default,
            "dpace_alpha": p["dpace_alpha"].default,
            "attention_backend": p["attention_backend"].default,
            "objective_chunk_blocks": p["objective_chunk_blocks"].default}


class SpecForgeCandidate:
    """SpecForge 0.2.0's DFlash training step as a candidate (see the module docstring)."""

    name = f"{NAME} {VERSION}"

    def run_case(self, config: DFlashConfig, loss: Any, weights: dict[str, torch.Tensor],
                 inputs: dict[str, torch.Tensor]) -> SideOutputs:
        """One SpecForge training step (forward, its loss, backward) on a case.

        Returns outputs keyed as :mod:`dflash_audit.audit.case`: ``context`` [1,T,H] (its
        ``hidden_norm`` output), ``mask.<layer type>`` [Q,T+Q] bool, ``logits`` [1,Q,V] (its
        head's output), ``target_ids`` [1,Q] long (its labels), ``aligned_loss_mask`` [1,Q]
        (its weight mask), ``loss`` [], ``loss_weights.<term>`` [1,Q] (its per-slot weights, under
        each term of the profile's loss: its one loss stands in for them), ``grad.<draft
        parameter>``;
        metrics ``full_acc_sum`` / ``full_acc_total`` (its accuracy, against data tokens),
        ``loss_sum`` (its loss; ``loss_total`` 1) and ``loss_numerator`` / ``loss_denominator``
        (its ``loss_terms``, ``dfm:453-458``). Structure ``target_layer_ids`` are in the
        speculators convention (SpecForge's own ids + 1). No ``targets``: SpecForge computes
        no verifier distribution.

        Raises:
            NotSupported: a case SpecForge cannot express (:func:`check_supported`).
            RuntimeError: SpecForge's objective or head ran more than once.
        """
        import specforge.algorithms.common.dflash_family_model as dfm
        from specforge.modeling.draft.dflash import DFlashDraftModel
        from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

        ids = check_supported(config, inputs)
        device = inputs["input_ids"].device
        # eager on CPU (flex has no CPU backward; eager == sdpa there), SpecForge's default
        # flex_attention on CUDA
        backend = "eager" if device.type == "cpu" else "flex_attention"
        draft = DFlashDraftModel(draft_config(config, ids, backend)).float()
        draft.load_state_dict({k: v for k, v in weights.items()
                               if k.startswith(DRAFT_PREFIXES)}, strict=True)
        # the frozen target embedding and head, as from_pretrained leaves them
        # (target_utils.py:154-157); the head is the case's draft lm_head (what the
        # reference's logits come from; SpecForge uses the target's head for them)
        target = TargetEmbeddingsAndHead(SimpleNamespace(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            pad_token_id=config.pad_token_id))
        target.embed_tokens.weight.data.copy_(weights["embed_tokens.weight"])
        target.lm_head.weight.data.copy_(weights["lm_head.weight"])
        target.eval().requires_grad_(False)
        A = int(inputs["anchor_positions"].numel())
        model = dfm.OnlineDFlashModel(
            draft, target.lm_head, target.embed_tokens, mask_token_id=config.mask_token_id,
            block_size=config.block_size, attention_backend=backend, num_anchors=A,
            objective_chunk_blocks=0, **loss_arguments(loss)).to(device)
        model.train()
        anchors = inputs["anchor_positions"].reshape(1, -1).long()
        keep = inputs["anchor_valid"].reshape(1, -1).bool()
        model._sample_anchor_positions = (
            lambda seq_len, loss_mask, dev: (anchors.clone(), keep.clone()))

        seen: dict[str, Any] = {}
        masks: dict[str, torch.Tensor] = {}
        hooks = [draft.hidden_norm.register_forward_hook(
                     lambda m, i, o: seen.__setitem__("context", o.detach())),
                 target.lm_head.register_forward_hook(
                     lambda m, i, o: seen.setdefault("logits", []).append(o.detach()))]
        try:
            with recorded_masks(dfm, masks), recorded_objective(model, seen):
                loss_value, _, metrics = model(input_ids=inputs["input_ids"],
                                               hidden_states=inputs["hidden_states"],
                                               loss_mask=inputs["loss_mask"])
            loss_value.backward()
        finally:
            for h in hooks:
                h.remove()
        if len(seen["logits"]) != 1:
            raise RuntimeError(f"SpecForge's head ran {len(seen['logits'])} times; expected one")
        return self._outputs(config, loss, draft, model, seen, masks, loss_value, metrics)

    @staticmethod
    def _outputs(config: DFlashConfig, loss: Any, draft: Any, model: Any, seen: dict[str, Any],
                 masks: dict[str, torch.Tensor], loss_value: torch.Tensor,
                 metrics: dict[str, Any]) -> SideOutputs:
        Q = seen["target_ids"].numel()
        types = list(dict.fromkeys(config.effective_layer_types))
        tensors = {
            "context": seen["context"].float(),
            "logits": seen["logits"][0].reshape(1, Q, -1).float(),
            "target_ids": seen["target_ids"].reshape(1, Q).long(),
            "aligned_loss_mask": seen["weight_mask"].reshape(1, Q).float(),
            "loss": loss_value.detach().float().reshape(()),
            **{f"loss_weights.{term}": seen["loss_weights"].reshape(1, Q).float()
               for term in parse_loss(loss.loss)},
            **{f"mask.{t}": masks[t] for t in types if t in masks},
        }
        trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
        tensors.update({f"grad.{n}": p.grad.detach().clone() for n, p in
                        draft.named_parameters() if p.requires_grad and p.grad is not None})
        correct, total = metrics["ratio_metrics"]["acc"]
        num, den = metrics["loss_terms"]
        out_metrics = {"full_acc_sum": float(correct), "full_acc_total": float(total),
                       "loss_sum": float(loss_value.detach()), "loss_total": 1.0,
                       "loss_numerator": float(num.detach()), "loss_denominator": float(den)}
        entries = state_dict_entries(draft, {"embed_tokens.weight": model.embed_tokens.weight,
                                             "lm_head.weight": model.lm_head.weight})
        structure = {
            "fc_in_features": draft.fc.in_features, "fc_out_features": draft.fc.out_features,
            "target_layer_ids": from_zlab_ids(draft.target_layer_ids),
            "block_size": model.block_size, "mask_token_id": model.mask_token_id,
            "layer_types": list(draft.layer_types), "sliding_window": draft.sliding_window,
            "sliding_window_non_causal": False, "sample_from_anchor": False,
            "state_dict": entries,
        }
        return SideOutputs(tensors=tensors, metrics=out_metrics, structure=structure,
                           defaults=api_defaults(), trainable=trainable)

    def select_anchors(self, loss_mask: torch.Tensor, max_anchors: int, block_size: int,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """SpecForge's own sampler ``OnlineDFlashModel._sample_anchor_positions`` (``dfm:
        179-210``: valid ``a < T-1`` with ``loss_mask[a]`` and ``loss_mask[a+1]``, uniform
        without replacement via ``torch.rand`` + ``argsort``, sorted, ``min(A, valid)``
        slots), on torch's global RNG seeded from ``generator`` (restored afterwards).
        ``block_size`` is unused: SpecForge's sampler does not exclude the row's tail.

        Args:
            loss_mask: [1, T] 0/1.
        Returns:
            (anchor_positions [A] long, anchor_valid [A] bool), A = ``max_anchors``: SpecForge's
            min(A, valid) anchors, then padding (0, False); a row
            without two consecutive supervised tokens, which SpecForge's data filter drops
            (``has_consecutive_supervised_tokens``, ``algorithms/dflash/providers.py:37``)
            and its sampler refuses, gives no valid anchor.
        """
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel

        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        this = SimpleNamespace(num_anchors=int(max_anchors))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                a, keep = OnlineDFlashModel._sample_anchor_positions(
                    this, loss_mask.shape[-1], loss_mask.reshape(1, -1).float(), "cpu")
            except ValueError:
                a, keep = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.bool)
        # SpecForge keeps min(A, valid) slots; padded to A with (0, False) as the protocol's
        # anchor_draws [K, A] are (its padding anchors are 0 / keep False too, dfm:210)
        positions = torch.zeros(max_anchors, dtype=torch.long)
        valid = torch.zeros(max_anchors, dtype=torch.bool)
        n = min(max_anchors, a.shape[-1])
        positions[:n], valid[:n] = a.reshape(-1)[:n].long(), keep.reshape(-1)[:n].bool()
        return positions, valid

    def derive_config(self, verifier_config: Any, config: DFlashConfig) -> dict[str, Any]:
        """SpecForge's own draft-config derivation (:func:`.specforge_config.derive_config`)."""
        return derive_config(verifier_config, config)


candidate = SpecForgeCandidate()
__all__ = ["CAPABILITIES", "NAME", "PROVENANCE", "REQUIREMENTS", "VERSION", "NotSupported",
           "SpecForgeCandidate", "candidate", "read_run_config"]
