"""Bug: targets that are the data tokens (hard labels) instead of the verifier's prediction.

SpecForge (and ModelOpt without ``dflash_self_logit_distillation``) teach slot s of a block the
data token ``input_ids[a+s]`` with a hard cross-entropy (``dflash_family_model.py``); the
reference distils the verifier's distribution at the previous position,
``verifier_lm_head(verifier_norm(verifier_last_hidden_states[a+s-1]))`` (speculators
``models/dflash/core.py``). This candidate returns its hard labels as one-hot target logits (0 at
the label, -1e4 elsewhere: the profile's KL against them is that cross-entropy), and its
accuracy is then measured against the data tokens too.

Expected audit result: ``targets`` fails with "targets are the data tokens input_ids[a+s], not
the verifier's prediction at a+s-1 ... (hard labels: one-hot targets ...)"; ``loss`` and ``gradients`` follow from the targets difference.

Run: ``dflash-audit compare --candidate examples/candidates/targets_data_tokens.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter

HARD = 1e4  # a one-hot distribution as logits: 0 at the label, -HARD elsewhere


class DataTokenTargetsDrafter(DFlashDrafter):
    """Our drafter whose targets are one-hot logits of input_ids[a+s]."""

    def forward(self, **inputs):
        self._input_ids = inputs["input_ids"]
        return super().forward(**inputs)

    @torch.no_grad()
    def targets(self, verifier_last_hidden_states, indices):
        T, V = self._input_ids.shape[-1], self.lm_head.out_features
        tokens = self._input_ids[0, indices % T].long()
        if self.d2t is not None:  # verifier id -> draft index (0 when not in the draft vocab)
            inverse = torch.zeros(self.config.vocab_size, dtype=torch.long)
            inverse[torch.arange(V) + self.d2t] = torch.arange(V)
            tokens = inverse[tokens]
        onehot = torch.nn.functional.one_hot(tokens, V).float()
        return ((onehot - 1.0) * HARD)[None]


class DataTokenTargetsCandidate(DrafterCandidate):
    name = "bug: targets are the data tokens (hard labels)"

    def build(self, config):
        return DataTokenTargetsDrafter(config)


candidate = DataTokenTargetsCandidate()
