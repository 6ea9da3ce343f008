"""Bug: targets from the last *target* layer instead of the verifier's last layer.

The targets are ``verifier_lm_head(verifier_norm(x))`` with x the last target-layer slice of
``hidden_states`` instead of ``verifier_last_hidden_states``: a proxy distribution some layers
short of the real one. With the z-lab default ids of a 30-layer verifier
(``default_target_layer_ids(30)`` = [2, 9, 15, 21, 28]) that is layer 28 = N-2; the real case
in DESIGN.md sec. 1 used layer 61 of a 64-layer verifier.

Expected audit result: ``targets`` fails with the diagnosis "targets from target layer L
(hidden_states slice i), not the verifier's last layer N"; ``loss`` / ``gradients`` fail as
consequences; ``context``, ``mask`` and ``logits`` pass.

Run: ``dflash-audit compare --candidate examples/candidates/targets_from_target_layer.py:candidate``
"""

from __future__ import annotations

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter


class TargetLayerTargetsDrafter(DFlashDrafter):
    """Our drafter fed the last target layer where the verifier's last layer belongs."""

    def forward(self, hidden_states, input_ids, loss_mask, verifier_last_hidden_states,
                document_ids, position_ids, anchor_positions, anchor_valid):
        last_target_layer = hidden_states[..., -self.config.hidden_size:]
        return super().forward(hidden_states, input_ids, loss_mask, last_target_layer,
                               document_ids, position_ids, anchor_positions, anchor_valid)


class TargetLayerTargetsCandidate(DrafterCandidate):
    name = "bug: targets from the last target layer, not layer N"

    def build(self, config):
        return TargetLayerTargetsDrafter(config)


candidate = TargetLayerTargetsCandidate()
