"""Bug: with ``sample_from_anchor`` on, slot 0 (the anchor) weighted 0 and the decay started at
slot 1.

Under ``sample_from_anchor`` the reference trains slot 0 too and weights slot s by
``exp(-s/gamma)`` (slot 0 weight 1). This candidate keeps the default weights
``exp(-(s-1)/gamma)`` with slot 0 at 0, so the anchor slot it trains contributes nothing.

Expected audit result (on a case with ``sample_from_anchor``): ``loss`` fails (per-slot
weights) with the diagnosis "slot 0 weighted 0 where sample_from_anchor trains it with weight
1 (fit 0 vs 1); decay formula exp(-(s-1)/gamma) instead of exp(-s/gamma)".

Run: ``dflash-audit compare --candidate examples/candidates/anchor_slot_zero.py:candidate``
with a profile that sets ``sample_from_anchor``.
"""

from __future__ import annotations

from dflash_audit.candidate import DrafterCandidate, side_outputs


class AnchorSlotZeroCandidate(DrafterCandidate):
    name = "bug: sample_from_anchor with slot 0 weighted 0"

    def run_case(self, config, loss, weights, inputs):
        model = self.build(config).float()
        model.load_state_dict(weights, strict=True)
        model.train()
        out = model(**{k: inputs[k] for k in (
            "hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
            "document_ids", "position_ids", "anchor_positions", "anchor_valid")})
        # the bug: the loss weights ignore sample_from_anchor (the mask and metrics do not)
        return side_outputs(model, config.replace(sample_from_anchor=False), out, loss)


candidate = AnchorSlotZeroCandidate()
