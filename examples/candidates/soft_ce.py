"""Bug: soft cross-entropy where the profile (and the reference) say ``kl_div``.

ModelOpt's KD term is ``-(softmax(teacher) * log_softmax(draft)).sum(-1)`` (``hf_dflash.py``
``_compute_loss``): the soft cross-entropy, KL(p || q) + H(p). Its gradient is KL's, but its value
carries the teacher's entropy, so the logged loss, loss-based schedules and D-PACE weights
(computed from the per-token loss) differ from the reference's.

Expected audit result: ``loss`` fails with "soft cross-entropy -sum p log q (= KL + the
teacher's entropy H(p) ...) where the profile says 'kl_div'"; everything upstream passes.

Run: ``dflash-audit compare --candidate examples/candidates/soft_ce.py:candidate``
"""

from __future__ import annotations

import contextlib

import torch

import dflash_audit.model.loss as loss_module
from dflash_audit.candidate import DrafterCandidate


def soft_cross_entropy(logits, targets):
    """-sum_v softmax(targets)_v * log_softmax(logits)_v, [1,Q,V] x2 -> [1,Q] fp32."""
    return -(targets.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)


@contextlib.contextmanager
def kl_div_as_soft_ce():
    original = loss_module.LOSSES["kl_div"]
    loss_module.LOSSES["kl_div"] = soft_cross_entropy
    try:
        yield
    finally:
        loss_module.LOSSES["kl_div"] = original


class SoftCECandidate(DrafterCandidate):
    name = "bug: soft cross-entropy where the profile says kl_div"

    def run_case(self, config, loss, weights, inputs):
        with kl_div_as_soft_ce(), torch.enable_grad():
            return super().run_case(config, loss, weights, inputs)


candidate = SoftCECandidate()
