"""Two bugs at once, as ModelOpt's DFlash loss has them: soft cross-entropy (KL + H(p)) where
the profile says ``kl_div``, divided by the sum of the per-slot weights (``sum(w) + 1e-6``,
``hf_dflash.py`` ``_compute_loss``) instead of the number of supervised tokens.

Expected audit result: ``loss`` fails naming both: "soft cross-entropy -sum p log q ..." and
"loss normalised by the sum of weights instead of the number of supervised tokens".

Run: ``dflash-audit compare --candidate examples/candidates/soft_ce_weight_sum.py:candidate``
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _sibling(name):
    """Another example of this folder, by file name (the folder is not a package)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"dflash_audit_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


soft = _sibling("soft_ce")
three = _sibling("three_causes")  # its loss over the sum of weights


class SoftCEWeightSumCandidate(soft.SoftCECandidate):
    name = "bugs: soft cross-entropy + loss over the sum of weights"

    def run_case(self, config, loss, weights, inputs):
        import dflash_audit.candidate as candidate_module

        with three.patched(candidate_module, "dflash_loss", three.over_weight_sum):
            return super().run_case(config, loss, weights, inputs)


candidate = SoftCEWeightSumCandidate()
