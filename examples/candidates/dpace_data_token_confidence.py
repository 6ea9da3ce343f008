"""Bug: D-PACE confidences computed from cross-entropy against the data tokens.

D-PACE weights slot s by suffix sums of prod_t c_t with ``c_t = (1-alpha) exp(-l_t) + alpha``,
``l_t`` the per-token value of the loss term it weights (speculators ``losses/utils.py``
``dpace_loss_decay``). ModelOpt computes ``l_t`` as the cross-entropy of the draft logits
against the data token ``input_ids[a+s]``, even when the loss itself distils the verifier
(``hf_dflash.py`` ``_compute_loss``). Needs a D-PACE profile (``--profile reference-train-cli``).

Expected audit result: ``loss`` fails (per-slot weights) with "D-PACE confidences computed
from cross-entropy against the data tokens input_ids[a+s]".

Run: ``dflash-audit compare --profile reference-train-cli
--candidate examples/candidates/dpace_data_token_confidence.py:candidate``
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import dflash_audit.candidate as candidate_module
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.loss import (
    LOSS_REDUCTION_EPS,
    LOSSES,
    LossResult,
    dpace_weights,
    parse_loss,
)


def data_labels(inputs, weights, block_size, vocab_size):
    """[Q] the data token input_ids[a+s] of each slot, as a draft-vocabulary index (0 where it
    is not in the draft vocabulary)."""
    a = inputs["anchor_positions"].long()
    idx = (a[:, None] + torch.arange(block_size)).reshape(-1)
    tokens = inputs["input_ids"][0, idx % inputs["input_ids"].shape[-1]].long()
    if "d2t" not in weights:
        return tokens
    d2t = weights["d2t"].long()
    inverse = torch.zeros(vocab_size, dtype=torch.long)
    inverse[torch.arange(d2t.numel()) + d2t] = torch.arange(d2t.numel())
    return inverse[tokens]


def confidences_from_data_tokens(labels, alpha):
    def loss(logits, targets, aligned_loss_mask, block_size, spec, sample_from_anchor=False,
             target_ids=None):
        m = aligned_loss_mask.float()
        ce = F.cross_entropy(logits[0].float(), labels, reduction="none")[None] * m
        w = dpace_weights(ce.detach(), m, block_size, alpha)
        result = LossResult(torch.zeros(()), {}, {})
        for name, coef in parse_loss(spec.loss).items():
            term = (LOSSES[name](logits, targets) * m * w).sum() / (m.sum() + LOSS_REDUCTION_EPS)
            result.terms[name], result.weights[name] = term.detach(), w
            result.loss = result.loss + coef * term
        return result
    return loss


@contextlib.contextmanager
def patched_loss(make):
    original = candidate_module.dflash_loss
    candidate_module.dflash_loss = make
    try:
        yield
    finally:
        candidate_module.dflash_loss = original


class DPaceDataTokenConfidenceCandidate(DrafterCandidate):
    name = "bug: D-PACE confidences from CE against the data tokens"

    def run_case(self, config, loss, weights, inputs):
        labels = data_labels(inputs, weights, config.block_size, config.vocab_size)
        with patched_loss(confidences_from_data_tokens(labels, loss.dpace_alpha)):
            return super().run_case(config, loss, weights, inputs)


candidate = DPaceDataTokenConfidenceCandidate()
