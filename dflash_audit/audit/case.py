"""One audit case: the inputs both sides run on, and the outputs each side returns.

A case is a folder (the exchange format with the reference process, ``reference/adapter.py``):
``inputs.safetensors`` (batch tensors + ``anchor_positions`` [A] + ``anchor_valid`` [A]),
``weights.safetensors`` (one state dict, reference key names) and ``profile.json``
(``{"drafter": DFlashConfig.to_dict(), "loss": LossSpec fields, "dtype": "fp32" | "bf16",
"device": "cpu" | "cuda"}``); the reference writes ``outputs.safetensors`` + ``outputs.json``
beside them (with ``noise``, its own bf16-vs-fp32 differences, when the dtype is not fp32:
:mod:`dflash_audit.audit.precision`).

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
class Case:
    """Inputs of one comparison: the same for candidate and reference."""

    name: str
    config: DFlashConfig
    loss: LossSpec
    inputs: dict[str, torch.Tensor]  # BATCH_KEYS + anchor_positions [A] + anchor_valid [A]
    weights: dict[str, torch.Tensor]  # reference state-dict keys
    description: str = ""
    dtype: str = "fp32"  # compute dtype (dflash_audit.audit.precision.DTYPES)
    device: str = "cpu"
    #: per-quantity {"atol", "rtol"} derived from measured noise (None: the dtype's table)
    tolerances: dict[str, dict[str, float]] | None = None

    def write(self, folder: Path) -> Path:
        """Write the case into ``folder/<name>`` and return that path."""
        path = folder / self.name
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.inputs.items()}, path / "inputs.safetensors")
        save_file({k: v.contiguous() for k, v in self.weights.items()},
                  path / "weights.safetensors")
        (path / "profile.json").write_text(json.dumps(
            {"drafter": self.config.to_dict(), "loss": dataclasses.asdict(self.loss),
             "description": self.description, "anchor_draws": ANCHOR_DRAWS,
             "dtype": self.dtype, "device": self.device}, indent=1))
        return path


@dataclass
class SideOutputs:
    """What one side (candidate or reference) produced for a case."""

    tensors: dict[str, torch.Tensor]
    metrics: dict[str, float]
    structure: dict[str, Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    trainable: list[str] = field(default_factory=list)
    #: the reference's own low-precision noise per quantity (dflash_audit.audit.precision)
    noise: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, case_dir: Path) -> SideOutputs:
        """Read what the reference adapter wrote into ``case_dir``.

        Raises:
            FileNotFoundError: the adapter wrote no outputs for this case.
        """
        meta = json.loads((case_dir / "outputs.json").read_text())
        return cls(tensors=load_file(case_dir / "outputs.safetensors"), metrics=meta["metrics"],
                   structure=meta["structure"], defaults=meta.get("defaults", {}),
                   trainable=meta.get("trainable", []), noise=meta.get("noise", {}))
