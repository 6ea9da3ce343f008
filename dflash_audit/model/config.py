"""Configuration of a DFlash drafter, built from a verifier config.

One frozen dataclass holds every field that defines the drafter's architecture and its
training-relevant semantics (target layers, block size, mask token, attention layout).
Field names follow the reference (vllm-project/speculators,
``src/speculators/models/dflash/config.py`` and the transformer_layer_config it carries).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# Verifier families whose final RMSNorm multiplies by (1 + w) instead of w
# (Gemma convention; transformers' Qwen3.5 norm too). Source: DESIGN.md section 3.
ONE_PLUS_WEIGHT_NORM_MODEL_TYPES = frozenset(
    {"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text", "recurrent_gemma"}
)


class ConfigError(ValueError):
    """A drafter configuration field has an invalid value; the message names the field."""


@dataclass(frozen=True)
class DFlashConfig:
    """Architecture and semantics of one DFlash drafter.

    Sizes are counts (not bytes). ``target_layer_ids`` use the speculators/vLLM convention:
    id ``L < num_verifier_layers`` is the residual stream after L decoder layers (HF
    ``output_hidden_states[L]``), id ``num_verifier_layers`` the last layer's output before
    the final norm.
    """

    hidden_size: int  # H
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int  # number of draft decoder layers
    vocab_size: int  # V, the verifier's vocabulary
    num_verifier_layers: int  # N
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 8  # B
    draft_vocab_size: int | None = None  # V_d; None means V (no draft vocabulary)
    layer_types: tuple[str, ...] | None = None  # None means every layer full attention
    sliding_window: int | None = None  # W, tokens
    sliding_window_non_causal: bool = False
    sample_from_anchor: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_parameters: dict[str, Any] | None = None  # extra rope settings (rope_type, factor...)
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    pad_token_id: int | None = None
    verifier_model_type: str = "llama"
    verifier_norm_one_plus_weight: bool = False  # x*(1+w) final norm (Gemma style)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_target_layers(self) -> int:
        """n, the number of captured verifier layers that ``fc`` reads."""
        return len(self.target_layer_ids)

    @property
    def effective_draft_vocab_size(self) -> int:
        """V_d: the draft vocabulary size (V when no draft vocabulary is used)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def uses_draft_vocab(self) -> bool:
        """Whether the drafter predicts over a reduced vocabulary (t2d / d2t present)."""
        return self.effective_draft_vocab_size != self.vocab_size

    @property
    def effective_layer_types(self) -> tuple[str, ...]:
        """Attention type of every draft layer ("full_attention" / "sliding_attention")."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_hidden_layers

    def is_sliding(self, layer_idx: int) -> bool:
        """Whether draft layer ``layer_idx`` uses sliding-window attention."""
        return self.effective_layer_types[layer_idx] == SLIDING_ATTENTION

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every field.

        Raises:
            ConfigError: naming the field, its value, and the allowed range.
        """
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
                     "num_verifier_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        ids = self.target_layer_ids
        if not ids:
            raise ConfigError("target_layer_ids is empty: give at least one verifier layer id")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"target_layer_ids has duplicates: {list(ids)}")
        bad = [i for i in ids if i < 0 or i > self.num_verifier_layers]
        if bad:
            raise ConfigError(
                f"target_layer_ids {bad} out of range [0, {self.num_verifier_layers}] for a "
                f"verifier with {self.num_verifier_layers} layers (negative ids are not "
                "wrapped; z-lab ids are offset by one, convert them first)")
        if list(ids) != sorted(ids):
            raise ConfigError(f"target_layer_ids must be ascending, got {list(ids)}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        if self.mask_token_id is None:
            raise ConfigError("mask_token_id is missing: set it explicitly (never pad/eos)")
        if not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} out of range [0, {self.vocab_size})")
        vd = self.effective_draft_vocab_size
        if not 1 <= vd <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size {vd} must be in [1, vocab_size={self.vocab_size}]")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"num_hidden_layers={self.num_hidden_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ConfigError(f"layer_types has unknown entries {unknown}; use {LAYER_TYPES}")
        if SLIDING_ATTENTION in self.effective_layer_types and (
                not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(
                f"sliding_window must be a positive integer when a layer is sliding, "
                f"got {self.sliding_window!r}")

    # ------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of all fields (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ConfigError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown drafter config fields {unknown}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> DFlashConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_verifier_config(
        cls,
        verifier_config: Any,
        *,
        target_layer_ids: list[int] | tuple[int, ...],
        mask_token_id: int,
        num_hidden_layers: int = 1,
        block_size: int = 8,
        draft_vocab_size: int | None = None,
        layer_types: list[str] | tuple[str, ...] | None = None,
        sliding_window: int | None = None,
        sliding_window_non_causal: bool = False,
        sample_from_anchor: bool = False,
    ) -> DFlashConfig:
        """Drafter config whose dimensions mirror a Hugging Face verifier config.

        ``verifier_config``: a ``transformers.PretrainedConfig`` (multimodal configs use
        their ``text_config``). Hidden size, heads, head_dim, rope, eps, activation, vocab and
        the final norm convention are taken from it the way the reference's training CLI
        does (:func:`draft_attention_geometry`, :func:`draft_rope_parameters`; activation
        ``hidden_act`` else ``hidden_activation``; no attention bias, as the CLI's draft
        Qwen3Config); the drafter-only fields are arguments. Verified field by field against
        the reference's own derivation (``reference/adapter.py --derive``).

        Raises:
            ConfigError: for any invalid resulting field.
        """
        vc = getattr(verifier_config, "text_config", None) or verifier_config
        heads, kv_heads, head_dim = draft_attention_geometry(vc)
        rope = draft_rope_parameters(vc, head_dim)
        rope_theta = float(rope.pop("rope_theta"))
        if rope.get("rope_type", "default") == "default":
            rope.pop("rope_type", None)
        model_type = str(getattr(vc, "model_type", "") or "").lower()
        intermediate = getattr(vc, "intermediate_size", None) or 3 * int(vc.hidden_size)
        act = getattr(vc, "hidden_act", None) or getattr(vc, "hidden_activation", None) or "silu"
        return cls(
            hidden_size=int(vc.hidden_size),
            intermediate_size=int(intermediate),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_hidden_layers=int(num_hidden_layers),
            vocab_size=int(vc.vocab_size),
            num_verifier_layers=int(vc.num_hidden_layers),
            target_layer_ids=tuple(target_layer_ids),
            mask_token_id=int(mask_token_id),
            block_size=int(block_size),
            draft_vocab_size=draft_vocab_size,
            layer_types=tuple(layer_types) if layer_types is not None else None,
            sliding_window=sliding_window,
            sliding_window_non_causal=sliding_window_non_causal,
            sample_from_anchor=sample_from_anchor,
            rms_norm_eps=float(getattr(vc, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_parameters=rope or None,
            max_position_embeddings=int(getattr(vc, "max_position_embeddings", 32768)),
            # the reference's training CLI builds the draft Qwen3Config without the verifier's
            # attention_bias (Qwen3Config default False)
            attention_bias=False,
            hidden_act=str(act),
            pad_token_id=getattr(vc, "pad_token_id", None),
            verifier_model_type=model_type,
            verifier_norm_one_plus_weight=model_type in ONE_PLUS_WEIGHT_NORM_MODEL_TYPES,
        )


def draft_attention_geometry(vc: Any) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) of the draft layers for a verifier
    text config, as the reference's training CLI resolves them
    (speculators ``train/cli.py: create_transformer_layer_config``): head_dim is the
    verifier's own (independent of H / heads); when H is not a multiple of the head count but
    is of head_dim, the draft uses ``H // head_dim`` query heads (and as many KV heads if the
    verifier's KV count no longer divides them).

    Raises:
        ConfigError: the resolved heads are not a multiple of the KV heads.
    """
    hidden = int(vc.hidden_size)
    heads = int(vc.num_attention_heads)
    kv_heads = int(getattr(vc, "num_key_value_heads", None) or heads)
    head_dim = getattr(vc, "head_dim", None)
    if head_dim and hidden % heads and not hidden % int(head_dim):
        heads = hidden // int(head_dim)
        if heads % kv_heads:
            kv_heads = heads
    return heads, kv_heads, int(head_dim or hidden // heads)


def draft_rope_parameters(vc: Any, head_dim: int) -> dict[str, Any]:
    """The flat RoPE parameters of the draft layers (with ``rope_theta``) for a verifier text
    config, following the reference's training CLI (speculators ``train/cli.py``) and the
    ``flatten_rope_parameters`` its model applies:

    - per-layer-type nested ``rope_parameters`` (Gemma3, Olmo3, Laguna in transformers 5)
      collapse to the ``sliding_attention`` entry (else ``full_attention``), theta 10000 when
      the entry has none;
    - ``partial_rotary_factor`` is dropped (the draft rotates the whole head) unless the rope
      has an ``mrope_section``: then a factor f < 1 is folded into the section (each entry
      times 1/f) and set to 1.0 (the CLI's default ``mrope_full_head_hack``);
    - the legacy ``type`` alias and ``mrope_interleaved`` are dropped.
    Configs without ``rope_parameters`` (transformers 4, plain namespaces) use ``rope_theta``
    and ``rope_scaling``.

    Raises:
        ConfigError: an mrope_section that cannot be rescaled to the head, or per-pair
            longrope factors of a partial rotation (the whole head has more pairs).
    """
    raw = getattr(vc, "rope_parameters", None)
    if raw is None:
        raw = {**(getattr(vc, "rope_scaling", None) or {}),
               "rope_theta": getattr(vc, "rope_theta", None) or 10000.0}
    rope = copy.deepcopy(dict(raw))
    if "rope_theta" not in rope:
        sub = rope.get(SLIDING_ATTENTION) or rope.get(FULL_ATTENTION) or {}
        rope = dict(sub) if isinstance(sub, dict) else {}
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", 10000.0)
    factor = float(rope.get("partial_rotary_factor", 1.0))
    if "mrope_section" in rope and factor < 1.0:
        scale = round(1.0 / factor)
        section = [int(x) * scale for x in rope["mrope_section"]]
        if abs(1.0 / factor - scale) > 1e-6 or 2 * sum(section) != head_dim:
            raise ConfigError(f"mrope_section {rope['mrope_section']} with partial_rotary_factor "
                              f"{factor} cannot be rescaled to head_dim {head_dim}")
        rope["mrope_section"], rope["partial_rotary_factor"] = section, 1.0
    for key in ("type", "mrope_interleaved"):
        rope.pop(key, None)
    if "mrope_section" not in rope:
        rope.pop("partial_rotary_factor", None)
        lists = [k for k in ("short_factor", "long_factor") if rope.get(k)]
        if factor < 1.0 and lists:  # Phi-4-mini: one factor per rotated pair of the verifier
            raise ConfigError(
                f"the verifier's rope ({rope.get('rope_type')}) has {len(rope[lists[0]])} "
                f"{lists[0]} entries for partial_rotary_factor {factor:g}, but the draft layers "
                f"rotate the whole head ({head_dim // 2} pairs); this verifier is not supported "
                "(the reference cannot derive it either)")
    return rope


def zlab_build_target_layer_ids(num_verifier_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's / SpecForge's ``build_target_layer_ids(N, L)`` in z-lab ids (k reads HF
    ``output_hidden_states[k + 1]``): ``[N // 2]`` for one draft layer, else
    ``round(1 + i * (N - 4) / (L - 1))`` for i < L (z-lab dflash 0.1.0 ``dflash/model.py:25-34``,
    SpecForge 0.2.0 ``specforge/modeling/draft/dflash.py:271-281``; Python's ``round``, half to
    even, as theirs). Written from that formula; ``tests/test_framework_zlab.py`` compares it
    with z-lab's own function."""
    n, k = int(num_verifier_layers), int(num_draft_layers)
    if k == 1:
        return [n // 2]
    return [round(1 + (i * (n - 4)) / (k - 1)) for i in range(k)]


def default_target_layer_ids(num_verifier_layers: int, style: str = "zlab",
                             num_draft_layers: int | None = None) -> list[int]:
    """Default ``target_layer_ids`` for an N-layer verifier, speculators convention.

    ``style="zlab"``: 5 evenly spaced layers as in z-lab/dflash ``build_target_layer_ids``
    (their ids ``round(1 + i*(N-4)/4)`` for i=0..4, from 1 to N-3, read
    ``output_hidden_states[id + 1]``, so ours are those + 1: 2 .. N-2).
    ``style="per-draft-layer"``: the same function with one target layer per draft layer,
    ``build_target_layer_ids(N, num_draft_layers)`` + 1 (:func:`zlab_build_target_layer_ids`;
    z-lab's and SpecForge's default when the draft config names no ids: 1 draft layer ->
    ``[N//2 + 1]``).
    ``style="speculators"``: the reference's own default ``[2, N//2, N-3]``
    (``speculators/models/utils.py: resolve_target_layer_ids``).

    Raises:
        ConfigError: unknown style, ``per-draft-layer`` without ``num_draft_layers``, or a
            verifier too shallow for the ids.
    """
    n = num_verifier_layers
    if style == "speculators":
        ids = [2, n // 2, n - 3]
    elif style in ("zlab", "per-draft-layer"):
        count = 5 if style == "zlab" else num_draft_layers
        if not isinstance(count, int) or count < 1:
            raise ConfigError("target layer style 'per-draft-layer' needs the number of draft "
                              f"layers (got {count!r})")
        ids = [i + 1 for i in zlab_build_target_layer_ids(n, count)]
    else:
        raise ConfigError(f"unknown target layer style {style!r}; use 'zlab', "
                          "'per-draft-layer' or 'speculators'")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n:
        raise ConfigError(f"default {style} target layers {ids} invalid for {n} verifier layers "
                          "(too shallow for this style); give explicit target_layers ids below "
                          f"{n} in a TOML profile")
    return ids
