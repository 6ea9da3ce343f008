"""Part of the adapter kit (:mod:`.kit`, which re-exports these): what a framework's draft is
built from and fed with -- the case's drafter geometry as a ``Qwen3Config``, the frozen
embedding and head as modules, a packed row's ``document_ids`` as packing metadata.
"""

from __future__ import annotations

from typing import Any

import torch


def packing_metadata(document_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A packed row's ``document_ids`` [1, T] (0..k-1 per contiguous document, -1 padding) as
    the packing metadata frameworks take. Padding is folded into the document before it (as
    packers that pad a row to its width do; a row that starts with padding keeps it as a
    segment of its own), so the segments cover the row.

    Returns:
        ``seq_lens`` [1, S] long (segment lengths, summing to T), ``cu_seqlens`` [S+1] int32
        (their running sum from 0, flash-attention varlen style), ``segment_ids`` [1, T] long
        (the segment of each position) and ``doc_remaining`` [1, T] long (real tokens after
        each position in its document; 0 on padding).

    Raises:
        ValueError: ``document_ids`` is not one row, or a document is not contiguous.
    """
    if document_ids.dim() != 2 or document_ids.shape[0] != 1:
        raise ValueError(f"document_ids must be [1, T], got {list(document_ids.shape)}")
    doc = document_ids[0].long().cpu()
    change = torch.ones_like(doc, dtype=torch.bool)
    change[1:] = (doc[1:] != doc[:-1]) & (doc[1:] >= 0)  # padding continues its segment
    starts = change.nonzero().reshape(-1)
    ids = [int(doc[s]) for s in starts if int(doc[s]) >= 0]
    if len(ids) != len(set(ids)):
        raise ValueError("a document of document_ids is not contiguous")
    segment = torch.cumsum(change.long(), 0) - 1
    seq_lens = torch.bincount(segment, minlength=len(starts))
    real = (doc >= 0).long()
    # real tokens after t within its segment: (real tokens of the segment from t on) - 1
    from_t = torch.zeros_like(real)
    for s, n in zip(starts.tolist(), seq_lens.tolist()):
        from_t[s:s + n] = torch.flip(torch.cumsum(torch.flip(real[s:s + n], [0]), 0), [0])
    cu = torch.zeros(len(starts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    device = document_ids.device
    return {"seq_lens": seq_lens[None].to(device), "cu_seqlens": cu.to(device),
            "segment_ids": segment[None].to(device),
            "doc_remaining": ((from_t - 1).clamp(min=0) * real)[None].to(device)}


def qwen3_draft_config(config: Any, **overrides: Any) -> Any:
    """The transformers ``Qwen3Config`` of the case's drafter geometry (sizes, heads, eps,
    activation, bias, positions, RoPE with its type, ``layer_types``, ``sliding_window`` when a
    layer slides): the config most frameworks build their draft from. ``overrides`` are set
    as attributes afterwards (``num_target_layers``, ``block_size``, ``dflash_config``, ...)."""
    from transformers import Qwen3Config

    types = list(config.effective_layer_types)
    sliding = "sliding_attention" in types
    cfg = Qwen3Config(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        attention_bias=config.attention_bias, hidden_act=config.hidden_act,
        rope_parameters={"rope_type": "default", **(config.rope_parameters or {}),
                         "rope_theta": config.rope_theta},
        layer_types=types, sliding_window=config.sliding_window if sliding else None,
        use_sliding_window=sliding)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def frozen_embedding_and_head(weights: dict[str, torch.Tensor], device: Any = None
                              ) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The case's frozen ``embed_tokens.weight`` [V, H] and draft ``lm_head.weight`` [V, H] as
    modules (no gradient), for a framework that takes the target's embedding and head."""
    embed = torch.nn.Embedding.from_pretrained(weights["embed_tokens.weight"]).to(device)
    w = weights["lm_head.weight"]
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(device)
    head.weight = torch.nn.Parameter(w.to(device), requires_grad=False)
    return embed, head
