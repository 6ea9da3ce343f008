"""Bug: EAGLE-3-style inputs shifted against the loss mask.

An EAGLE-3 data pipeline shifts ``hidden_states`` and ``input_ids`` left by one position
(position p holds what belongs to p+1) so that a state predicts the next token. DFlash does not
shift: the anchor's own token and states sit at the anchor. Here the shift is applied to
``hidden_states`` and ``input_ids`` but not to ``loss_mask``, ``position_ids`` or
``document_ids``, so the context and the noise block's anchor token are one position off.

Expected audit result: ``context`` fails with the diagnosis "hidden_states shifted left by 1
relative to loss_mask / position_ids"; ``logits`` fails with "hidden_states and input_ids shifted
left by 1 relative to loss_mask / position_ids" (replaying our drafter with the shifted inputs
reproduces the candidate); masks and targets pass.

Run: ``dflash-audit compare --candidate examples/candidates/shifted_inputs.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate

SHIFTED = ("hidden_states", "input_ids")


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """x[:, p] <- x[:, p + 1] along the sequence, zeros shifted in at the end."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)


class ShiftedInputsCandidate(DrafterCandidate):
    name = "bug: hidden_states and input_ids shifted left by 1 (EAGLE-3 style)"

    def run_case(self, config, loss, weights, inputs):
        inputs = {k: shift_left(v) if k in SHIFTED else v for k, v in inputs.items()}
        return super().run_case(config, loss, weights, inputs)


candidate = ShiftedInputsCandidate()
