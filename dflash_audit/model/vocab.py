"""Draft vocabulary from token frequencies: ``t2d`` / ``d2t`` for a drafter with V_d < V.

The V_d most frequent verifier tokens on supervised positions (``loss_mask == 1``) of the
training rows form the draft vocabulary (ties and unseen tokens by ascending id), as the
reference builds it (speculators ``train/vocab_mapping.py``). Buffers, reference semantics:
``t2d`` bool [V] marks draft-vocabulary ids; ``d2t`` int64 [V_d] holds offsets such that
verifier id = i + d2t[i] for draft id i (draft ids follow ascending verifier id).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def token_counts(rows: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
                 ) -> torch.Tensor:
    """Occurrences of each verifier id on supervised positions.

    Args:
        rows: ``(input_ids [1,T], loss_mask [1,T])`` pairs.
        vocab_size: V.

    Returns:
        [V] int64 counts.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in rows:
        ids = input_ids.reshape(-1)[loss_mask.reshape(-1).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t2d [V] bool, d2t [V_d] int64)`` for the ``draft_vocab_size`` most frequent ids.

    Raises:
        ValueError: ``draft_vocab_size`` not in [1, V].
    """
    V = counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {draft_vocab_size}")
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    selected = order[:draft_vocab_size].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    d2t = selected - torch.arange(draft_vocab_size)
    return t2d, d2t


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of counted (supervised) tokens inside the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else float("nan")
