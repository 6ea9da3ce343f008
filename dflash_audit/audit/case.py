"""One audit case: the inputs both sides run on, and the outputs each side returns.

A case is a folder (the exchange format with the reference process, ``reference/adapter.py``):
``inputs.safetensors`` (batch tensors + ``anchor_positions`` [A] + ``anchor_valid`` [A]),
``weights.safetensors`` (one state dict, reference key names) and ``profile.json``
(``{"drafter": DFlashConfig.to_dict(), "loss": LossSpec fields}``); the reference writes
``outputs.safetensors`` + ``outputs.json`` beside them. A case that knows its verifier
(:class:`CaseVerifier`) also writes ``derive.json`` (and ``verifier/config.json`` for a proxy),
and the reference answers with ``derivation.json``: its own drafter-config derivation.

Output tensor keys (both sides): ``context`` [1,T,H], ``mask.<layer type>`` [Q,T+Q] bool,
``targets`` / ``logits`` [1,Q,V_d], ``aligned_loss_mask`` [1,Q], ``loss`` [],
``loss_weights.<term>`` [1,Q], ``grad.<parameter>``, ``anchor_draws`` [K,A] and
``anchor_draws_valid`` [K,A] (the side's own anchor selection, drawn K times).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.loss import LossSpec

#: How many anchor selections each side draws for the anchors check
#: (:mod:`dflash_audit.audit.checks.anchors`); written into profile.json for the reference.
ANCHOR_DRAWS = 512
BATCH_KEYS = ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask",
              "position_ids", "document_ids")


@dataclass
class CaseVerifier:
    """The verifier a case's drafter config was derived from.

    ``config``: its transformers config (or a namespace of its fields); ``folder``: a folder
    holding its ``config.json`` (and tokenizer, for a real verifier) the reference derives
    from, or None (``config`` is written beside the case); ``target_layers``: the profile's
    ``target_layers`` spec (``"speculators"`` makes the reference's default ids comparable).
    """

    name: str
    config: Any
    folder: str | None = None
    target_layers: Any = None

    def config_dict(self) -> dict[str, Any]:
        """The config as a ``config.json`` dict."""
        cfg = self.config
        return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))

    def write_derive_request(self, case_dir: Path, config: DFlashConfig) -> None:
        """``case_dir/derive.json`` for the adapter: the verifier folder and the case's draft
        layout (layer count, sliding window, full-attention layer indices)."""
        folder = self.folder
        if folder is None:
            folder_path = case_dir / "verifier"
            folder_path.mkdir(exist_ok=True)
            (folder_path / "config.json").write_text(
                json.dumps(self.config_dict(), indent=1, default=str))
            folder = str(folder_path)
        types = config.effective_layer_types
        (case_dir / "derive.json").write_text(json.dumps({
            "verifier_dir": folder, "num_layers": config.num_hidden_layers,
            "sliding_window": config.sliding_window or 2048,
            "full_attention_indices": [i for i, t in enumerate(types)
                                       if t == "full_attention"]}))


@dataclass
class Case:
    """Inputs of one comparison: the same for candidate and reference."""

    name: str
    config: DFlashConfig
    loss: LossSpec
    inputs: dict[str, torch.Tensor]  # BATCH_KEYS + anchor_positions [A] + anchor_valid [A]
    weights: dict[str, torch.Tensor]  # reference state-dict keys
    description: str = ""
    #: The verifier ``config`` was derived from, for the ``derivation`` check: a
    #: :class:`CaseVerifier`, or None (no derivation compared).
    verifier: CaseVerifier | None = None

    def write(self, folder: Path) -> Path:
        """Write the case into ``folder/<name>`` and return that path."""
        path = folder / self.name
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.inputs.items()}, path / "inputs.safetensors")
        save_file({k: v.contiguous() for k, v in self.weights.items()},
                  path / "weights.safetensors")
        (path / "profile.json").write_text(json.dumps(
            {"drafter": self.config.to_dict(), "loss": dataclasses.asdict(self.loss),
             "description": self.description, "anchor_draws": ANCHOR_DRAWS}, indent=1))
        if self.verifier is not None:
            self.verifier.write_derive_request(path, self.config)
        return path


@dataclass
class SideOutputs:
    """What one side (candidate or reference) produced for a case."""

    tensors: dict[str, torch.Tensor]
    metrics: dict[str, float]
    structure: dict[str, Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    trainable: list[str] = field(default_factory=list)
    #: The side's drafter-config derivation from the case's verifier (flat dict of
    #: :func:`dflash_audit.model.derivation.derivation_fields` keys), None when not provided.
    derivation: dict[str, Any] | None = None

    @classmethod
    def read(cls, case_dir: Path) -> SideOutputs:
        """Read what the reference adapter wrote into ``case_dir``.

        Raises:
            FileNotFoundError: the adapter wrote no outputs for this case.
        """
        meta = json.loads((case_dir / "outputs.json").read_text())
        derived = case_dir / "derivation.json"
        return cls(tensors=load_file(case_dir / "outputs.safetensors"), metrics=meta["metrics"],
                   structure=meta["structure"], defaults=meta.get("defaults", {}),
                   trainable=meta.get("trainable", []),
                   derivation=json.loads(derived.read_text()) if derived.is_file() else None)
