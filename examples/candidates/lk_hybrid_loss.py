"""Bug: the LK hybrid loss where the profile (and the reference) train with ``kl_div``.

``lk_hybrid`` mixes KL with an overlap term weighted by how much the drafter already agrees with
the verifier. At random initialisation that overlap is about 0, the mix is almost pure KL, and
the two losses are numerically equal: an audit on untrained weights alone would pass this
candidate. The audit's real cases therefore run on trainable weights briefly fitted to the
targets (``dflash_audit.audit.cases.weights.fit_to_targets``), where the two differ.

Expected audit result: ``loss`` fails with the diagnosis "loss computed as 'lk_hybrid'";
``gradients`` fail as a consequence; everything before the loss passes.

Run: ``dflash-audit compare --candidate examples/candidates/lk_hybrid_loss.py:candidate``
"""

from __future__ import annotations

import dataclasses

from dflash_audit.candidate import DrafterCandidate


class LkHybridCandidate(DrafterCandidate):
    name = "bug: lk_hybrid loss instead of kl_div"

    def run_case(self, config, loss, weights, inputs):
        return super().run_case(config, dataclasses.replace(loss, loss="lk_hybrid"), weights,
                                inputs)


candidate = LkHybridCandidate()
