"""Bug: under D-PACE weighting, the loss divided by the batch size.

SpecForge's ``loss_type="dpace"`` reduces ``sum(ce * m * w_dpace) / bsz``
(``dflash_family_model.py``); the reference divides by the number of supervised tokens,
``sum(m) + 1e-5`` (speculators ``losses/utils.py``). One packed row: the plain weighted sum.
Needs a D-PACE profile (``--profile reference-train-cli``).

Expected audit result: ``loss`` fails with "loss divided by the batch size (1 row: the weighted
sum of per-token losses) instead of the number of supervised tokens".

Run: ``dflash-audit compare --profile reference-train-cli
--candidate examples/candidates/dpace_batch_size.py:candidate``
"""

from __future__ import annotations

import contextlib

import dflash_audit.candidate as candidate_module
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.loss import LOSSES, parse_loss

BATCH_SIZE = 1  # one packed row per step


def over_batch_size(dflash_loss):
    def loss(logits, targets, aligned_loss_mask, block_size, spec, sample_from_anchor=False,
             target_ids=None):
        result = dflash_loss(logits, targets, aligned_loss_mask, block_size, spec,
                             sample_from_anchor)
        m = aligned_loss_mask.float()
        result.loss = sum(coef * (LOSSES[name](logits, targets) * m * result.weights[name]).sum()
                          for name, coef in parse_loss(spec.loss).items()) / BATCH_SIZE
        return result
    return loss


@contextlib.contextmanager
def reduced_over_batch():
    original = candidate_module.dflash_loss
    candidate_module.dflash_loss = over_batch_size(original)
    try:
        yield
    finally:
        candidate_module.dflash_loss = original


class DPaceBatchSizeCandidate(DrafterCandidate):
    name = "bug: D-PACE loss divided by the batch size"

    def run_case(self, config, loss, weights, inputs):
        with reduced_over_batch():
            return super().run_case(config, loss, weights, inputs)


candidate = DPaceBatchSizeCandidate()
