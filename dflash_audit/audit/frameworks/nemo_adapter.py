"""NeMo Automodel 0.7.0 (``nemo-automodel`` on PyPI) as a dflash-audit candidate: its DFlash
trainer ``DFlashTrainerModule`` (``core`` = ``nemo_automodel/components/speculative/dflash/
core.py``) around its draft ``Qwen3DFlashDraftModel`` (``draft_qwen3.py``), driven on the
audit's cases with the adapter kit (contract: :mod:`dflash_audit.audit.frameworks`).

NeMo's: the draft, the trainer's forward (noise block, positions, its mask builder
``create_dflash_sdpa_mask`` in ``attention/dflash_mask.py``, labels, loss), its
``DFlashDecayLoss`` (``loss/dllm_loss.py``), backward, metrics, the sampler and the draft
config builder ``build_qwen3_dflash_draft_config``. Recorded, never recomputed: the mask (its
builder's return), context and logits (hooks), labels (``_build_block_targets``), the
supervised mask and per-slot weights (``DFlashDecayLoss._reduce``'s ``block_mask`` and
``weights``). The adapter's: the injected anchors, the case's geometry written as the Qwen3
config NeMo's builder starts from, packed rows given as NeMo's packing metadata (``seq_lens``,
``doc_remaining``: :func:`.kit.packing_metadata`, NeMo's packer folds padding into the last
document), eager attention on CPU / sdpa on CUDA (NeMo's default, flex, has no CPU backward).
NeMo's target wrapper hooks decoder layer i (z-lab id i: HF ``hidden_states[i+1]``, the last
one before the final norm), so speculators ids are z-lab ids + 1 and id N is reachable.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import torch

from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.frameworks import kit
from dflash_audit.audit.frameworks.light_import import skip_package_inits
from dflash_audit.audit.frameworks.nemo_latent import LATENT  # noqa: F401 - contract
from dflash_audit.model.layer_ids import from_zlab_ids, to_zlab_ids
from dflash_audit.model.loss import parse_loss

NAME = "NeMo Automodel"
VERSION = "0.7.0"
#: Everything else its DFlash modules import is in a README-built environment (torch,
#: transformers, datasets): its own pins (transformers==5.18.0, ...) are not installed.
REQUIREMENTS = ["nemo-automodel==0.7.0"]
_PKG = "nemo_automodel.components."
#: imported before any case (a missing dependency is a setup error); core imports draft_qwen3
FRAMEWORK_MODULES = ["nemo_automodel.components.speculative.dflash.core"]
#: its package inits import every drafter family, models, distributed code and datasets
skip_package_inits(_PKG + "speculative.dflash", _PKG + "datasets", _PKG + "datasets.llm")
CAPABILITIES: dict[str, Any] = {
    # the trainer's one `sliding_window` masks every layer (core.py:212, 504-528): no mixed
    # layout; its block is always bidirectional (dflash_mask.py:136-141, causal=False from
    # DFlash's forward, core.py:442): a causal-block profile runs as its own variant. Its one
    # loss, CE on the data tokens (core.py:575-587), runs for every profile loss; loss_type
    # "dflash" with / without loss_decay_gamma, no D-PACE (core.py:168)
    "layouts": ["full", "sliding"], "weightings": ["none", "fixed-exp-decay"],
    # Qwen3-shaped targets only (speculative/dflash/registry.py:94-136); packed rows with
    # per-document positions and context (core.py:490-500)
    "verifier_families": ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                          "qwen3_5_moe_text"],
    # a decoder-layer hook cannot capture the embedding output (target.py:74-175)
    "draft_vocab": False, "sample_from_anchor": False, "dtypes": ["fp32"], "embedding_layer": False}
PROVENANCE: dict[str, str] = {"structure.target_layer_ids": "adapter"}


def nemo(module: str) -> Any:
    """NeMo's module ``speculative.dflash.<module>`` (``core``, ``draft_qwen3``)."""
    return importlib.import_module(f"{_PKG}speculative.dflash.{module}")


