"""The DFlash drafter (Chen, Liang & Liu, arXiv 2602.06036), one forward top to bottom.

Data flow of one packed row (T tokens, A anchors, B = block_size, Q = A*B):

1. context = hidden_norm(fc(hidden_states))          [1,T,n*H] -> [1,T,H]
2. noise block j: input_ids[a_j], then B-1 mask tokens; embedded with the frozen verifier
   embedding; slot s sits at position position_ids[a_j] + s            [1,Q,H]
3. draft layers: queries from the noise stream, keys/values from [context ; noise]
4. logits = lm_head(norm(noise))                                         [1,Q,V_d]
5. targets (no grad) = verifier_lm_head(verifier_norm(verifier_last_hidden_states[i]))
   with i = a_j + s - 1 (slot s is taught by the verifier's prediction made at the
   previous position), or i = a_j + s with ``sample_from_anchor``        [1,Q,V_d]
6. aligned_loss_mask = loss_mask[a_j + s] * anchor_valid_j, slot 0 zeroed unless
   ``sample_from_anchor``                                               [1,Q]
7. target_ids = input_ids[a_j + s] (a_j + s + 1 with ``sample_from_anchor``): the data token
   each slot is taught, what the ``ce-data`` loss trains on (SpecForge's objective; the
   reference's losses all use the targets of step 5)                    [1,Q]

Parameter and buffer names equal the reference's state-dict keys (speculators
``models/dflash/core.py``), so one state dict loads into both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_audit.model.anchors import check_anchors
from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION, DFlashConfig
from dflash_audit.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from dflash_audit.model.loss import data_target_ids
from dflash_audit.model.mask import dense_mask, flex_block_mask

FROZEN_PARAMETERS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                     "verifier_norm.weight")


@dataclass
class DraftOutputs:
    """Everything one forward defines. Shapes: T packed length, Q = A*B, V_d draft vocab."""

    context: torch.Tensor  # [1,T,H] hidden_norm(fc(hidden_states))
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # layer type -> [Q,T+Q] bool
    targets: torch.Tensor | None = None  # [1,Q,V_d] verifier logits (no grad)
    logits: torch.Tensor | None = None  # [1,Q,V_d] draft logits
    aligned_loss_mask: torch.Tensor | None = None  # [1,Q] float 0/1
    block_indices: torch.Tensor | None = None  # [Q] a_j + s
    target_ids: torch.Tensor | None = None  # [1,Q] int64 data token of each slot (ce-data)
    position_ids: torch.Tensor | None = None  # [1,T+Q] context then noise positions


def block_indices(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A] anchors -> [A*B] packed positions ``a_j + s`` (s = 0..B-1), int64."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return (anchor_positions.long()[:, None] + offsets[None, :]).reshape(-1)


@torch.no_grad()
def verifier_targets(verifier_last_hidden_states: torch.Tensor, indices: torch.Tensor,
                     verifier_norm: nn.Module, verifier_lm_head: nn.Module,
                     sample_from_anchor: bool = False) -> torch.Tensor:
    """Target logits [1,Q,V_d] from [1,T,H] pre-norm last-layer states and [Q] block positions
    ``a + s``: ``verifier_lm_head(verifier_norm(verifier_last_hidden_states[i]))`` with
    ``i = a + s - 1`` (``a + s`` with ``sample_from_anchor``), wrapping modulo T like the
    reference (speculators 0.9.0 ``models/dflash/core.py:436-453``), which only touches slot 0
    of an anchor at 0, a slot the loss never sees."""
    T = verifier_last_hidden_states.shape[1]
    src = (indices - (0 if sample_from_anchor else 1)) % T
    return verifier_lm_head(verifier_norm(verifier_last_hidden_states[:, src]))


def aligned_loss_mask(loss_mask: torch.Tensor, indices: torch.Tensor, anchor_valid: torch.Tensor,
                      block_size: int, sample_from_anchor: bool = False) -> torch.Tensor:
    """[1,T] loss_mask, [Q] indices ``a + s``, [A] anchor_valid -> [1,Q] float mask of the
    trained slots: ``loss_mask[a + s] * anchor_valid``, slot 0 zeroed unless
    ``sample_from_anchor`` (speculators 0.9.0 ``models/dflash/core.py:472-484``)."""
    m = loss_mask[:, indices].float() * anchor_valid.float().repeat_interleave(block_size)[None]
    if not sample_from_anchor:
        m[:, ::block_size] = 0.0
    return m


class DFlashDrafter(nn.Module):
    """DFlash draft model.

    Trained: ``fc``, ``hidden_norm``, ``layers``, ``norm``. Frozen (loaded from the
    verifier): ``embed_tokens`` [V,H], ``lm_head`` [V_d,H], ``verifier_lm_head`` [V_d,H],
    ``verifier_norm`` [H]. Draft vocabulary buffers (only when V_d < V): ``t2d`` bool [V]
    (which verifier ids are in the draft vocab), ``d2t`` int64 [V_d] (verifier id = i + d2t[i]).
    """

    def __init__(self, config: DFlashConfig, initialize: bool = True):
        """``initialize`` False skips the random initialisation of :meth:`reset_parameters`
        (weights loaded right after, e.g. a drafter built on the meta device for a replay);
        which parameters train is set either way."""
        super().__init__()
        self.config = config
        H, V, Vd = config.hidden_size, config.vocab_size, config.effective_draft_vocab_size
        self.fc = nn.Linear(config.num_target_layers * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # not initialised: from an uninitialised tensor, as the weights are loaded next (its own
        # N(0, 1) draw on the meta device imported torch._dynamo, ~1 s); initialised: drawn
        # as before, so a seed gives the weights it gave
        self.embed_tokens = (nn.Embedding(V, H) if initialize else
                             nn.Embedding.from_pretrained(torch.empty(V, H), freeze=False))
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.verifier_lm_head = nn.Linear(H, Vd, bias=False)
        self.verifier_norm = RMSNorm(H, config.rms_norm_eps,
                                     one_plus_weight=config.verifier_norm_one_plus_weight)
        if config.uses_draft_vocab:
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        else:
            self.t2d = None
            self.d2t = None
        if initialize:
            self.reset_parameters()
        else:
            self._freeze()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Trainable linears ~ N(0, std), norms to their identity gain (as HF post_init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.constant_(module.weight, 0.0 if module.one_plus_weight else 1.0)
        self._freeze()

    def _freeze(self) -> None:
        """Every parameter trains except :data:`FROZEN_PARAMETERS`."""
        for name, p in self.named_parameters():
            p.requires_grad_(name not in FROZEN_PARAMETERS)

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter for every parameter that training updates."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    # ----------------------------------------------------------------------- parts
    def context(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[1,T,n*H] target-layer features -> [1,T,H] context shared by all draft layers.

        Raises:
            ValueError: the feature axis is not n*H (fc must read ALL target layers).
        """
        expected = self.fc.in_features
        if hidden_states.shape[-1] != expected:
            raise ValueError(
                f"hidden_states has {hidden_states.shape[-1]} features, fc expects {expected} "
                f"= {self.config.num_target_layers} target layers x {self.config.hidden_size}")
        return self.hidden_norm(self.fc(hidden_states))

    def attention_masks(self, document_ids, anchor_positions) -> dict[str, torch.Tensor]:
        """One mask per layer type present: ``{"full_attention": m, "sliding_attention": m}``,
        dense bool [Q,T+Q] on CPU, flex BlockMask on CUDA."""
        c = self.config
        build = flex_block_mask if document_ids.is_cuda else dense_mask
        masks = {}
        for layer_type in dict.fromkeys(c.effective_layer_types):
            window = c.sliding_window if layer_type == SLIDING_ATTENTION else None
            masks[layer_type] = build(document_ids, anchor_positions, c.block_size, window,
                                      c.sliding_window_non_causal)
        return masks

    def targets(self, verifier_last_hidden_states: torch.Tensor, indices: torch.Tensor):
        """[1,T,H] pre-norm last-layer states, [Q] block positions -> [1,Q,V_d] target logits
        (:func:`verifier_targets`)."""
        return verifier_targets(verifier_last_hidden_states, indices, self.verifier_norm,
                                self.verifier_lm_head, self.config.sample_from_anchor)

    def aligned_loss_mask(self, loss_mask, indices, anchor_valid) -> torch.Tensor:
        """[1,T] loss_mask, [Q] indices, [A] anchor_valid -> [1,Q] float mask of trained slots
        (:func:`aligned_loss_mask`)."""
        return aligned_loss_mask(loss_mask, indices, anchor_valid, self.config.block_size,
                                 self.config.sample_from_anchor)

    # --------------------------------------------------------------------- forward
    def forward(
        self,
        hidden_states: torch.Tensor,  # [1,T,n*H]
        input_ids: torch.Tensor,  # [1,T]
        loss_mask: torch.Tensor,  # [1,T]
        verifier_last_hidden_states: torch.Tensor,  # [1,T,H]
        document_ids: torch.Tensor,  # [1,T]
        position_ids: torch.Tensor,  # [1,T]
        anchor_positions: torch.Tensor,  # [A]
        anchor_valid: torch.Tensor,  # [A]
    ) -> DraftOutputs:
        """Run the drafter on one packed row with explicit anchors (see module docstring).

        Anchors come from :func:`dflash_audit.model.anchors.select_anchors` or are injected.

        Raises:
            ValueError: bad shapes or anchors.
        """
        c = self.config
        B = c.block_size
        check_anchors(anchor_positions, anchor_valid, loss_mask, B)
        context = self.context(hidden_states)  # [1,T,H]
        idx = block_indices(anchor_positions, B)  # [Q]
        Q = idx.numel()

        noise_ids = torch.full((1, Q), c.mask_token_id, dtype=torch.long, device=input_ids.device)
        noise_ids[:, ::B] = input_ids[:, anchor_positions]
        x = self.embed_tokens(noise_ids)  # [1,Q,H]

        noise_pos = block_indices(position_ids[0, anchor_positions], B)[None]  # [1,Q]
        all_pos = torch.cat([position_ids.long(), noise_pos], dim=1)  # [1,T+Q]
        cos, sin = self.rotary_emb(all_pos, x.dtype)

        masks = self.attention_masks(document_ids, anchor_positions)
        for i, layer in enumerate(self.layers):
            mask = masks[SLIDING_ATTENTION if c.is_sliding(i) else FULL_ATTENTION]
            x = layer(x, context, cos, sin, mask)
        logits = self.lm_head(self.norm(x))  # [1,Q,V_d]

        return DraftOutputs(
            context=context,
            masks=masks,
            targets=self.targets(verifier_last_hidden_states, idx),
            logits=logits,
            aligned_loss_mask=self.aligned_loss_mask(loss_mask, idx, anchor_valid),
            block_indices=idx,
            position_ids=all_pos,
            target_ids=data_target_ids(input_ids, idx, c.sample_from_anchor),
        )
