"""The DFlash attention mask: which keys each draft query may see.

Queries are the Q = A*B noise tokens (block j = q // B belongs to anchor a_j); keys are
``[context (T) ; noise (Q)]``. Query q may see (DFlash paper, arXiv 2602.06036 sec. 3;
semantics as in speculators ``models/dflash/attention.py``):

* context key kv < T when it is in the same document as a_j, that document is not
  padding (-1), ``kv < a_j`` strictly, and for a sliding layer ``kv >= a_j - W``;
* noise key T + k when ``k // B == j`` (its own block): all of the block in a full-attention
  layer (bidirectional), only ``k <= q`` in a sliding layer unless the block is
  non-causal (``sliding_window_non_causal``).

Two builders share one rule: a dense boolean [Q, T+Q] tensor for SDPA (CPU) and a
flex-attention ``BlockMask`` (CUDA).
"""

from __future__ import annotations

import torch


def block_is_causal(sliding_window: int | None, sliding_window_non_causal: bool) -> bool:
    """Whether attention inside a block is causal: only sliding layers, unless non-causal."""
    return sliding_window is not None and not sliding_window_non_causal


def dense_mask(
    document_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    sliding_window_non_causal: bool = False,
) -> torch.Tensor:
    """Dense boolean attention mask.

    Args:
        document_ids: [1, T] or [T] int64, document of each packed position, -1 for padding.
        anchor_positions: [A] int64.
        block_size: B.
        sliding_window: W in tokens for a sliding layer, None for full attention.
        sliding_window_non_causal: bidirectional block in a sliding layer.

    Returns:
        [Q, T+Q] bool with Q = A*B; True where the query may attend.
    """
    doc = document_ids.reshape(-1)
    T = doc.numel()
    device = doc.device
    anchors = anchor_positions.to(device=device, dtype=torch.long)
    Q = anchors.numel() * block_size
    q = torch.arange(Q, device=device)
    q_anchor = anchors.repeat_interleave(block_size)[:, None]  # [Q, 1]
    q_doc = doc[q_anchor]  # [Q, 1]
    kv = torch.arange(T, device=device)[None, :]  # [1, T]
    base = (doc[None, :] == q_doc) & (q_doc != -1) & (kv < q_anchor)
    if sliding_window is not None:
        base &= kv >= q_anchor - sliding_window
    k = torch.arange(Q, device=device)[None, :]  # [1, Q]
    block = (k // block_size) == (q[:, None] // block_size)
    if block_is_causal(sliding_window, sliding_window_non_causal):
        block &= k <= q[:, None]
    return torch.cat([base, block], dim=1)


def flex_block_mask(
    document_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    sliding_window_non_causal: bool = False,
):
    """The same rule as :func:`dense_mask` as a flex-attention ``BlockMask`` (CUDA path).

    flex attention evaluates ``mask_mod`` on query / key indices padded up to its block size
    (128): a query index q >= Q has no anchor, so it is clamped before indexing the anchors and
    masked out (an unclamped ``q_anchor[q_idx]`` reads past the anchors: SpecForge PR 511);
    key indices past T + Q are clamped the same way.

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape [1, 1, Q, T+Q].
    """
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids.reshape(-1)
    T = doc.numel()
    anchors = anchor_positions.to(device=doc.device, dtype=torch.long)
    q_anchor = anchors.repeat_interleave(block_size)
    Q = q_anchor.numel()
    causal = block_is_causal(sliding_window, sliding_window_non_causal)

    def mask_mod(b, h, q_idx, kv_idx):
        q_ok = q_idx < Q
        a = q_anchor[torch.clamp(q_idx, max=Q - 1)]
        kv_pos = torch.clamp(kv_idx, max=T - 1)
        base = (kv_idx < T) & (doc[kv_pos] == doc[a]) & (doc[a] != -1) & (kv_pos < a)
        if sliding_window is not None:
            base = base & (kv_pos >= a - sliding_window)
        k = kv_idx - T
        block = (kv_idx >= T) & (kv_idx < T + Q) & (k // block_size == q_idx // block_size)
        if causal:
            block = block & (k <= q_idx)
        return q_ok & (base | block)

    return create_block_mask(mask_mod, None, None, Q, T + Q, device=doc.device)


def materialise_block_mask(block_mask) -> torch.Tensor:
    """A flex ``BlockMask`` [1, 1, Q, KV] as the dense bool [Q, KV] attention it applies: a key
    is visible when its (query block, key block) tile is a full block, or a partial block
    whose ``mask_mod`` allows it; tiles in neither list are skipped by flex attention.

    Returns:
        [Q, KV] bool on the BlockMask's device.
    """
    from torch.nn.attention.flex_attention import create_mask

    Q, KV = block_mask.seq_lengths
    qb, kb = block_mask.BLOCK_SIZE

    def tiles(num: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor:
        if num is None or idx is None:
            return torch.zeros(Q, KV, dtype=torch.bool, device=block_mask.kv_indices.device)
        n_kb = idx.shape[-1]
        slot = torch.arange(n_kb, device=idx.device)
        cols = torch.where(slot < num[0, 0, :, None], idx[0, 0].long(), n_kb)  # n_kb: unused
        grid = torch.zeros(idx.shape[-2], n_kb + 1, dtype=torch.bool, device=idx.device)
        grid.scatter_(1, cols, True)
        dense = grid[:, :n_kb].repeat_interleave(qb, 0).repeat_interleave(kb, 1)
        return dense[:Q, :KV]

    partial = tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    allowed = create_mask(block_mask.mask_mod, 1, 1, Q, KV, device=partial.device)[0, 0]
    return full | (partial & allowed)
