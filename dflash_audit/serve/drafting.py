"""The served drafting step against the training forward, on one checkpoint and its verifier
(``serve-check`` item 5; z-lab ``dflash`` 0.1.0, the engine that drafts on CPU).

:func:`compare_drafting` runs ``probes/zlab_drafting.py`` in a process of its own (z-lab's
cached site folder and this project on ``PYTHONPATH``) and returns a
:class:`DraftingComparison`:

* ``step`` (:class:`DraftingStep`): ONE drafting step on a real context -- the verifier's
  prefill of a prompt, its first greedy token as slot 0, then ``[token, mask, ..., mask]`` --
  by z-lab's model laid out as ``dflash_generate`` lays it out, and by our training forward
  (:class:`~dflash_audit.model.drafter.DFlashDrafter` of ``load_pretrained``, the anchor at
  the first generated position, the same block), the max abs difference of the draft logits
  (slots 1..B-1) against an fp32 tolerance, and, when they differ, the served fields that
  differ from the trained ones (:func:`trained_fields`) and whether our forward run with the
  served values (:func:`training_logits` with ``served``) reproduces z-lab's logits
  (``explained``);
* ``acceptance`` (:class:`AcceptanceComparison`): the mean acceptance length of z-lab's own
  greedy ``dflash_generate`` loop on a few held-out prompts beside the training-time
  teacher-forced estimate (our forward over the same text with an anchor at every generated
  position, 0.9.0's leading-run EAL of :func:`dflash_audit.model.metrics.dflash_metrics`).

The helpers below are ours (no z-lab import): the probe calls them for the trained side.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_audit.model.drafter import DFlashDrafter, block_indices
from dflash_audit.serve.attention import serving_mask

#: Held-out prompts of the acceptance measurement when none are given (rendered with the
#: verifier's chat template when it has one).
DEFAULT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                   "Explain what a hash table is in one sentence.")
#: Max abs difference of fp32 draft logits read as the same computation.
FP32_TOLERANCE = 1e-4
DRAFTING_PROBE = Path(__file__).resolve().parent / "probes" / "zlab_drafting.py"


@dataclass
class DraftingStep:
    """One drafting step, served (z-lab) vs trained (our forward).

    ``context_tokens``: the prompt (the context); ``slot0_token``: the verifier's first greedy
    token; ``served_drafts`` / ``trained_drafts``: argmax of slots 1..B-1;
    ``max_abs_diff`` of their logits; ``equal``: ``max_abs_diff <= tolerance``;
    ``differences``: ``"key: served X, trained Y"`` for every drafting field that differs;
    ``explained``: our forward with the served values reproduces z-lab's logits within the
    tolerance (None when nothing differs); ``explained_max_abs_diff``: its difference.
    """

    context_tokens: int
    block_size: int
    slot0_token: int
    served_drafts: list[int]
    trained_drafts: list[int]
    max_abs_diff: float
    tolerance: float
    equal: bool
    differences: list[str] = field(default_factory=list)
    explained: bool | None = None
    explained_max_abs_diff: float | None = None


@dataclass
class AcceptanceComparison:
    """Mean acceptance length (tokens per verify step: accepted drafts + 1) served by z-lab's
    greedy ``dflash_generate`` vs the training-time teacher-forced estimate (leading-run EAL
    over every generated position), on the same prompts and text."""

    prompts: int
    max_new_tokens: int
    served: float
    trained: float
    served_per_prompt: list[float] = field(default_factory=list)
    trained_per_prompt: list[float] = field(default_factory=list)
    served_verify_steps: int = 0
    trained_blocks: int = 0


@dataclass
class DraftingComparison:
    """The drafting comparison of one checkpoint as served by one engine (:func:`compare_drafting`)."""

    side: str
    checkpoint: str
    verifier: str
    step: DraftingStep
    acceptance: AcceptanceComparison | None = None
    served_fields: dict[str, Any] = field(default_factory=dict)
    trained_fields: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftingComparison:
        acc = d.get("acceptance")
        return cls(side=d["side"], checkpoint=d["checkpoint"], verifier=d["verifier"],
                   step=DraftingStep(**d["step"]),
                   acceptance=AcceptanceComparison(**acc) if acc else None,
                   served_fields=dict(d.get("served_fields") or {}),
                   trained_fields=dict(d.get("trained_fields") or {}),
                   notes=list(d.get("notes") or []), wall_s=float(d.get("wall_s") or 0.0))


def compare_drafting(checkpoint: str | Path, verifier: str | Path | None = None, *,
                     served: str | Path | None = None, prompts: list[Any] | None = None,
                     num_prompts: int = 2, max_new_tokens: int = 16,
                     tolerance: float = FP32_TOLERANCE, acceptance: bool = True,
                     offline: bool = False) -> DraftingComparison:
    """Run the z-lab drafting comparison (module docstring) in a process of its own.

    Args:
        checkpoint: the trained drafter (speculators format).
        verifier: HF folder (or hub id) of the verifier; default: the one the checkpoint names.
        served: the folder z-lab is given (z-lab format); default: the adapter's conversion
            of ``checkpoint`` (what the probe of ``serve-check --engine zlab`` loads).
        prompts: strings (rendered with the verifier's chat template) or token-id lists;
            default the first ``num_prompts`` of :data:`DEFAULT_PROMPTS`. The first one is the
            context of the drafting step.
        max_new_tokens: tokens z-lab generates per prompt for the acceptance measurement.
        acceptance: False runs the drafting step only.

    Raises:
        ServeCheckError: no verifier, z-lab not installable, the probe failed or timed out.
    """
    from dflash_audit.serve.engines import ENGINES, ServeCheckError, install_engine, run_script

    engine = ENGINES["zlab"]
    from dflash_audit.serve.checkpoint import read_checkpoint

    verifier = verifier or read_checkpoint(checkpoint).verifier
    if not verifier:
        raise ServeCheckError(f"{checkpoint}/config.json names no verifier "
                              "(speculators_config.verifier.name_or_path): give the verifier")
    site = install_engine(engine, offline=offline)
    spec = {"checkpoint": str(Path(checkpoint).resolve()), "verifier": str(verifier),
            "served": str(Path(served).resolve()) if served else None,
            "prompts": list(prompts) if prompts else list(DEFAULT_PROMPTS[:num_prompts]),
            "max_new_tokens": int(max_new_tokens), "tolerance": float(tolerance),
            "acceptance": bool(acceptance)}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dflash-drafting-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        d = run_script(DRAFTING_PROBE, [str(spec_file)], site,
                       f"the {engine.label} drafting comparison")
    if d.get("refused"):
        raise ServeCheckError(f"{engine.label} refuses the checkpoint: {d['refused']}")
    d["wall_s"] = round(time.perf_counter() - start, 2)
    return DraftingComparison.from_dict(d)


# --------------------------------------------------------------------- the trained side
def trained_fields(drafter: DFlashDrafter) -> dict[str, Any]:
    """The drafting fields (keys of :mod:`dflash_audit.serve.fields`) our training forward
    runs with for ``drafter`` -- only those a served drafting step is compared on."""
    from dflash_audit.model.mask import block_is_causal

    c = drafter.config
    out: dict[str, Any] = {}
    for i in range(c.num_hidden_layers):
        w = c.sliding_window if c.is_sliding(i) else None
        out[f"layers.{i}.attention"] = "sliding" if w is not None else "full"
        out[f"layers.{i}.sliding_window"] = w
        out[f"layers.{i}.block_causal"] = block_is_causal(w, c.sliding_window_non_causal)
        out[f"layers.{i}.window_origin"] = "anchor" if w is not None else None
    rope = dict(c.rope_parameters or {})
    out["rope.type"] = rope.pop("rope_type", "default")
    out["rope.theta"] = float(c.rope_theta)
    rope.pop("rope_theta", None)
    out["rope.scaling"] = rope or None
    out["rope.rotary_dim"] = 2 * int(drafter.rotary_emb.inv_freq.numel())
    out["target_layer_ids"] = list(c.target_layer_ids)
    out["fc.in_features"] = drafter.fc.in_features
    out["mask_token_id"] = c.mask_token_id
    out["block_size"] = c.block_size
    out["norm.one_plus_weight"] = bool(drafter.norm.one_plus_weight)
    out["draft_vocab_size"] = c.effective_draft_vocab_size
    out["embed_tokens.scale"] = 1.0
    out["logits.multiplier"] = 1.0
    out["logits.softcap"] = None
    return out


def field_differences(served: dict[str, Any], trained: dict[str, Any]) -> list[str]:
    """``"key: served X, trained Y"`` for every trained key whose served value differs."""
    return [f"{k}: served {served.get(k)!r}, trained {v!r}" for k, v in trained.items()
            if served.get(k) != v]


def _served_drafter(drafter: DFlashDrafter, served: dict[str, Any]) -> DFlashDrafter:
    """Our drafter, same weights, with the served config values (layer types, window, RoPE,
    mask token, target layers) and the served masks
    (:func:`~dflash_audit.serve.attention.serving_mask`)."""
    c = drafter.config
    n = c.num_hidden_layers
    sliding = [served.get(f"layers.{i}.attention") == "sliding" for i in range(n)]
    windows = [served.get(f"layers.{i}.sliding_window") for i in range(n) if sliding[i]]
    scaling = dict(served.get("rope.scaling") or {})
    rope_type = served.get("rope.type", "default")
    config = c.replace(
        layer_types=tuple(SLIDING_ATTENTION if x else FULL_ATTENTION for x in sliding),
        sliding_window=min(windows) if windows else None,
        rope_theta=float(served.get("rope.theta", c.rope_theta)),
        rope_parameters=({"rope_type": rope_type, **scaling}
                         if rope_type != "default" or scaling else None),
        mask_token_id=int(served.get("mask_token_id", c.mask_token_id)),
        target_layer_ids=tuple(served.get("target_layer_ids", c.target_layer_ids)))
    model = DFlashDrafter(config)
    model.load_state_dict(drafter.state_dict(), strict=False)
    model.eval()
    per_type = {}
    for i in range(n):
        t = SLIDING_ATTENTION if sliding[i] else FULL_ATTENTION
        per_type.setdefault(t, (served.get(f"layers.{i}.sliding_window"),
                                bool(served.get(f"layers.{i}.block_causal")),
                                served.get(f"layers.{i}.window_origin")))
    model.attention_masks = lambda doc, anchors: {  # type: ignore[method-assign]
        t: serving_mask(doc, anchors, config.block_size, *v) for t, v in per_type.items()}
    return model


def _row(features: torch.Tensor, ids: list[int], anchors: list[int], B: int, mask_id: int,
         supervised_from: int) -> dict[str, torch.Tensor]:
    """One packed row of ``ids`` (padded with B mask tokens so every block fits), the
    features padded with zeros (never attended: kv < anchor), the given anchors."""
    T = len(ids) + B
    hs = torch.zeros(1, T, features.shape[-1])
    hs[:, :features.shape[1]] = features
    input_ids = torch.tensor([list(ids) + [mask_id] * B])
    loss_mask = torch.zeros(1, T)
    loss_mask[0, supervised_from:len(ids)] = 1
    return {"hidden_states": hs, "input_ids": input_ids, "loss_mask": loss_mask,
            "verifier_last_hidden_states": torch.zeros(1, T, 1),
            "document_ids": torch.zeros(1, T, dtype=torch.long),
            "position_ids": torch.arange(T)[None],
            "anchor_positions": torch.tensor(anchors, dtype=torch.long),
            "anchor_valid": torch.ones(len(anchors), dtype=torch.bool)}


def _forward_logits(drafter: DFlashDrafter, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """Draft logits [1, Q, V] of our training forward (targets are not needed here: the
    verifier's own logits are the targets, so its last states are not passed)."""
    d = drafter
    saved = d.targets
    d.targets = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            return d(**row).logits
    finally:
        d.targets = saved  # type: ignore[method-assign]


def verifier_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]
                      ) -> torch.Tensor:
    """``[1, T, n*H]`` training features: HF ``output_hidden_states[L]`` of each speculators
    id L, ascending (the capture's convention, DESIGN §3)."""
    return torch.cat([hidden_states[int(L)] for L in sorted(layer_ids)], dim=-1).float()


