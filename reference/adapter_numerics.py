"""Numerics helpers of ``reference/adapter.py`` (runs INSIDE the reference's process; imports
only torch): the dense mask of what the reference built (an eager additive mask or a flex
``BlockMask``), and the reference's own low-precision noise (the same case in bf16 and fp32).
"""

from __future__ import annotations


def dense_mask_of(mask):
    """[Q, KV] bool of an additive mask [1,1,Q,KV] (eager) or a flex ``BlockMask`` (CUDA):
    a key is visible in a full block, or in a partial block where mask_mod allows it."""
    import torch

    if not hasattr(mask, "mask_mod"):
        return (mask == 0).reshape(mask.shape[-2], mask.shape[-1])
    from torch.nn.attention.flex_attention import create_mask

    Q, KV = mask.seq_lengths
    qb, kb = mask.BLOCK_SIZE

    def blocks(num, idx):
        out = torch.zeros(idx.shape[-2], idx.shape[-1] + 1, dtype=torch.bool, device=idx.device)
        cols = torch.where(torch.arange(idx.shape[-1], device=idx.device) < num[0, 0, :, None],
                           idx[0, 0], idx.shape[-1])
        out.scatter_(1, cols.long(), True)
        return out[:, :-1].repeat_interleave(qb, 0).repeat_interleave(kb, 1)[:Q, :KV]

    partial = blocks(mask.kv_num_blocks, mask.kv_indices)
    full = (blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
            if mask.full_kv_num_blocks is not None else torch.zeros_like(partial))
    mod = create_mask(mask.mask_mod, 1, 1, Q, KV, device=partial.device)[0, 0]
    return (full | (partial & mod)).cpu()



def measure_noise(low: dict, exact: dict, low_metrics: dict, exact_metrics: dict) -> dict:
    """Largest |low - exact| per quantity (context, targets, logits, loss, loss_weights,
    grad scaled by max(1, max|g|), metrics): the reference against itself."""
    out: dict = {}
    for key, e in exact.items():
        if key in low and e.is_floating_point() and low[key].shape == e.shape and e.numel():
            d = float((low[key].double() - e.double()).abs().max())
            quantity = key.split(".", 1)[0]
            if quantity == "grad":
                d /= max(1.0, float(e.abs().max()))
            if quantity != "aligned_loss_mask":
                out[quantity] = max(out.get(quantity, 0.0), d)
    for k in set(low_metrics) & set(exact_metrics):
        out["metrics"] = max(out.get("metrics", 0.0), abs(low_metrics[k] - exact_metrics[k]))
    return out