def _slots(x: torch.Tensor, n: int, B: int) -> torch.Tensor:
    """NeMo's [1, N*(B-1)] per-predicted-position tensor as [1, N*B] slots (slot 0: 0)."""
    return torch.cat([torch.zeros(1, n, 1), x.detach().float().reshape(1, n, B - 1)], 2
                     ).reshape(1, n * B)


class NeMoCandidate:
    """NeMo Automodel 0.7.0's DFlash training step as a candidate (module docstring)."""

    name = f"{NAME} {VERSION}"

    def run_case(self, config: Any, loss: Any, weights: dict[str, torch.Tensor],
                 inputs: dict[str, torch.Tensor]) -> SideOutputs:
        """One NeMo training step on the case: outputs keyed as :mod:`dflash_audit.audit.case`
        (``target_ids`` [1,Q] long: its labels; no ``targets``: no verifier distribution).

        Raises:
            kit.NotSupported: a case outside :data:`CAPABILITIES` given directly.
        """
        core, reduce = nemo("core"), importlib.import_module(_PKG + "loss.dllm_loss")
        kit.refuse_unsupported(CAPABILITIES, self.name, config, inputs, loss)
        B, device, dq = config.block_size, inputs["input_ids"].device, nemo("draft_qwen3")
        # NeMo's own draft-config builder on the case's geometry and z-lab ids
        draft = dq.Qwen3DFlashDraftModel(dq.build_qwen3_dflash_draft_config(
            kit.qwen3_draft_config(config), num_draft_layers=config.num_hidden_layers,
            num_target_layers=config.num_verifier_layers, block_size=B, dflash_config={
                "target_layer_ids": to_zlab_ids(config.target_layer_ids),
                "mask_token_id": config.mask_token_id},
            attention_backend="eager" if device.type == "cpu" else "sdpa")).float().to(device)
        draft.load_state_dict({k: v for k, v in weights.items() if k.startswith(
            ("fc.", "hidden_norm.", "layers.", "norm."))})
        embed, head = kit.frozen_embedding_and_head(weights, device)
        window = config.sliding_window if "sliding_attention" in config.effective_layer_types \
            else None  # NeMo's trainer has one window for every layer
        anchors, keep = inputs["anchor_positions"].reshape(1, -1), inputs["anchor_valid"]
        n = anchors.shape[1]
        trainer = core.DFlashTrainerModule(
            draft, head, embed, config.mask_token_id, B, draft.config._attn_implementation, n,
            sliding_window=window, loss_decay_gamma=float(loss.gamma)
            if loss.weighting == "fixed-exp-decay" else None).to(device).train()
        packing = kit.packing_metadata(inputs["document_ids"])
        with kit.inject_anchors(trainer, "_sample_anchor_positions", lambda *a, **k: (
                anchors.long(), keep.reshape(1, -1).bool())) as sampled, \
                kit.record_calls(core, "create_dflash_sdpa_mask") as masks, \
                kit.record_calls(trainer, "_build_block_targets") as labels, \
                kit.record_calls(trainer.loss_fn, "forward") as losses, \
                kit.record_locals(reduce.DFlashDecayLoss._reduce, ("weights",)) as red, \
                kit.record_outputs(draft.hidden_norm) as context, kit.record_outputs(head) as lo:
            step = trainer(inputs["input_ids"], inputs["hidden_states"], inputs["loss_mask"],
                           position_ids=inputs["position_ids"].long(),
                           seq_lens=packing["seq_lens"], doc_remaining=packing["doc_remaining"])
        step.loss.backward()
        if len(sampled) != 1 or len(lo) != 1:
            raise RuntimeError("NeMo's forward did not sample anchors once and run its head once")
        hits, count = losses[0].result.draft_correct_per_pos, losses[0].result.draft_count_per_pos
        tensors = {
            "context": context[0].detach().float(), "loss": step.loss.detach().reshape(()),
            "logits": lo[0].detach().float().reshape(1, n * B, -1),
            "target_ids": labels[0].result[1].reshape(1, n * B).long(),
            "aligned_loss_mask": _slots(losses[0].args[2], n, B),
            **{f"loss_weights.{t}": _slots(red[0]["weights"], n, B) for t in parse_loss(loss.loss)},
            **{f"mask.{t}": masks[0].result[0, 0] == 0 for t in set(config.effective_layer_types)},
            **{f"grad.{k}": p.grad.detach().clone() for k, p in draft.named_parameters()
               if p.grad is not None}}
        metrics = {f"position_{s}_acc_{k}": float(v[s - 1]) for s in range(1, B)
                   for k, v in (("sum", hits), ("total", count))} | {
            "full_acc_sum": step.correct_tokens, "full_acc_total": step.valid_tokens,
            "eal_sum": step.accept_len_sum, "eal_total": step.valid_blocks, "loss_sum": step.loss,
            "loss_total": 1}
        structure = kit.framework_structure(
            draft, {"embed_tokens.weight": embed.weight, "lm_head.weight": head.weight},
            target_layer_ids=from_zlab_ids(draft.target_layer_ids), block_size=draft.block_size,
            mask_token_id=draft.mask_token_id, sliding_window=trainer.sliding_window,
            layer_types=[("sliding" if window else "full") + "_attention"] * len(draft.layers),
            sliding_window_non_causal=window is not None)
        return SideOutputs(tensors=tensors, metrics={k: float(v) for k, v in metrics.items()},
                           structure=structure,
                           trainable=[k for k, p in draft.named_parameters() if p.requires_grad],
                           defaults=nemo_defaults())

    def select_anchors(self, loss_mask: torch.Tensor, max_anchors: int, block_size: int,
                       generator: torch.Generator, document_ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """NeMo's own ``_sample_anchor_positions`` (core.py:230-285) on ``loss_mask`` [1,T]
        with the packed row's ``doc_remaining`` from ``document_ids`` [1,T] (as ``run_case``
        gives it; None: an unpacked row), torch's global RNG seeded from ``generator``:
        (anchor_positions [A] long, anchor_valid [A] bool), padded; a row without a valid
        anchor gives none."""
        core, remaining = nemo("core"), None if document_ids is None else kit.packing_metadata(
            document_ids.reshape(1, -1))["doc_remaining"]
        return kit.sampled_anchors(lambda: core.DFlashTrainerModule._sample_anchor_positions(
            SimpleNamespace(block_size=block_size, num_anchors=max_anchors), loss_mask.shape[-1],
            loss_mask.reshape(1, -1).float(), "cpu", doc_remaining=remaining), max_anchors,
            generator, core.NoValidAnchorsError)

    def derive_config(self, verifier_config: Any, config: Any) -> dict[str, Any]:
        """NeMo's own draft config for the verifier (``build_qwen3_dflash_draft_config``, the
        Qwen3 targets' builder: the verifier's whole config with the draft's depth, every
        layer ``full_attention``), as the derivation record.

        Raises:
            kit.NotSupported: a verifier without a NeMo DFlash draft (registry.py:94-136).
        """
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
        dq, text = nemo("draft_qwen3"), getattr(verifier_config, "text_config", None)
        text = text or verifier_config
        if text.model_type not in CAPABILITIES["verifier_families"]:
            raise kit.NotSupported(f"not supported by {self.name}: no DFlash draft for "
                                   f"verifier model_type {text.model_type!r} (Qwen3 only)")
        n, N = config.num_hidden_layers, text.num_hidden_layers
        cfg = dq.build_qwen3_dflash_draft_config(
            text, num_draft_layers=n, num_target_layers=N, block_size=config.block_size,
            dflash_config={"mask_token_id": config.mask_token_id}, attention_backend="eager")
        return kit.derivation_record(
            cfg, Qwen3RotaryEmbedding(cfg), cfg.to_dict(),
            default_target_layer_ids=from_zlab_ids(dq.build_target_layer_ids(N, n)),
            mask_token_id=cfg.dflash_config["mask_token_id"])


def nemo_defaults() -> dict[str, Any]:
    """``DFlashTrainerModule``'s own defaults (core.py:175-187): block 16, 512 anchors, no
    position decay (``loss_decay_gamma=None``; its recipe sets 7.0), CE on data tokens."""
    return kit.signature_defaults(nemo("core").DFlashTrainerModule.__init__,
                                  block_size="block_size", max_anchors="num_anchors",
                                  gamma="loss_decay_gamma") | {"loss": "ce-data"}


candidate = NeMoCandidate()