def training_logits(drafter: DFlashDrafter, hidden_states: tuple[torch.Tensor, ...],
                    ids: list[int], anchor: int, served: dict[str, Any] | None = None
                    ) -> torch.Tensor:
    """``[B, V]`` logits (verifier ids, :func:`target_space`) of our training forward for the
    block anchored at ``anchor``
    (slot 0 = ``ids[anchor]``, context = positions < anchor) on the verifier's
    ``hidden_states`` (HF ``output_hidden_states`` of ``ids[:anchor]`` or longer).

    ``served``: the served fields; our drafter then runs with the served values (config and
    masks, :func:`_served_drafter`) and the served logit multiplier / softcap, to test whether
    they explain a difference."""
    model = _served_drafter(drafter, served) if served else drafter
    c = model.config
    feats = verifier_features(hidden_states, list(c.target_layer_ids))[:, :anchor]
    row = _row(feats, list(ids[:anchor + 1]), [anchor], c.block_size, c.mask_token_id, anchor)
    logits = target_space(_forward_logits(model, row)[0], model)
    if served:
        logits = logits * float(served.get("logits.multiplier") or 1.0)
        cap = served.get("logits.softcap")
        if cap:
            logits = torch.tanh(logits / float(cap)) * float(cap)
    return logits


def target_space(logits: torch.Tensor, drafter: DFlashDrafter) -> torch.Tensor:
    """``[..., V_d]`` draft logits as ``[..., V]`` over verifier ids (draft id i is verifier
    id ``i + d2t[i]``; ``-inf`` outside the draft vocabulary); unchanged without a draft
    vocabulary. What an engine's logits over the target's vocabulary are compared with."""
    c = drafter.config
    if not c.uses_draft_vocab:
        return logits
    ids = torch.arange(c.effective_draft_vocab_size) + drafter.d2t.long()
    out = logits.new_full((*logits.shape[:-1], c.vocab_size), float("-inf"))
    out[..., ids] = logits
    return out


