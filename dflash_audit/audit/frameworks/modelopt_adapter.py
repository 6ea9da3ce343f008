"""NVIDIA ModelOpt 0.47.0's real DFlash training code as a dflash-audit candidate
(``nvidia-modelopt`` on PyPI: ``modelopt/torch/speculative/plugins/hf_dflash.py``
``HFDFlashModel``, ``plugins/modeling_dflash.py`` ``DFlashModule``). Runs inside the candidate's
process with modelopt importable; the contract is :mod:`dflash_audit.audit.frameworks`.

What runs is ModelOpt's own code, offline, as its trainer runs it: a ``FakeBaseModel`` carrying
the case's frozen verifier parts (embedding, lm_head, final norm; modeling_fakebase.py:75-170),
``modelopt.torch.speculative.convert(base, [("dflash", settings)])``
(:func:`dflash_audit.audit.frameworks.modelopt_config.dflash_settings`), the case's drafter
weights loaded into ``dflash_module``, one offline ``.pt`` dump per conversation read back by
ModelOpt's ``OfflineSupervisedDataset`` and ``EagleOfflineDataCollator`` (eagle/utils.py:83-218),
``model(**batch)`` (hf_dflash.py:872-1060) and ``loss.backward()``. The adapter records:

* the anchors: injected by replacing ``_sample_anchor_positions`` on the instance
  (hf_dflash.py:605-644), in ModelOpt's per-row layout (:mod:`.modelopt_rows`);
* the mask: ``_build_draft_attention_mask``'s return value (hf_dflash.py:677-730), wrapped;
* the context: ``dflash_module.hidden_norm``'s output (forward hook, modeling_dflash.py:400);
* the teacher and draft logits: the base ``lm_head``'s outputs (forward hook; called twice with
  self-distillation, teacher [R,L,V] first, draft [R,N*B,V] second);
* the targets, hard labels, aligned mask and per-slot weights: ``_compute_loss``'s own locals
  ``teacher_logits`` (base logits at a+s-1), ``target_ids`` (input_ids[a+s]),
  ``binary_eval_mask`` and ``flat_weights`` (mask x D-PACE or decay weights), read when it
  returns (hf_dflash.py:764-870) -- never recomputed;
* the loss, its gradients and ModelOpt's only metric ``train_acc``.

Declared adapter choices (``PROVENANCE`` / ``settings.*``):

* ``base_hidden_prenorm=True`` in every dump: the reference's ``verifier_last_hidden_states``
  are pre-norm, so ModelOpt re-applies the base final norm (modeling_final_norm.py:119-145).
  ModelOpt's offline default is post-norm (``hidden_states_prenorm`` absent -> False,
  eagle/utils.py:161): a user feeding pre-norm states without the flag drops the final norm.
* one conversation per row (:mod:`.modelopt_rows`); ModelOpt has no packed rows.
* ``dflash_architecture_config`` holds the case's head geometry (heads, KV heads, head_dim,
  MLP width, attention bias): what a user must write for the weights to load (ModelOpt
  inherits none of it under transformers 5.19). RoPE, eps, activation stay ModelOpt's.
* the training dtype: a bf16 case runs as ModelOpt's recipe trains in bf16
  (dflash.yaml:46 ``bf16: true``): the base in bf16 (:func:`.modelopt_config.fake_base`; its
  example trainer loads the checkpoint's dtype, ``dtype="auto"``), and ModelOpt itself casts
  the draft module to the base's dtype (hf_dflash.py:511 ``self.dflash_module.to(
  self._base_model.dtype)``), so its trainable parameters are bf16. No master copy is reported:
  the trainer is transformers' ``Trainer`` (examples/speculative_decoding/eagle_utils.py
  ``EagleTrainerWithAccLog.create_optimizer`` calls ``super().create_optimizer()``; repository
  main at a2fbac7, not in the wheel), whose optimizer takes the module's own parameters, and
  with the recipe's ``dp_shard_size: 1`` (dflash.yaml:34) no FSDP runs (accelerate 1.15.0
  upcasts trainable parameters to fp32 under FSDP with mixed precision,
  utils/fsdp_utils.py:814-819; a run with ``dp_shard_size > 1`` is not what this adapter
  runs). The structure check then names the difference.
* the transformers 5.19 work-around: ``DFlashModule._maybe_init_rotary_emb`` calls
  ``Qwen3RotaryEmbedding(config=..., device=...)`` (modeling_dflash.py:380-388) and 5.19 has
  no ``device`` argument (TypeError on the first forward); the adapter pre-sets ``rotary_emb``
  to ``Qwen3RotaryEmbedding(config=dflash_module._rotary_config)``, the same module
  (:func:`.modelopt_config.init_rotary`).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.frameworks import modelopt_config as mc
from dflash_audit.audit.frameworks.kit import record_locals, state_dict_entries
from dflash_audit.audit.frameworks.modelopt_latent import LATENT  # noqa: F401 - contract
from dflash_audit.audit.frameworks.modelopt_recipe import read_run_config  # noqa: F401
from dflash_audit.audit.frameworks.modelopt_rows import (
    plan_rows,
    row_slices,
    to_packed_context,
    to_packed_mask,
    to_slots,
)
from dflash_audit.model.config import SLIDING_ATTENTION, DFlashConfig
from dflash_audit.model.layer_ids import from_zlab_ids
from dflash_audit.model.loss import LossSpec

NAME = "NVIDIA ModelOpt"  # literals: the registry reads them from this source
VERSION = "0.47.0"
#: pip requirements installed ``--no-deps``: the wheel and what it needs to import
#: (modelopt/torch/utils/robust_json.py:31 imports omegaconf, which needs antlr4 4.9.3;
#: modelopt/torch/opt/searcher.py:32 imports pulp; modelopt/torch/__init__.py imports
#: modelopt.torch.nas, whose algorithms.py:28 imports scipy.interpolate: scipy 1.17.1's cp311+
#: manylinux wheel, built for numpy >= 1.26.4, as setup.sh's numpy 2.x).
REQUIREMENTS = ["nvidia-modelopt==0.47.0", "omegaconf==2.4.0", "antlr4-python3-runtime==4.9.3",
                "pulp==3.3.2", "scipy==1.17.1"]
#: The framework modules run_case, select_anchors and derive_config import: imported when
#: the candidate loads, so a missing dependency is a setup error before any case.
FRAMEWORK_MODULES = ["modelopt.torch.speculative", "modelopt.torch.speculative.config",
                     "modelopt.torch.speculative.plugins.hf_dflash",
                     "modelopt.torch.speculative.plugins.modeling_dflash",
                     "modelopt.torch.speculative.plugins.modeling_fakebase",
                     "modelopt.torch.speculative.plugins.modeling_final_norm",
                     "modelopt.torch.speculative.eagle.utils"]
#: What ModelOpt 0.47.0's DFlash training can be configured to run (keys of
#: :class:`dflash_audit.audit.frameworks.capabilities.Capabilities`).
CAPABILITIES: dict[str, Any] = {
    # one conversation per row, no document ids (eagle/utils.py:83-218): the planner cuts a
    # packed row to one document
    "packed_rows": False,
    # one mask for every layer (hf_dflash.py:1027-1035): all full, or all sliding; the block
    # is bidirectional or causal independently of the window (config.py:152-184)
    "layouts": ["full", "sliding"],
    "block_attention": ["causal", "non_causal"],
    # dflash_swa_window_size >= dflash_block_size (config.py:288-293)
    "window_below_block": False,
    # verifier model types ModelOpt re-applies a final norm for (modeling_final_norm.py:84-100)
    "verifier_families": ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                          "deepseek_v3", "kimi_k2", "kimi_k25", "nemotron_h",
                          "minimax_m3_vl_text"],
    "draft_vocab": False,
    # kl_div runs as ModelOpt's soft cross-entropy vs its teacher (KL + H(teacher), its own
    # variant: the audit names the difference); ce / ce-data as hard CE vs the data token
    # (hf_dflash.py:846-859); one term, no mix
    "losses": sorted(mc.LOSS_MODES),
    "loss_mixes": False,
    # none / fixed-exp-decay = objective "decay" (factor 0 / gamma), dpace = its D-PACE
    "weightings": sorted(mc.WEIGHTING_OBJECTIVES),
    "sample_from_anchor": False,
    "dtypes": ["fp32", "bf16"],
    # exactly one target layer per draft layer, z-lab ids >= 0 (hf_dflash.py:455-478)
    "any_target_layer_count": False,
    "embedding_layer": False,
    # one base lm_head for teacher and draft (hf_dflash.py:1037, 150)
    "separate_draft_head": False,
}
_FRAMEWORK = "framework"
PROVENANCE: dict[str, str] = {
    "context": _FRAMEWORK, "mask.": _FRAMEWORK, "targets": _FRAMEWORK, "target_ids": _FRAMEWORK,
    "logits": _FRAMEWORK, "aligned_loss_mask": _FRAMEWORK, "loss": _FRAMEWORK,
    "loss_weights.": _FRAMEWORK, "grad.": _FRAMEWORK, "anchor_draws": _FRAMEWORK,
    "anchor_draws_valid": _FRAMEWORK, "metrics.": _FRAMEWORK,
    # the adapter's, not ModelOpt's: see the module docstring
    "settings.base_hidden_prenorm": "adapter", "settings.rows": "adapter",
    "settings.dflash_architecture_config": "adapter", "settings.rotary_emb": "adapter",
    "structure.state_dict.frozen_names": "adapter",
}
_DRAFT_PARTS = ("fc", "hidden_norm", "layers", "norm")
_FROZEN = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
           "verifier_norm.weight")
_LOCALS = ("teacher_logits", "target_ids", "binary_eval_mask", "flat_weights",
           "safe_label_indices")


def modelopt_defaults() -> dict[str, Any]:
    """ModelOpt's own ``DFlashConfig`` defaults (config.py:91-131), in the defaults check's
    names: no decay factor (0.0, unused by the default D-PACE objective), self-distillation
    (soft cross-entropy, reported as kl_div)."""
    from modelopt.torch.speculative.config import DFlashConfig as ModelOptConfig

    f = {k: v.default for k, v in ModelOptConfig.model_fields.items()}
    return {"block_size": f["dflash_block_size"], "max_anchors": f["dflash_num_anchors"],
            "weighting": "dpace" if f["dflash_loss_objective"] == "dpace" else
            "fixed-exp-decay", "dpace_alpha": f["dflash_dpace_alpha"],
            "gamma": f["dflash_loss_decay_factor"],
            "loss": "kl_div (soft cross-entropy)" if f["dflash_self_logit_distillation"]
            else "ce-data"}


class ModelOptCandidate:
    """ModelOpt 0.47.0's DFlash trainer as a candidate (see the module docstring)."""

    name = f"{NAME} {VERSION}"

    def select_anchors(self, loss_mask: torch.Tensor, max_anchors: int, block_size: int,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """ModelOpt's own ``HFDFlashModel._sample_anchor_positions`` (hf_dflash.py:605-644)
        on ``loss_mask`` [1,T] as one row, with ``dflash_block_size`` / ``_num_anchors`` its
        only reads; it draws from torch's global RNG, which is forked and seeded from
        ``generator``. Returns (anchor_positions [A] long, anchor_valid [A] bool), A =
        ``max_anchors`` (ModelOpt's own count is at most A, padded with 0 / False)."""
        from modelopt.torch.speculative.plugins.hf_dflash import HFDFlashModel

        sampler = type("Sampler", (), {"dflash_block_size": block_size,
                                       "_num_anchors": max_anchors})()
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        devices = [loss_mask.device] if loss_mask.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            anchors, keep = HFDFlashModel._sample_anchor_positions(
                sampler, loss_mask.shape[-1], loss_mask.reshape(1, -1).float(), loss_mask.device)
        positions = torch.zeros(max_anchors, dtype=torch.long, device=loss_mask.device)
        valid = torch.zeros(max_anchors, dtype=torch.bool, device=loss_mask.device)
        n = min(max_anchors, anchors.shape[1])
        positions[:n], valid[:n] = anchors[0, :n], keep[0, :n]
        return positions, valid

    def derive_config(self, verifier_config: Any, config: DFlashConfig) -> dict[str, Any]:
        """ModelOpt's own drafter-config derivation (:func:`.modelopt_config.derive`)."""
        return mc.derive(verifier_config, config)

    def run_case(self, config: DFlashConfig, loss: LossSpec, weights: dict[str, torch.Tensor],
                 inputs: dict[str, torch.Tensor]) -> SideOutputs:
        """One ModelOpt training step on the case (see the module docstring).

        Raises:
            NotSupported: the case asks for something ModelOpt cannot train (named).
            RowLayoutError: the packed row cannot be cut into conversations.
        """
        from modelopt.torch.speculative.plugins.hf_dflash import HFDFlashModel

        settings = mc.dflash_settings(config, loss, int(inputs["anchor_positions"].numel()))
        layout = plan_rows(inputs, config.block_size)
        device = inputs["input_ids"].device
        low = inputs["hidden_states"].dtype  # the case's training dtype (bf16 / fp32)
        base = mc.fake_base(config, low)  # ModelOpt casts its draft to this dtype
        self._load_frozen(base, weights)
        model = mc.convert(base, settings)
        draft = {k: v for k, v in weights.items() if k.split(".")[0] in _DRAFT_PARTS}
        model.dflash_module.load_state_dict(draft, strict=True)
        model.to(device).train()

        lm_calls: list[torch.Tensor] = []
        context: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        found: dict[str, Any] = {}
        base.lm_head.register_forward_hook(lambda m, i, o: lm_calls.append(o.detach()))
        model.dflash_module.hidden_norm.register_forward_hook(
            lambda m, i, o: context.append(o.detach()))
        build_mask = model._build_draft_attention_mask

        def recorded_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
            masks.append(build_mask(*args, **kwargs))
            return masks[-1]

        model._build_draft_attention_mask = recorded_mask
        anchors, keep = layout.anchors.to(device), layout.keep.to(device)
        model._sample_anchor_positions = lambda seq_len, loss_mask, dev: (anchors, keep)
        compute_loss = model._compute_loss
        code = HFDFlashModel._compute_loss.__code__

        def traced_loss(*args: Any, **kwargs: Any) -> Any:
            with record_locals(code, _LOCALS) as returns:
                out = compute_loss(*args, **kwargs)
            for local in returns:
                found.update(local)
            return out

        model._compute_loss = traced_loss
        batch = self._batch(layout, inputs, device)
        out = model(**batch)
        out.loss.backward()
        return self._outputs(config, loss, model, layout, inputs, out, lm_calls, context,
                             masks, found)

    @staticmethod
    def _load_frozen(base: Any, weights: dict[str, torch.Tensor]) -> None:
        """The case's frozen verifier parts into ModelOpt's base: one ``lm_head`` plays the
        teacher head and the draft head (hf_dflash.py:1037, 150).

        Raises:
            NotSupported: the case's ``lm_head`` and ``verifier_lm_head`` differ.
        """
        head = weights["verifier_lm_head.weight"]
        if "lm_head.weight" in weights and not torch.equal(weights["lm_head.weight"], head):
            raise mc.NotSupported("a draft lm_head that differs from the verifier's (ModelOpt "
                                  "uses the base lm_head for teacher and draft)")
        with torch.no_grad():
            base.embed_tokens.weight.copy_(weights["embed_tokens.weight"])
            base.lm_head.weight.copy_(head)
            base.norm.weight.copy_(weights["verifier_norm.weight"])

    @staticmethod
    def _batch(layout: Any, inputs: dict[str, torch.Tensor], device: torch.device
               ) -> dict[str, Any]:
        """ModelOpt's own offline dataset and collator on one ``.pt`` dump per conversation
        (``input_ids``, ``hidden_states`` = the last hidden state, ``aux_hidden_states``,
        ``loss_mask``, ``hidden_states_prenorm``), as its dump scripts write them."""
        from modelopt.torch.speculative.eagle.utils import (
            EagleOfflineDataCollator,
            OfflineSupervisedDataset,
        )

        parts = {k: row_slices(layout, inputs[k]) for k in (
            "input_ids", "verifier_last_hidden_states", "hidden_states", "loss_mask")}
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for r in range(layout.rows):
                files.append(str(Path(tmp) / f"conversation-{r}.pt"))
                torch.save({"input_ids": parts["input_ids"][r].long().cpu(),
                            "hidden_states": parts["verifier_last_hidden_states"][r].cpu(),
                            "aux_hidden_states": parts["hidden_states"][r].cpu(),
                            "loss_mask": parts["loss_mask"][r].long().cpu(),
                            "hidden_states_prenorm": True}, files[-1])
            dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
            batch = EagleOfflineDataCollator(layout.row_len)([dataset[i] for i in range(
                layout.rows)])
        outputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                   for k, v in batch.pop("base_model_outputs").items()}
        return {**{k: v.to(device) for k, v in batch.items()}, "base_model_outputs": outputs}

    def _outputs(self, config: DFlashConfig, loss: LossSpec, model: Any, layout: Any,
                 inputs: dict[str, torch.Tensor], out: Any, lm_calls: list, context: list,
                 masks: list, found: dict[str, Any]) -> SideOutputs:
        """ModelOpt's recorded tensors in the reference's coordinates (:mod:`.modelopt_rows`)."""
        T = int(inputs["input_ids"].shape[-1])
        R, L = layout.rows, layout.row_len
        kd = model.dflash_self_logit_distillation
        provenance = dict(PROVENANCE)
        tensors = {"context": to_packed_context(layout, context[-1], T),
                   "logits": to_slots(layout, lm_calls[-1]).float(),
                   "aligned_loss_mask": to_slots(layout, found["binary_eval_mask"].reshape(
                       R, -1)).float(),
                   "loss": out.loss.detach().float().reshape(())}
        mask = to_packed_mask(layout, masks[-1], T)
        tensors.update({f"mask.{t}": mask for t in dict.fromkeys(config.effective_layer_types)})
        weights = to_slots(layout, found["flat_weights"].reshape(R, -1)).float()
        tensors[f"loss_weights.{mc.loss_term(loss)}"] = weights
        if kd and "teacher_logits" in found:
            tensors["targets"] = to_slots(layout, found["teacher_logits"]).float()
        elif kd:  # Sum of weights <= 1: ModelOpt returns 0 * logits and gathers no teacher
            index = (found["safe_label_indices"] - 1).clamp(min=0).reshape(R, -1)
            teacher = lm_calls[0]
            gathered = torch.stack([teacher[r, index[r]] for r in range(R)])
            tensors["targets"] = to_slots(layout, gathered).float()
            provenance["targets"] = "adapter"
        else:
            tensors["target_ids"] = to_slots(layout, found["target_ids"]).long()
        module = model.dflash_module
        tensors.update({f"grad.{n}": p.grad.detach().clone() for n, p in
                        module.named_parameters() if p.requires_grad and p.grad is not None})
        # float outputs in the case's fp32 (a bf16 case's context and gradients are bf16)
        tensors = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        metrics = {"train_acc": float(out.train_acc[0][0]),
                   "loss_sum": float(out.loss.detach()), "loss_total": 1.0}
        side = SideOutputs(tensors=tensors, metrics=metrics,
                           structure=self._structure(config, model),
                           defaults=modelopt_defaults(), trainable=trainable)
        if any(f.name == "metadata" for f in dataclasses.fields(SideOutputs)):
            side.metadata = {"provenance": provenance, "modelopt": {
                "rows": R, "row_len": L, "self_logit_distillation": bool(kd),
                "loss_objective": model.dflash_loss_objective,
                "loss_decay_factor": model.dflash_loss_decay_factor,
                "swa_window_size": model.dflash_swa_window_size,
                "draft_attention": model.dflash_draft_attention}}
        return side

    @staticmethod
    def _structure(config: DFlashConfig, model: Any) -> dict[str, Any]:
        """ModelOpt's built drafter in the structure check's terms: its fc, its layer ids in
        the speculators convention (+1), what its mask does per layer, and the state dict of
        ``dflash_module`` plus the base's frozen parts under the reference's names."""
        module, base = model.dflash_module, model._base_model_lm_head
        window = model.dflash_swa_window_size
        n = module.config.num_hidden_layers
        state = state_dict_entries(module, {
            "embed_tokens.weight": model._base_model_embeddings.weight,
            "lm_head.weight": base.weight, "verifier_lm_head.weight": base.weight,
            "verifier_norm.weight": model._base_model_norm.weight})
        return {
            "fc_in_features": module.fc.in_features, "fc_out_features": module.fc.out_features,
            "target_layer_ids": from_zlab_ids(model.target_layer_ids),
            "block_size": model.dflash_block_size, "mask_token_id": model.mask_token_id,
            "layer_types": [SLIDING_ATTENTION if window else "full_attention"] * n,
            "sliding_window": window,
            "sliding_window_non_causal": bool(window) and
            model.dflash_draft_attention == "bidirectional",
            "sample_from_anchor": False,
            "state_dict": state,
        }


candidate = ModelOptCandidate()
