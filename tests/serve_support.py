"""Drafter checkpoints for the serve-check tests: a tiny random drafter saved by our
``save_pretrained`` (the format ``dflash-audit train`` writes and speculators loads), with
any config field changed, and the same folder with its ``config.json`` edited afterwards (the
way a user's or another tool's checkpoint differs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_audit.model.checkpoint import save_pretrained
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter

#: A 2-layer drafter over a 6-layer H=32 verifier (vocab 300), mixed layout: layer 0 full,
#: layer 1 sliding (W=8, causal block), as the reference's training CLI lays out its layers.
TINY: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, num_hidden_layers=2, vocab_size=300, num_verifier_layers=6,
    target_layer_ids=(1, 3, 4), mask_token_id=299, block_size=4,
    layer_types=("full_attention", "sliding_attention"), sliding_window=8,
    rope_theta=10000.0, max_position_embeddings=1024)


def make_checkpoint(folder: Path, verifier: str | None = None, seed: int = 0,
                    **changes: Any) -> Path:
    """Save a random drafter of :data:`TINY` (with ``changes``) into ``folder``."""
    torch.manual_seed(seed)
    model = DFlashDrafter(DFlashConfig(**{**TINY, **changes}))
    if model.t2d is not None:  # a draft vocabulary: every k-th verifier id, mapped by d2t
        V, Vd = model.t2d.numel(), model.d2t.numel()
        ids = torch.arange(Vd) * (V // Vd)
        model.t2d[ids] = True
        model.d2t.copy_(ids - torch.arange(Vd))
    return save_pretrained(model, folder, verifier_name_or_path=verifier,
                           verifier_architectures=["LlamaForCausalLM"])


def edit_config(folder: Path, edit) -> Path:
    """Apply ``edit(config_dict)`` to ``folder/config.json`` in place; return the folder."""
    path = folder / "config.json"
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d, indent=2))
    return folder
