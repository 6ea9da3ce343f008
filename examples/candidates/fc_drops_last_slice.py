"""Bug: the last target-layer slice dropped before ``fc``, which then raises on the shapes.

``fc`` is the reference's ``Linear(n*H, H)``, but the context is computed from
``hidden_states[..., :(n-1)*H]`` (an off-by-one slice of the concatenated target layers), so the
forward raises torch's "mat1 and mat2 shapes cannot be multiplied". A real report: ``ValueError:
hidden_states has 1152 features, fc expects 1728``.

Expected audit result: the ``run`` row fails (a raise is a conformance failure) with the
diagnosis "fc expects n target layers (...), the candidate passed n-1 (...): 1 target-layer
slice(s) dropped before fc".

Run: ``dflash-audit compare --candidate examples/candidates/fc_drops_last_slice.py:candidate``
"""

from __future__ import annotations

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.drafter import DFlashDrafter


class DropsLastSliceDrafter(DFlashDrafter):
    """Our drafter reading the first n-1 target-layer slices into the full-width fc."""

    def context(self, hidden_states):
        H = self.fc.out_features
        return self.hidden_norm(self.fc(hidden_states[..., : self.fc.in_features - H]))


class DropsLastSliceCandidate(DrafterCandidate):
    name = "bug: last target-layer slice dropped before fc (raises)"

    def build(self, config):
        return DropsLastSliceDrafter(config)


candidate = DropsLastSliceCandidate()
