"""The gamma-7 candidate (examples/candidates/gamma7.py), shared by the hostile candidates."""

from __future__ import annotations

import dataclasses

from dflash_audit.candidate import DrafterCandidate


class Gamma7(DrafterCandidate):
    name = "hostile: decay gamma 7.0"

    def run_case(self, config, loss, weights, inputs):
        out = super().run_case(config, dataclasses.replace(loss, gamma=7.0), weights, inputs)
        out.defaults["gamma"] = 7.0
        return out
