"""Training metrics of a DFlash step: per-slot accuracy, full accuracy, acceptance length.

Accuracy compares argmax(logits) with argmax(targets) on supervised slots (aligned mask).
Metrics are raw ``<name>_sum`` / ``<name>_total`` pairs (as the reference logs them) so
they pool across steps and ranks before the ratio is taken.

Acceptance length has two definitions, and the reference changed between them:
* ``eal`` ("leading-run", speculators 0.9.0 ``models/metrics.py``): per block with any
  supervised draft slot, 1 + the leading run of correct supervised slots (the bonus token
  counts 1); averaged over those blocks. This is what speculative decoding measures.
* ``eal_product`` ("product-of-marginals", speculators main@c05b95b
  ``models/dflash/metrics.py``): sum over draft slots k of prod_{i<=k} acc_i, where acc_i
  is slot i's pooled accuracy; no bonus token.

A third definition is no reference's (:func:`eal_by_definition` tells a candidate's apart):
"run-past-unsupervised" (NeMo Automodel 0.7.0 ``compute_accept_len``, speculative/dflash/
core.py:139-141): an unsupervised slot neither ends the run nor counts in it, so hits past
it count; it equals "leading-run" unless a block holds a hit after an unsupervised slot.
"""

from __future__ import annotations

import torch

EAL_DEFINITIONS = {
    "leading-run": "1 + leading run of correct slots per block, mean over blocks",
    # a one-rule variant of leading-run: named before a whole other formula that happens to
    # give the same number on a case
    "run-past-unsupervised": "1 + supervised hits before the first supervised miss per block "
                             "(an unsupervised slot does not end the run), mean over blocks",
    "product-of-marginals": "sum_k prod_{i<=k} per-slot accuracy, no bonus token",
}
#: The definitions the reference has had (0.9.0, main@c05b95b); the others are candidates' own.
REFERENCE_EAL_DEFINITIONS = ("leading-run", "product-of-marginals")


@torch.no_grad()
def dflash_metrics(logits: torch.Tensor, targets: torch.Tensor, aligned_loss_mask: torch.Tensor,
                   block_size: int, sample_from_anchor: bool = False) -> dict[str, float]:
    """Metrics of one step.

    Args:
        logits: [1,Q,V_d]; targets: [1,Q,V_d] (argmax taken) or [1,Q] int label ids;
        aligned_loss_mask: [1,Q] 0/1.

    Returns:
        dict of floats: ``position_{s}_acc_sum/_total`` for every draft slot s,
        ``full_acc_sum/_total`` over draft slots, ``eal_sum/_total`` (leading-run) and
        ``eal_product`` (product-of-marginals). Draft slots are 1..B-1 (0..B-1 with
        ``sample_from_anchor``).
    """
    B = block_size
    start = 0 if sample_from_anchor else 1
    correct, valid = _slots_correct(logits, targets, aligned_loss_mask, B, start)
    hits = (correct & valid).float()
    per_slot_correct, per_slot_total = hits.sum(0), valid.float().sum(0)

    out: dict[str, float] = {}
    for i, s in enumerate(range(start, B)):
        out[f"position_{s}_acc_sum"] = float(per_slot_correct[i])
        out[f"position_{s}_acc_total"] = float(per_slot_total[i])
    out["full_acc_sum"] = float(per_slot_correct.sum())
    out["full_acc_total"] = float(per_slot_total.sum())

    block_has_slot = valid.any(-1).float()
    run = hits.cumprod(-1).sum(-1) + 1.0
    out["eal_sum"] = float((run * block_has_slot).sum())
    out["eal_total"] = float(block_has_slot.sum())

    acc = per_slot_correct / per_slot_total.clamp(min=1.0)
    out["eal_product"] = float(acc.cumprod(0).sum())
    return out


def _slots_correct(logits: torch.Tensor, targets: torch.Tensor, aligned_loss_mask: torch.Tensor,
                   B: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[A, B-start] bool: argmax(logits) equals the label, and the slot is supervised."""
    labels = targets.argmax(-1) if targets.is_floating_point() else targets.long()
    correct = (logits.argmax(-1) == labels.reshape(logits.shape[:-1])).reshape(-1, B)[:, start:]
    return correct, aligned_loss_mask.bool().reshape(-1, B)[:, start:]


@torch.no_grad()
def eal_by_definition(logits: torch.Tensor, targets: torch.Tensor,
                      aligned_loss_mask: torch.Tensor, block_size: int,
                      sample_from_anchor: bool = False) -> dict[str, float | None]:
    """The step's expected acceptance length under every definition of
    :data:`EAL_DEFINITIONS` (arguments as :func:`dflash_metrics`; None where no block has a
    supervised draft slot)."""
    m = dflash_metrics(logits, targets, aligned_loss_mask, block_size, sample_from_anchor)
    correct, valid = _slots_correct(logits, targets, aligned_loss_mask, block_size,
                                    0 if sample_from_anchor else 1)
    past = ((correct | ~valid).long().cumprod(-1) * valid.long()).sum(-1) + 1.0
    has = valid.any(-1)
    n = m["eal_total"]
    return {"leading-run": m["eal_sum"] / n if n else None,
            "run-past-unsupervised": float(past[has].sum()) / n if n else None,
            "product-of-marginals": m["eal_product"]}


def ratio(metrics: dict[str, float], name: str) -> float:
    """``name_sum / name_total`` (NaN when the total is 0)."""
    total = metrics.get(f"{name}_total", 0.0)
    return metrics[f"{name}_sum"] / total if total else float("nan")
