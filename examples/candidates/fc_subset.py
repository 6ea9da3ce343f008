"""Bug: ``fc`` fed n-1 of the n captured target layers.

``fc`` is ``Linear((n-1)*H, H)`` and reads only the first n-1 target-layer slices of
``hidden_states`` (the last target layer is dropped); its loader keeps the matching columns of
the reference's ``fc.weight``. A real case: ``Linear(4*H, H)`` where the reference has
``Linear(5*H, H)`` (DESIGN.md sec. 1).

Expected audit result: ``structure`` fails (fc_in_features (n-1)*H vs n*H, fc.weight shape),
``context`` fails with the diagnosis "fc fed n-1 of n target layers" naming the missing layer;
``logits`` / ``loss`` / ``gradients`` fail as consequences.

Run: ``dflash-audit compare --candidate examples/candidates/fc_subset.py:candidate``
"""

from __future__ import annotations

from torch import nn

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter


class FcSubsetDrafter(DFlashDrafter):
    """Our drafter with ``fc`` over the first n-1 target layers only."""

    def __init__(self, config):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear((config.num_target_layers - 1) * H, H, bias=False)

    def context(self, hidden_states):
        return self.hidden_norm(self.fc(hidden_states[..., : self.fc.in_features]))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        state_dict = dict(state_dict)
        state_dict["fc.weight"] = state_dict["fc.weight"][:, : self.fc.in_features]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class FcSubsetCandidate(DrafterCandidate):
    name = "bug: fc fed n-1 of n target layers"

    def build(self, config):
        return FcSubsetDrafter(config)


candidate = FcSubsetCandidate()
