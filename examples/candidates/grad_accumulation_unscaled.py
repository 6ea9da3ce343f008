"""Bug: gradient accumulation over micro-batches without dividing the loss by their number.

The step accumulates ``ACCUMULATION_STEPS = 2`` micro-batch backwards (here the same batch, so
the one-step audit sees it) and logs the mean loss, but calls ``backward()`` on the unscaled
loss each time: every gradient is 2x what the reference's step gives, while the loss it
reports is right. AdamW hides much of a constant factor; SGD, gradient clipping at 1.0 and the
learning-rate schedule do not.

Expected audit result: ``gradients`` fails with the diagnosis "gradients scaled by 2";
everything upstream (context, masks, targets, logits, loss) passes.

Run:
``dflash-audit compare --candidate examples/candidates/grad_accumulation_unscaled.py:candidate``
"""

from __future__ import annotations

import contextlib

import dflash_audit.candidate as candidate_module
from dflash_audit.candidate import DrafterCandidate

ACCUMULATION_STEPS = 2


def accumulate_unscaled(dflash_loss):
    """``dflash_loss`` whose result backpropagates ACCUMULATION_STEPS times its value (the
    micro-batches' backwards, each on the unscaled loss) and reports the loss once."""
    def loss(*args, **kwargs):
        result = dflash_loss(*args, **kwargs)
        value = result.loss
        result.loss = value + (ACCUMULATION_STEPS - 1) * (value - value.detach())
        return result
    return loss


@contextlib.contextmanager
def unscaled_accumulation():
    original = candidate_module.dflash_loss
    candidate_module.dflash_loss = accumulate_unscaled(original)
    try:
        yield
    finally:
        candidate_module.dflash_loss = original


class GradAccumulationUnscaledCandidate(DrafterCandidate):
    name = "bug: gradient accumulation without dividing by the number of micro-batches"

    def run_case(self, config, loss, weights, inputs):
        with unscaled_accumulation():
            return super().run_case(config, loss, weights, inputs)


candidate = GradAccumulationUnscaledCandidate()
