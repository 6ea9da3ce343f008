"""Bug: under bf16 training, the drafter's trainable parameters held in bfloat16 with no float32
master copy (the bug ModelOpt PR 2322 fixes: the draft module cast to the base model's dtype,
trained by a plain AdamW).

The forward is what the reference computes under bf16 autocast within bf16 noise, so every
numeric check passes; the training differs: each optimizer update is applied to the bf16
values, and an update below half the bf16 spacing at a weight (0.00195 for a norm weight near
1.0) rounds away, so once the learning rate decays below it those weights stop learning. The
reference keeps float32 master weights and runs the step under autocast.

Expected audit result with ``--dtype bf16``: ``structure`` fails with "trainable parameters in
bfloat16 with no float32 master copy under bf16 training". ``BF16MasterCopyCandidate`` is the
same drafter reporting an fp32 master copy kept by its optimizer (a mixed-precision optimizer:
``structure["master_weights"] = "float32"``): it passes.

Run: ``dflash-audit compare --dtype bf16 --candidate
examples/candidates/bf16_params_no_master.py:candidate``
"""

from __future__ import annotations

import torch

from dflash_audit.candidate import DrafterCandidate, side_outputs

INPUTS = ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
          "document_ids", "position_ids", "anchor_positions", "anchor_valid")


class BF16ParamsCandidate(DrafterCandidate):
    name = "bug: bf16 trainable parameters, no fp32 master copy"
    master_weights: str | None = None  # what a mixed-precision optimizer would keep

    def run_case(self, config, loss, weights, inputs):
        low = inputs["hidden_states"].dtype
        if low == torch.float32:  # an fp32 run trains fp32 weights
            return super().run_case(config, loss, weights, inputs)
        model = self.build(config).to(device=inputs["input_ids"].device, dtype=low)
        model.load_state_dict(weights, strict=True)  # copies the fp32 weights into bf16
        model.train()
        out = side_outputs(model, config, model(**{k: inputs[k] for k in INPUTS}), loss)
        # outputs in the case dtype, as the protocol asks (gradients come out in bf16)
        out.tensors = {k: v.float() if v.is_floating_point() else v
                       for k, v in out.tensors.items()}
        if self.master_weights:
            out.structure["master_weights"] = self.master_weights
        return out


class BF16MasterCopyCandidate(BF16ParamsCandidate):
    name = "bf16 module parameters, fp32 master copy in the optimizer"
    master_weights = "float32"


candidate = BF16ParamsCandidate()
with_master_copy = BF16MasterCopyCandidate()
