"""Replay of our drafter under a hypothesis: its logits on a case with parts replaced (config,
weights, inputs, context, masks, positions, RoPE frequencies, module edits), compared by
diagnoses with the candidate's logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_audit.audit.case import Case
from dflash_audit.audit.precision import autocast
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.layers import RotaryEmbedding


def drafter_with_weights(config, weights: dict[str, torch.Tensor]) -> DFlashDrafter:
    """Our drafter holding the case's weights (shared, not copied: forward-only use), built
    on the meta device and not initialised: a real vocabulary and the diagnosis's hundreds of
    replays cost no random initialisation."""
    with torch.device("meta"):
        model = DFlashDrafter(config, initialize=False)
    model.load_state_dict(weights, strict=True, assign=True)
    model.rotary_emb = RotaryEmbedding(config)  # its inv_freq buffer is not in the state dict
    return model


class SlotHead(torch.nn.Module):
    """An lm_head applied to some query slots only: [1,Q,H] -> [1,len(slots),V_d]."""

    def __init__(self, head: torch.nn.Module, slots: torch.Tensor):
        super().__init__()
        self.head, self.slots = head, slots

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h[:, self.slots])


def replay(case: Case, *, config=None, weights: dict | None = None, inputs: dict | None = None,
           context: torch.Tensor | None = None, masks: dict | None = None,
           positions: Callable[[torch.Tensor], torch.Tensor] | None = None,
           inv_freq: torch.Tensor | None = None,
           edit: Callable[[DFlashDrafter], None] | None = None,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """Our drafter's logits on the case, with parts replaced by a hypothesis: another config,
    rearranged weights, edited inputs, a given context [1,T,H], given masks {layer type:
    [Q,T+Q]}, a transform of the [1, T+Q] position ids fed to RoPE, RoPE inverse frequencies,
    or an ``edit`` of the built drafter's modules (:mod:`dflash_audit.audit.replay.architecture`).

    Returns [1, Q, V_d], or [1, len(slots), V_d] with ``slots`` (the lm_head and the targets,
    the costly parts on a real vocabulary, then run on those slots only / not at all)."""
    model = drafter_with_weights(config or case.config, weights or case.weights)
    if edit is not None:
        edit(model)
    if slots is not None:
        model.lm_head = SlotHead(model.lm_head, slots)
        model.targets = lambda states, indices: None
    if inv_freq is not None:
        model.rotary_emb.inv_freq = inv_freq
    if context is not None:
        model.context = lambda hidden_states: context
    if masks is not None:
        own = model.attention_masks
        model.attention_masks = lambda d, a: {**own(d, a), **masks}
    if positions is not None:
        rope = model.rotary_emb.forward
        model.rotary_emb.forward = lambda pos, dtype: rope(positions(pos), dtype)
    with torch.no_grad(), autocast(case):  # in the case's dtype, as both sides ran
        out = model(**{**case.inputs, **(inputs or {})})
    return out.logits
