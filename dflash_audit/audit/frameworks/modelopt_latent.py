"""What NVIDIA ModelOpt 0.47.0 would do on input it cannot express: the ``LATENT`` of
:mod:`.modelopt_adapter` (:mod:`.latent`), one entry per capability its ``CAPABILITIES`` lack,
each citing ``nvidia-modelopt==0.47.0``'s own lines (checked against the installed wheel by
tests/test_framework_latent.py)."""

from __future__ import annotations

_SPEC = "modelopt/torch/speculative"
#: ``hf_dflash.py``: its DFlash trainer (anchors, mask, positions, loss).
_HF = f"{_SPEC}/plugins/hf_dflash.py"
LATENT: list[dict[str, str]] = [
    {"capability": "packed_rows",
     "would": "has no document mask: on a packed row a block's context is every position "
              "before its anchor, so attention would leak across documents (the reference "
              "keeps the anchor's own document)",
     "source": f"{_HF}:705", "shows": "mask_ctx = (kv_indices < seq_len) & (kv_indices < "
                                      "anchor_exp)"},
    {"capability": "packed_rows",
     "would": "has no per-document positions: context positions are arange(T) and block "
              "positions a+s, so on a packed row RoPE positions would run on across documents "
              "instead of restarting at 0 in each",
     "source": f"{_HF}:672", "shows": "ctx_pos = torch.arange(seq_len, device=device)"},
    {"capability": "any_target_layer_count",
     "would": "takes exactly one target layer per draft layer: a drafter with another number "
              "of target layers than draft layers is refused (ValueError), so a recipe of n "
              "target layers needs n draft layers there",
     "source": f"{_HF}:457-461", "shows": "one target layer per draft layer is required"},
    {"capability": "layouts",
     "would": "builds one attention mask for every draft layer (windowed by "
              "dflash_swa_window_size or not at all): a mixed layout would run its full and "
              "sliding layers under the same mask",
     "source": f"{_HF}:1027-1035", "shows": "window=self.dflash_swa_window_size"},
    {"capability": "window_below_block",
     "would": "refuses a sliding window smaller than the block (ValueError: "
              "dflash_swa_window_size must be >= dflash_block_size)",
     "source": f"{_SPEC}/config.py:292-294", "shows": "must be >= "},
    {"capability": "verifier_families",
     "would": "re-applies the verifier's final norm only for the model types it lists: for "
              "another family a pre-norm capture is refused (RuntimeError) and only a "
              "post-norm capture trains",
     "source": f"{_SPEC}/plugins/modeling_final_norm.py:135-136",
     "shows": "if base_model_norm is None:"},
    {"capability": "draft_vocab",
     "would": "has no draft vocabulary (no t2d / d2t): the draft's logits are the base "
              "model's lm_head over the full vocabulary V, so a reduced draft vocabulary "
              "cannot be trained",
     "source": f"{_HF}:1046", "shows": "logits = self._base_model_lm_head(hidden)"},
    {"capability": "separate_draft_head",
     "would": "computes the draft's logits with the base model's own lm_head: a draft head "
              "that differs from the verifier's cannot be given (teacher and draft share one)",
     "source": f"{_HF}:1046", "shows": "logits = self._base_model_lm_head(hidden)"},
    {"capability": "losses",
     "would": "has two losses only, soft cross-entropy against its teacher -sum p log q or "
              "hard cross-entropy against the data token: another divergence (rkl, jsd, tv, "
              "nla, lk_hybrid) cannot be configured",
     "source": f"{_HF}:856", "shows": "kd_loss = -(target_soft * draft_logsoft).sum(dim=-1)"},
    {"capability": "loss_mixes",
     "would": "computes one loss term: a mix of loss terms cannot be configured",
     "source": f"{_HF}:856-857", "shows": "loss = (kd_loss * flat_weights).sum() / "
                                          "valid_count"},
    {"capability": "sample_from_anchor",
     "would": "teaches slot s the teacher at a+s-1 and the data token input_ids[a+s] whatever "
              "the recipe: under sample_from_anchor=True (the reference teaches the "
              "prediction at a+s) every slot would be taught one position early",
     "source": f"{_HF}:846-847", "shows": "teacher logits for token anchor+k are at position "
                                          "anchor+k-1"},
    {"capability": "embedding_layer",
     "would": "numbers target layers from the first decoder layer (forward reads "
              "hidden_states[lid + 1]) and refuses negative ids (ValueError): the reference's "
              "id 0, the embedding output, cannot be given",
     "source": f"{_HF}:474-478", "shows": "must be non-negative base-layer indices"},
]
