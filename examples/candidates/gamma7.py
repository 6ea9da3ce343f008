"""Bug: loss decay ``gamma = 7.0`` hard-coded where the reference (and the profile) use 4.0.

Per-slot weights become ``exp(-(s-1)/7)`` instead of ``exp(-(s-1)/4)``: later slots are
over-weighted. The candidate also reports 7.0 as its default.

Expected audit result: ``loss`` fails (per-slot weights; implied gamma 7 vs 4) with the
diagnosis "decay gamma 7 (fitted from the weights), reference 4"; ``gradients`` fail as a
consequence; ``defaults`` warns; everything before the loss passes.

Run: ``dflash-audit compare --candidate examples/candidates/gamma7.py:candidate``
"""

from __future__ import annotations

import dataclasses

from dflash_audit.candidate import DrafterCandidate

GAMMA = 7.0


class Gamma7Candidate(DrafterCandidate):
    name = "bug: decay gamma 7.0"

    def run_case(self, config, loss, weights, inputs):
        out = super().run_case(config, dataclasses.replace(loss, gamma=GAMMA), weights, inputs)
        out.defaults["gamma"] = GAMMA
        return out


candidate = Gamma7Candidate()
