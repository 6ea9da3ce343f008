"""What NeMo Automodel 0.7.0 would do on input it cannot express: the ``LATENT`` of
:mod:`.nemo_adapter` (:mod:`.latent`), one entry per capability its ``CAPABILITIES`` lack,
each citing ``nemo-automodel==0.7.0``'s own lines (checked against the installed wheel by
tests/test_framework_latent.py)."""

from __future__ import annotations

_DF = "nemo_automodel/components/speculative/dflash"
LATENT: list[dict[str, str]] = [
    {"capability": "layouts",
     "would": "builds one attention mask with the trainer's single sliding_window for every "
              "draft layer: a mixed full / sliding layout would window every layer (or none)",
     "source": f"{_DF}/core.py:527", "shows": "sliding_window=self.sliding_window"},
    {"capability": "verifier_families",
     "would": "builds a DFlash draft only for its registered target architectures (Qwen3, "
              "Qwen3.5, Kimi K3): a verifier of any other family is refused with ValueError",
     "source": f"{_DF}/registry.py:145",
     "shows": "no DFlash draft spec registered for any of"},
    {"capability": "weightings",
     "would": "has no D-PACE weighting: loss_type is 'dflash' (with or without a fixed "
              "exponential decay) or 'variable_prefix', anything else is refused with ValueError",
     "source": f"{_DF}/core.py:190", "shows": "loss_type must be one of"},
    {"capability": "draft_vocab",
     "would": "has no draft vocabulary (no t2d / d2t): the draft's logits come from the "
              "target's own lm_head over the full vocabulary V",
     "source": f"{_DF}/core.py:566", "shows": "compute_logits(output_hidden, self.lm_head)"},
    {"capability": "sample_from_anchor",
     "would": "teaches block position k the data token input_ids[a+k] whatever "
              "sample_from_anchor says: a sample_from_anchor=True recipe (slot s taught the "
              "token after a+s) would be trained one token early",
     "source": f"{_DF}/core.py:424",
     "shows": "label_indices = anchor_positions.unsqueeze(-1) + label_offsets"},
    {"capability": "dtypes",
     "would": "casts the draft model to bfloat16 on CUDA (float32 on CPU) in its recipe: its "
              "trainable parameters are then bf16, and whether an fp32 master copy exists is "
              "up to the optimizer it is given (the audit runs its step in fp32)",
     "source": "nemo_automodel/recipes/llm/train_dflash.py:327",
     "shows": ".to(device=self.device, dtype=self.compute_dtype)"},
    {"capability": "embedding_layer",
     "would": "captures decoder-layer outputs only (z-lab ids 0..N-1): the reference's id 0, "
              "the embedding output (z-lab id -1), is refused with ValueError",
     "source": f"{_DF}/target.py:123", "shows": "if layer_id < 0 or layer_id >= num_layers"},
]
