"""Bug: the divergence's softmaxes computed in bfloat16 under bf16 autocast, where the
reference asks for float32 (speculators ``losses/eager.py``:
``log_softmax(logits, dim=-1, dtype=torch.float32)``; the bug of speculators PR 788).

In fp32 the candidate is exact. Under ``--dtype bf16`` its logits and targets come out of
autocast in bf16 and ``F.log_softmax(logits, dim=-1)`` without ``dtype=`` keeps them there:
the loss (and its gradient) carries bf16 rounding the reference does not have.

Expected audit result with ``--dtype bf16``: ``loss`` fails (the loss does not follow from
the candidate's own logits and targets in float32) with the diagnosis "loss softmax computed
in bfloat16; the reference computes it in float32"; with ``--dtype fp32`` it passes.

Run: ``dflash-audit compare --dtype bf16 --candidate
examples/candidates/loss_softmax_bf16.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.loss import softmax_dtype


class LossSoftmaxBf16Candidate(DrafterCandidate):
    name = "bug: loss softmax in bf16"

    def run_case(self, config, loss, weights, inputs):
        low = inputs["hidden_states"].dtype
        if low == torch.float32:  # an fp32 run has nothing to round
            return super().run_case(config, loss, weights, inputs)
        with softmax_dtype(low):
            return super().run_case(config, loss, weights, inputs)


candidate = LossSoftmaxBf16Candidate()
