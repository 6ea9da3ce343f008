"""Bug: targets from post-norm states (the verifier's final norm applied twice).

The verifier's last hidden state is taken *after* its final norm (e.g. Hugging Face
``output_hidden_states[-1]``) and the drafter then applies ``verifier_norm`` again:
``verifier_lm_head(verifier_norm(verifier_norm(x)))``.

Expected audit result: ``targets`` fails with the diagnosis "targets from post-norm states:
the verifier's final norm is applied twice"; ``loss`` / ``gradients`` fail as consequences.

Run: ``dflash-audit compare --candidate examples/candidates/targets_post_norm.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter


class PostNormTargetsDrafter(DFlashDrafter):
    """Our drafter whose verifier states arrive already normed."""

    @torch.no_grad()
    def targets(self, verifier_last_hidden_states, indices):
        return super().targets(self.verifier_norm(verifier_last_hidden_states), indices)


class PostNormTargetsCandidate(DrafterCandidate):
    name = "bug: targets from post-norm states (double norm)"

    def build(self, config):
        return PostNormTargetsDrafter(config)


candidate = PostNormTargetsCandidate()