def teacher_forced_acceptance(drafter: DFlashDrafter, hidden_states: tuple[torch.Tensor, ...],
                              verifier_logits: torch.Tensor, ids: list[int], prompt_len: int
                              ) -> tuple[float, float]:
    """The training-time estimate on one text: our forward with an anchor at every generated
    position ``prompt_len .. len(ids) - B`` (the whole block inside the text), targets = the
    verifier's logits at ``a + s - 1``, leading-run EAL (speculators 0.9.0). Returns
    ``(eal_sum, blocks)``."""
    from dflash_audit.model.metrics import dflash_metrics

    c = drafter.config
    B = c.block_size
    anchors = list(range(prompt_len, len(ids) - B + 1))
    if not anchors:
        return 0.0, 0.0
    feats = verifier_features(hidden_states, list(c.target_layer_ids))
    row = _row(feats, ids, anchors, B, c.mask_token_id, prompt_len)
    logits = target_space(_forward_logits(drafter, row), drafter)
    idx = block_indices(row["anchor_positions"], B)
    targets = verifier_logits[:, idx - 1].float()
    m = drafter.aligned_loss_mask(row["loss_mask"], idx, row["anchor_valid"])
    metrics = dflash_metrics(logits, targets, m, B)
    return metrics["eal_sum"], metrics["eal_total"]
