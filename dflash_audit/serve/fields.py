"""The vocabulary of ``serve-check``: what a drafter is served as and what it was trained as,
as one flat record of named fields, each with the code that decided it.

Every side (the reference's loading, our drafter's, each engine's) writes the same record, so
the comparison is field by field. Keys, values and units:

=================================  ==========================================================
``num_hidden_layers``              draft decoder layers (int)
``hidden_size``                    H (int); ``num_attention_heads``, ``num_key_value_heads``,
                                   ``head_dim``, ``intermediate_size`` (int);
                                   ``rms_norm_eps`` (float); ``hidden_act`` (str)
``layers.{i}.attention``           ``"full"`` or ``"sliding"`` for draft layer i
``layers.{i}.sliding_window``      W in tokens, ``None`` for a full layer
``layers.{i}.block_causal``        whether slot s of a block sees only slots <= s (bool)
``layers.{i}.window_origin``       where W is counted back from: ``"anchor"`` (the reference
                                   trains with ``kv >= a - W`` for every slot) or ``"query"``
                                   (``kv > q - W``, q the slot's own position); ``None`` for
                                   a full layer
``rope.type``                      ``"default"``, ``"yarn"``, ``"linear"``, ``"llama3"`` ...
``rope.theta``                     base (float)
``rope.scaling``                   the scaling parameters besides type and theta (dict or
                                   ``None``)
``rope.rotary_dim``                rotated features per head (int; ``head_dim`` = whole head)
``rope.neox_style``                rotate-half (True) or interleaved pairs (False)
``rope.max_positions``             positions the rotary table covers (int): RoPE of a
                                   position at or past it is wrong or an error
``norm.one_plus_weight``           the draft's RMSNorms compute ``x * (1 + w)`` (Gemma style)
``target_layer_ids``               verifier layers read, in the speculators convention
                                   (id L = residual stream after L layers), list[int]
``fc.in_features``                 features ``fc`` reads (int, = len(target_layer_ids) * H)
``mask_token_id``                  token id of the block's mask slots (int)
``block_size``                     B (int)
``num_speculative_tokens``         tokens proposed per drafting step (int)
``sample_from_anchor``             slot 0 is drafted too (bool)
``draft_vocab_size``               V_d (int; = V without a draft vocabulary)
``draft_vocab.mapping``            ``"d2t offsets"`` (target id = i + d2t[i]), ``"none"``
``lm_head.source``                 ``"checkpoint"`` (the draft's lm_head.weight) or
                                   ``"target"`` (the verifier's / target model's head)
``embed_tokens.source``            ``"checkpoint"`` or ``"target"``
``mask_embedding.source``          what a mask slot is embedded with: ``"embed_tokens[mask_
                                   token_id]"`` (as trained) or ``"mask_embedding.pt"`` (a
                                   vector in that file of the checkpoint folder, which vLLM
                                   and SGLang substitute)
=================================  ==========================================================

``dtype`` (the precision the draft is computed in) and engine-only settings
(``embed_tokens.scale``, ``logits.multiplier``, ``logits.softcap``, ``runner.*``,
``rope.max_positions_raised_to_target``) may be written too.

A side that cannot compute a field leaves it out and says why in ``not_run`` (e.g. "not run
here: needs CUDA"); nothing is guessed. ``sources[key]`` names the file and function (or the
config key) that decided the value, e.g.
``vllm/model_executor/models/qwen3_dflash.py:_resolve_layer_attention``.

Probe output (``probe.json``, written by every engine's or the reference's probe)::

    {"side": "vllm 0.33.0", "fields": {key: value}, "sources": {key: "file:function"},
     "not_run": {key: "why"}, "refused": null | "the engine's own error, one line",
     "notes": ["..."], "masks": {"0": {"anchor": a, "total_seq_len": T, "rows": [[0, 1, ...]],
     "source": "file:function"}}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


#: ``mask_embedding.source`` values: a mask slot embedded as the reference trains it
#: (``speculators/models/dflash/core.py``: ``embed_tokens(mask_token_ids)``), or with the vector
#: of this file of the checkpoint folder (vLLM ``qwen3_dflash.py:_read_mask_embedding``, SGLang
#: ``dflash_worker_v2.py:_maybe_merge_trained_mask_embedding``).
MASK_EMBEDDING_ROW, MASK_EMBEDDING_FILE = "embed_tokens[mask_token_id]", "mask_embedding.pt"


@dataclass
class SideRecord:
    """One side's answer: what it will run (an engine) or what it trained (reference, ours).

    ``fields``: key -> JSON value (see the module docstring); ``sources``: key -> the code or
    config key that decided it; ``not_run``: key -> why the side could not compute it;
    ``refused``: the side's own error when it refuses the checkpoint (then ``fields`` may be
    empty); ``notes``: free lines for the report (what the adapter had to invent);
    ``masks``: layer index (str) -> ``{"anchor", "total_seq_len", "rows", "source"}``, the
    ``[B, T + B]`` 0/1 rows of one block as the side's own mask code builds them
    (:mod:`dflash_audit.serve.attention`), where the side has such code.
    """

    side: str
    fields: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)
    refused: str | None = None
    notes: list[str] = field(default_factory=list)
    masks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the engine's refusal of the folder as it is, when the record is of a conversion
    refused_as_is: str | None = None

    def set(self, key: str, value: Any, source: str) -> None:
        """Record ``key = value`` as decided by ``source`` (``file:function`` or a config key)."""
        self.fields[key] = jsonable(value)
        self.sources[key] = source

    def to_dict(self) -> dict[str, Any]:
        """The record as written to ``probe.json`` / ``report.json``."""
        return {"side": self.side, "fields": self.fields, "sources": self.sources,
                "not_run": self.not_run, "refused": self.refused, "notes": self.notes,
                "masks": self.masks, "refused_as_is": self.refused_as_is}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SideRecord:
        """Inverse of :meth:`to_dict`. Raises ``KeyError`` / ``TypeError`` on a bad record."""
        return cls(side=str(d["side"]), fields=dict(d["fields"]), sources=dict(d["sources"]),
                   not_run=dict(d.get("not_run") or {}), refused=d.get("refused"),
                   notes=list(d.get("notes") or []), masks=dict(d.get("masks") or {}),
                   refused_as_is=d.get("refused_as_is"))

    def write(self, path: str | Path) -> None:
        """Write the record as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON: tuples to lists, numpy / torch scalars to Python numbers,
    ``inf`` / ``nan`` to strings (JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def layer_key(i: int, name: str) -> str:
    """``layers.{i}.{name}``."""
    return f"layers.{i}.{name}"
