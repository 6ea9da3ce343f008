"""Bug: under D-PACE weighting, the loss divided by the sum of the D-PACE weights.

ModelOpt's default objective is D-PACE, and its loss is ``sum(l*w) / (sum(w) + 1e-6)``
(``hf_dflash.py`` ``_compute_loss``); the reference divides by the number of supervised tokens,
``sum(m) + 1e-5``, under every weighting (speculators ``losses/utils.py``). Needs a D-PACE
profile (``--profile reference-train-cli``).

Expected audit result: ``loss`` fails with "loss normalised by the sum of weights instead of the
number of supervised tokens"; the weights themselves pass.

Run: ``dflash-audit compare --profile reference-train-cli
--candidate examples/candidates/dpace_weight_sum.py:candidate``
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import dflash_audit.candidate as candidate_module
from dflash_audit.candidate import DrafterCandidate


def _sibling(name):
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"dflash_audit_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


three = _sibling("three_causes")  # its loss over the sum of weights


class DPaceWeightSumCandidate(DrafterCandidate):
    name = "bug: D-PACE loss over the sum of weights"

    def run_case(self, config, loss, weights, inputs):
        with three.patched(candidate_module, "dflash_loss", three.over_weight_sum):
            return super().run_case(config, loss, weights, inputs)


candidate = DPaceWeightSumCandidate()
