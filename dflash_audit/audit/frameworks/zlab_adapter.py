"""z-lab ``dflash`` 0.1.0 as the candidate: z-lab's own draft model (``dflash/model.py``) driven
the way its inference drives it, with what a training step needs around it supplied by the
adapter (``--candidate dflash_audit/audit/frameworks/zlab_adapter.py:candidate``).

z-lab's package is inference only (research: no loss, no targets, no anchor sampler, no
training mask). What is z-lab's and what is the adapter's, per output (:data:`PROVENANCE`):

* z-lab's: the draft forward ``DFlashDraftModel.forward`` (fc, hidden_norm, the layers, RoPE,
  the final norm), so the ``context`` (recorded by a hook on its ``hidden_norm``) and the
  ``logits`` (its ``compute_logits``: ``output_multiplier`` and the tanh softcap it reads from
  the config); the mask of its sliding layers, ``_attention_mask`` (causal and
  ``query_pos - key_pos < W``, ``dflash/model.py:157-171``), recorded as it returns it; the
  noise block's embedding ``_raw_input_embeddings`` (times ``input_embedding_scale``).
* the adapter's: the anchors (injected), one z-lab call per valid anchor laid out as z-lab's
  ``dflash_generate`` lays out a drafting step (context = the anchor's document up to a - 1,
  block = ``[input_ids[a], mask, ..., mask]`` at positions ``a .. a+B-1``), which is the
  full-attention mask (z-lab builds none there: its full layers see every key it is given);
  the targets, aligned loss mask, loss, its per-slot weights and the metrics (our
  reference-conformant :mod:`dflash_audit.model` pieces), so the gradients are those of
  z-lab's forward under the adapter's loss; the derivation (z-lab derives nothing from a
  verifier: ``derive_config`` reports our derivation as z-lab's modules read it).

The adapter writes the profile's drafter config as the Qwen3Config z-lab reads (research 4.9:
``num_target_layers``, ``dflash_config.{target_layer_ids (z-lab ids = ours - 1), block_size,
mask_token_id}``, ``layer_types``, ``sliding_window``, ``is_causal`` for a non-causal window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.frameworks.kit import (
    record_calls,
    record_outputs,
    state_dict_entries,
)
from dflash_audit.model.config import SLIDING_ATTENTION, DFlashConfig
from dflash_audit.model.drafter import (
    aligned_loss_mask,
    block_indices,
    verifier_targets,
)
from dflash_audit.model.derivation import rotary_fields
from dflash_audit.model.layer_ids import from_zlab_ids, to_zlab_ids
from dflash_audit.model.layers import RMSNorm
from dflash_audit.model.loss import (
    LossSpec,
    data_target_ids,
    dflash_loss,
    uses_data_targets,
)
from dflash_audit.model.metrics import dflash_metrics

NAME = "z-lab dflash"
VERSION = "0.1.0"
REQUIREMENTS = ["dflash==0.1.0"]
#: The framework modules run_case imports: imported when the candidate loads.
FRAMEWORK_MODULES = ["dflash.model"]
#: What the adapter can audit z-lab on (keys of ``frameworks.capabilities.Capabilities``;
#: None = all). Packed rows: each block's context is its own document's prefix, as z-lab
#: drafts one sequence; a non-causal window through ``is_causal = False``; no draft vocabulary
#: (z-lab drafts with the target's own head); slot 0 is never drafted (it holds the last
#: accepted token), so no sample_from_anchor; losses and weightings are the adapter's.
CAPABILITIES: dict[str, Any] = {
    "packed_rows": True,
    "layouts": ["full", "sliding", "mixed"],
    "block_attention": ["causal", "non_causal"],
    "verifier_families": None,
    "draft_vocab": False,
    "losses": None,
    "weightings": None,
    "sample_from_anchor": False,
    "dtypes": ["fp32", "bf16"],
}
#: What z-lab would do, serving a drafter, on what it cannot express (:mod:`.latent`; checked
#: against the installed wheel by tests/test_framework_latent.py).
LATENT: list[dict[str, str]] = [
    {"capability": "draft_vocab",
     "would": "drafts with the target's own output head: no draft vocabulary (t2d / d2t), so "
              "a drafter trained on a reduced vocabulary cannot be served there",
     "source": "dflash/model.py:260",
     "shows": "draft_logits = model.compute_logits(draft_hidden, _output_head(target))"},
    {"capability": "sample_from_anchor",
     "would": "drafts from slots 1..B-1 only and writes slot s's token at position a+s: a "
              "drafter trained with sample_from_anchor=True (slot s predicts the token after "
              "a+s) would have each draft placed one position early and its slot 0 discarded",
     "source": "dflash/model.py:243-249", "shows": "[:, 1 - verify_size :, :]"},
]
#: Who computes each output (see the module docstring).
PROVENANCE: dict[str, str] = {
    "context": "framework",
    "logits": "framework",
    "mask.sliding_attention": "framework",
    "mask.full_attention": "adapter",
    "targets": "adapter",
    "target_ids": "adapter",
    "aligned_loss_mask": "adapter",
    "loss": "adapter",
    "loss_weights.": "adapter",
    "grad.": "adapter",
    "metrics": "adapter",
    "derivation": "adapter",
}
#: Case weights z-lab's draft model holds (the rest are the target's, or the adapter's).
ZLAB_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.")


def zlab_config(config: DFlashConfig):
    """The Qwen3Config z-lab's ``DFlashDraftModel`` is built from for ``config`` (adapter; the
    keys z-lab reads, research 4.9). z-lab ids are ours - 1 (it reads
    ``hidden_states[id + 1]``, ``dflash/model.py:37-43``)."""
    from transformers import Qwen3Config

    types = list(config.effective_layer_types)
    sliding = SLIDING_ATTENTION in types
    zc = Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        attention_bias=config.attention_bias, hidden_act=config.hidden_act,
        rope_parameters={"rope_type": "default", **(config.rope_parameters or {}),
                         "rope_theta": config.rope_theta},
        layer_types=types, sliding_window=config.sliding_window if sliding else None,
        use_sliding_window=sliding)
    zc.num_target_layers = config.num_verifier_layers
    zc.dflash_config = {"target_layer_ids": to_zlab_ids(config.target_layer_ids),
                        "block_size": config.block_size, "mask_token_id": config.mask_token_id}
    if sliding and config.sliding_window_non_causal:
        zc.is_causal = False  # z-lab: every layer non-causal (its full layers already are)
    return zc


class _Target(nn.Module):
    """The frozen target pieces z-lab's inference takes from the target model: its input
    embedding (``get_input_embeddings``) and ``lm_head`` (``dflash/model.py:135-143``)."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


