"""Bug: position decay disabled (``gamma`` left unset: every supervised slot weighs 1).

The reference weights slot s of a block by ``exp(-(s-1)/gamma)`` (gamma 4: later slots, which
the drafter rarely reaches at inference, count less). This candidate leaves gamma unset and
weights every supervised slot 1, and reports ``gamma = None`` as its default.

Expected audit result: ``loss`` fails (per-slot weights) with the diagnosis "no position decay
(w_s = 1); reference exp(-(s-1)/4)"; ``defaults`` warns that the candidate's gamma is None;
``gradients`` fail as a consequence; everything before the loss passes.

Run: ``dflash-audit compare --candidate examples/candidates/no_decay.py:candidate``
"""

from __future__ import annotations

import dataclasses

from dflash_audit.candidate import DrafterCandidate


class NoDecayCandidate(DrafterCandidate):
    name = "bug: no position decay (gamma unset)"

    def run_case(self, config, loss, weights, inputs):
        # gamma = inf: exp(-(s-1)/inf) = 1 for every trained slot, slot 0 still masked out
        out = super().run_case(config, dataclasses.replace(loss, gamma=float("inf")), weights,
                               inputs)
        out.defaults["gamma"] = None
        return out


candidate = NoDecayCandidate()