def _structure(model: nn.Module, config: DFlashConfig, target: _Target) -> dict[str, Any]:
    """The structure summary of z-lab's built model (its own values, ids back in ours)."""
    attn = [layer.self_attn for layer in model.layers]
    types = [SLIDING_ATTENTION if a.sliding_window is not None else "full_attention"
             for a in attn]
    windows = {a.sliding_window for a in attn if a.sliding_window is not None}
    state = state_dict_entries(model, {"embed_tokens.weight": target.embed_tokens.weight,
                                       "lm_head.weight": target.lm_head.weight})
    return {"fc_in_features": model.fc.in_features, "fc_out_features": model.fc.out_features,
            "target_layer_ids": from_zlab_ids(model.target_layer_ids),
            "block_size": int(model.block_size), "mask_token_id": model.mask_token_id,
            "layer_types": types, "sliding_window": min(windows) if windows else None,
            "sliding_window_non_causal": any(not a.is_causal for a in attn
                                             if a.sliding_window is not None),
            "sample_from_anchor": False, "state_dict": state}


def _zlab_defaults() -> dict[str, Any]:
    """z-lab's own defaults: ``block_size`` 16 when a config names none (read off a model
    built without one, ``dflash/model.py:569``); it has no loss, gamma or weighting."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    zc = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    zc.num_target_layers, zc.dflash_config = 4, {"target_layer_ids": [1], "mask_token_id": 0}
    return {"block_size": int(DFlashDraftModel(zc).block_size)}


def _place(mask: torch.Tensor, rows: slice, start: int, ctx: int, T: int, j: int, B: int,
           out: torch.Tensor) -> None:
    """Write one z-lab call's [B, ctx + B] mask into block j's rows of the [Q, T+Q] mask."""
    out[rows, start:start + ctx] = mask[:, :ctx]
    out[rows, T + j * B:T + (j + 1) * B] = mask[:, ctx:]


class ZLabCandidate:
    """z-lab's draft model as the candidate (see the module docstring)."""

    name = f"{NAME} {VERSION}"

    def derive_config(self, verifier_config: Any, config: DFlashConfig) -> dict[str, Any]:
        """What z-lab's model reads from the config the adapter writes for ``verifier_config``
        (z-lab derives nothing from a verifier: our derivation fills the architecture,
        :func:`zlab_config` writes it, and these are the values z-lab's attention, norms and
        ``Qwen3RotaryEmbedding(config)`` then run with)."""
        from dflash.model import Qwen3DFlashAttention
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        from dflash_audit.model.derivation import rederive

        zc = zlab_config(rederive(verifier_config, config))
        rotary = Qwen3RotaryEmbedding(zc)
        attn = [Qwen3DFlashAttention(zc, i) for i in range(zc.num_hidden_layers)]
        rope = dict(zc.rope_parameters)
        windows = [a.sliding_window for a in attn if a.sliding_window is not None]
        return {
            "hidden_size": zc.hidden_size, "intermediate_size": zc.intermediate_size,
            "num_attention_heads": zc.num_attention_heads,
            "num_key_value_heads": zc.num_key_value_heads, "head_dim": attn[0].head_dim,
            "rms_norm_eps": zc.rms_norm_eps, "hidden_act": zc.hidden_act,
            "attention_bias": bool(zc.attention_bias),
            "layer_types": [SLIDING_ATTENTION if a.sliding_window is not None
                            else "full_attention" for a in attn],
            "sliding_window": windows[0] if windows else None,
            "rope_theta": float(rope["rope_theta"]), "rope_type": rope.get("rope_type"),
            **rotary_fields(rotary),
            "mask_token_id": zc.dflash_config["mask_token_id"],
        }

    def run_case(self, config: DFlashConfig, loss: LossSpec, weights: dict[str, torch.Tensor],
                 inputs: dict[str, torch.Tensor]) -> SideOutputs:
        """One training step: z-lab's forward once per valid anchor, the adapter's loss,
        backward through z-lab's parameters.

        Raises:
            ValueError: a draft vocabulary or sample_from_anchor (outside
                :data:`CAPABILITIES`).
        """
        import dflash.model as zm

        if config.uses_draft_vocab or config.sample_from_anchor:
            raise ValueError("z-lab dflash 0.1.0 has no draft vocabulary (it drafts with the "
                             "target's lm_head) and never drafts slot 0 (sample_from_anchor): "
                             "not supported")
        device = inputs["input_ids"].device
        model = zm.DFlashDraftModel(zlab_config(config)).float().to(device)
        model.load_state_dict({k: v for k, v in weights.items() if k.startswith(ZLAB_PREFIXES)},
                              strict=True)
        model.train()
        target = _Target(weights["embed_tokens.weight"], weights["lm_head.weight"]).to(device)
        scale = float(zm._draft_value(model.config, "input_embedding_scale", 1.0))  # noqa: SLF001
        B, mask_id = int(model.block_size), int(model.mask_token_id)
        hs, ids, pos = inputs["hidden_states"], inputs["input_ids"], inputs["position_ids"]
        doc = inputs["document_ids"].reshape(-1)
        anchors, valid = inputs["anchor_positions"].long(), inputs["anchor_valid"].bool()
        T, A, H = ids.shape[1], anchors.numel(), config.hidden_size
        Q = A * B
        logits = torch.zeros(1, Q, config.vocab_size, device=device)
        context = torch.zeros(1, T, H, device=device)
        masks = {t: torch.zeros(Q, T + Q, dtype=torch.bool, device=device)
                 for t in dict.fromkeys(config.effective_layer_types)}
        pieces = []
        for j in range(A):
            if not bool(valid[j]):
                continue  # a padding anchor: z-lab drafts no block for it
            a = int(anchors[j])
            start = int((doc[:a + 1] == doc[a]).nonzero()[0])  # the anchor's document start
            block = torch.full((1, B), mask_id, dtype=torch.long, device=device)
            block[0, 0] = ids[0, a]
            noise = zm._raw_input_embeddings(target, block, scale)  # noqa: SLF001
            positions = torch.cat([pos[0, start:a], pos[0, a] + torch.arange(B, device=device)])
            with record_calls(zm, "_attention_mask") as built, \
                    record_outputs(model.hidden_norm) as ctx:
                hidden = model(position_ids=positions[None].long(), attention_mask=None,
                               noise_embedding=noise, target_hidden=hs[:, start:a])
            pieces.append((j, model.compute_logits(hidden, zm._output_head(target))))  # noqa: SLF001
            context[0, start:a] = ctx[0][0].detach()
            rows = slice(j * B, (j + 1) * B)
            if built:  # z-lab's own sliding mask, [1, 1, B, ctx + B]
                _place(built[0].result[0, 0], rows, start, a - start, T, j, B,
                       masks[SLIDING_ATTENTION])
            if "full_attention" in masks:  # no mask from z-lab: every key it was given
                _place(torch.ones(B, a - start + B, dtype=torch.bool, device=device), rows,
                       start, a - start, T, j, B, masks["full_attention"])
        if pieces:
            index = torch.cat([torch.arange(j * B, (j + 1) * B) for j, _ in pieces]).to(device)
            logits = logits.index_copy(1, index, torch.cat([p for _, p in pieces], dim=1))
        idx = block_indices(anchors, B)
        norm = RMSNorm(H, config.rms_norm_eps, config.verifier_norm_one_plus_weight).to(device)
        norm.weight.data.copy_(weights["verifier_norm.weight"])
        head = nn.Linear(H, config.vocab_size, bias=False).to(device)
        head.weight.data.copy_(weights["verifier_lm_head.weight"])
        targets = verifier_targets(inputs["verifier_last_hidden_states"], idx, norm, head)
        m = aligned_loss_mask(inputs["loss_mask"], idx, valid, B)
        tids = data_target_ids(ids, idx)
        result = dflash_loss(logits, targets, m, B, loss, target_ids=tids)
        result.loss.backward()
        tensors = {"context": context, "logits": logits.detach().float(),
                   "targets": targets.detach().float(), "aligned_loss_mask": m,
                   "loss": result.loss.detach().reshape(()),
                   **{f"mask.{k}": v for k, v in masks.items()},
                   **{f"loss_weights.{k}": w.detach().float() for k, w in result.weights.items()},
                   **{f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}}
        if uses_data_targets(loss.loss):
            tensors["target_ids"] = tids
        metrics = dflash_metrics(logits.detach(), targets, m, B)
        metrics["loss_sum"], metrics["loss_total"] = float(result.loss.detach()), 1.0
        return SideOutputs(tensors=tensors, metrics=metrics,
                           structure=_structure(model, config, target),
                           trainable=[n for n, p in model.named_parameters() if p.requires_grad],
                           defaults=_zlab_defaults())


candidate = ZLabCandidate()


def read_run_config(path: str | Path) -> dict[str, Any]:
    """Every key of a z-lab ``config.json`` (a file or its folder) that changes what z-lab's
    drafter computes or serves, as z-lab reads it (``dflash_config`` first, then the top
    level, then its default): :func:`dflash_audit.profile_import.zlab_run_config`.

    Raises:
        ValueError: unreadable, not JSON, not a z-lab config, or a key given both in
            ``dflash_config`` and at the top level with different values (named).
    """
    from dflash_audit.profile_import import read_config_json, zlab_run_config

    d, file = read_config_json(path, "z-lab config")
    return zlab_run_config(d, str(file))
