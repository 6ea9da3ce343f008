"""One audit case: the inputs both sides run on, and the outputs each side returns.

A case is a folder (the exchange format with the reference process, ``reference/adapter.py``):
``inputs.safetensors`` (batch tensors + ``anchor_positions`` [A] + ``anchor_valid`` [A]),
``weights.safetensors`` (one state dict, reference key names) and ``profile.json``
(``{"drafter": DFlashConfig.to_dict(), "loss": LossSpec fields, "dtype": "fp32" | "bf16",
"device": "cpu" | "cuda"}``); the reference writes ``outputs.safetensors`` + ``outputs.json``
beside them (with ``noise``, its own bf16-vs-fp32 differences, when the dtype is not fp32:
:mod:`dflash_audit.audit.precision`). A case that knows its verifier (:class:`CaseVerifier`)
also writes ``derive.json`` (and ``verifier/config.json`` for a proxy), and the reference answers
with ``derivation.json``: its own drafter-config derivation.

Output tensor keys (both sides): ``context`` [1,T,H], ``mask.<layer type>`` [Q,T+Q] bool,
``targets`` / ``logits`` [1,Q,V_d], ``aligned_loss_mask`` [1,Q], ``loss`` [],
``loss_weights.<term>`` [1,Q], ``grad.<parameter>``, ``anchor_draws`` [K,A] and
``anchor_draws_valid`` [K,A] (the side's own anchor selection, drawn K times).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_audit.atomic import save_safetensors
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.loss import LossSpec
from dflash_audit.user_input import loads_json, read_output_json

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

    @classmethod
    def read(cls, case_dir: Path) -> CaseVerifier | None:
        """The verifier of a case folder from its ``derive.json`` (None without one): the
        config from the folder it names, as a transformers config where its ``model_type`` is
        known, else a namespace of its fields (what the candidate process derives from)."""
        request = case_dir / "derive.json"
        if not request.is_file():
            return None
        args = loads_json(request.read_text())
        folder = Path(args["verifier_dir"])
        if not (folder / "config.json").is_file():  # a copied case (the canary): its own copy
            folder = case_dir / "verifier"
        if not (folder / "config.json").is_file():
            return None  # the verifier is gone: no derivation for this case
        try:
            from transformers import AutoConfig

            config: Any = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError, KeyError):
            config = SimpleNamespace(**loads_json((folder / "config.json").read_text()))
        return cls(name=args.get("name", folder.name), config=config, folder=str(folder),
                   target_layers=args.get("target_layers"))

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
            "name": self.name, "target_layers": self.target_layers,
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
    dtype: str = "fp32"  # compute dtype (dflash_audit.audit.precision.DTYPES)
    device: str = "cpu"
    #: per-quantity {"atol", "rtol"} derived from measured noise (None: the dtype's table)
    tolerances: dict[str, dict[str, float]] | None = None
    #: why the audited framework cannot run this case (its CAPABILITIES); non-empty: the
    #: candidate skips ``run_case`` and only its anchor sampler and derivation are audited
    unsupported: list[str] = field(default_factory=list)

    def write(self, folder: Path) -> Path:
        """Write the case into ``folder/<name>`` and return that path."""
        path = folder / self.name
        path.mkdir(parents=True, exist_ok=True)
        save_safetensors({k: v.contiguous() for k, v in self.inputs.items()},
                         path / "inputs.safetensors")
        save_safetensors({k: v.contiguous() for k, v in self.weights.items()},
                         path / "weights.safetensors")
        (path / "profile.json").write_text(json.dumps(
            {"drafter": self.config.to_dict(), "loss": dataclasses.asdict(self.loss),
             "description": self.description, "anchor_draws": ANCHOR_DRAWS,
             "dtype": self.dtype, "device": self.device,
             **({"unsupported": list(self.unsupported)} if self.unsupported else {})},
            indent=1))
        if self.verifier is not None:
            self.verifier.write_derive_request(path, self.config)
        return path

    @classmethod
    def read(cls, path: Path) -> Case:
        """Read a case folder written by :meth:`write` (the case's name is the folder's name).

        Raises:
            OSError: a file is missing or unreadable.
            ValueError: ``profile.json`` is not valid JSON or holds invalid fields
                (:class:`~dflash_audit.model.config.ConfigError` is a ValueError).
        """
        path = Path(path)
        profile = loads_json((path / "profile.json").read_text())
        return cls(name=path.name, config=DFlashConfig.from_dict(profile["drafter"]),
                   loss=LossSpec(**profile["loss"]),
                   inputs=load_file(path / "inputs.safetensors"),
                   weights=load_file(path / "weights.safetensors"),
                   description=profile.get("description", ""),
                   dtype=profile.get("dtype", "fp32"), device=profile.get("device", "cpu"),
                   verifier=CaseVerifier.read(path),
                   unsupported=list(profile.get("unsupported") or []))


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
    #: the reference's own low-precision noise per quantity (dflash_audit.audit.precision)
    noise: dict[str, float] = field(default_factory=dict)
    #: free-form facts of the side's run; ``"provenance"``: ``{output key or prefix ending in
    #: ".": "framework" | "adapter"}``, who computed each output for this case
    #: (:mod:`dflash_audit.audit.frameworks.provenance`)
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, case_dir: Path) -> SideOutputs:
        """Read what the reference adapter wrote into ``case_dir``.

        Raises:
            FileNotFoundError: the adapter wrote no outputs for this case.
            OSError / ValueError / KeyError: a file is not a regular file (a symlink, a FIFO),
                not JSON, ``outputs.json`` not an object or without its fields.
        """
        meta = read_output_json(case_dir / "outputs.json")
        if not isinstance(meta, dict):
            raise ValueError(f"outputs.json is a JSON {type(meta).__name__}, not an object")
        derived = case_dir / "derivation.json"
        return cls(tensors=load_file(case_dir / "outputs.safetensors"), metrics=meta["metrics"],
                   structure=meta["structure"], defaults=meta.get("defaults", {}),
                   trainable=meta.get("trainable", []), noise=meta.get("noise", {}),
                   metadata=meta.get("metadata") if isinstance(meta.get("metadata"), dict)
                   else {},
                   derivation=read_output_json(derived) if os.path.lexists(derived) else None)

    def write(self, case_dir: Path) -> None:
        """Write ``outputs.safetensors`` + ``outputs.json`` into ``case_dir`` (the files
        :meth:`read` reads; the candidate process writes its side this way). Tensors are
        detached and copied (safetensors refuses tensors that share memory); metrics that are
        not numbers are written as their ``repr`` (the protocol check names them); NaN / inf
        metrics are kept (``json`` writes them as NaN / Infinity).

        Raises:
            TypeError: a value of ``tensors`` is not a ``torch.Tensor``.
        """
        case_dir = Path(case_dir)
        for key, value in self.tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tensors[{key!r}] is a {type(value).__name__}; expected a "
                                "torch.Tensor")
        save_safetensors({k: v.detach().cpu().contiguous().clone()
                          for k, v in self.tensors.items()}, case_dir / "outputs.safetensors")
        (case_dir / "outputs.json").write_text(json.dumps({
            "metrics": {k: _metric_value(v) for k, v in self.metrics.items()},
            "structure": self.structure, "defaults": self.defaults,
            "trainable": list(self.trainable), "metadata": self.metadata}, indent=1,
            sort_keys=True, default=repr))
        if self.derivation is not None:
            (case_dir / "derivation.json").write_text(json.dumps(self.derivation, indent=1))


def _metric_value(value: Any) -> float | str:
    """A metric as a float when it is a number: an int or float (not a bool), or a one-element
    floating / integer tensor or numpy scalar. Anything else (a string such as ``"0.0068"``, a
    bool, a list) is kept as its ``repr``, so the protocol check names it instead of a silent
    ``float()`` conversion passing it."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        return repr(value)
    if isinstance(value, torch.Tensor) and (value.numel() != 1 or value.dtype == torch.bool
                                            or value.is_complex()):
        return repr(value)
    dtype = getattr(value, "dtype", None)  # numpy scalars and arrays
    if dtype is not None and not isinstance(value, torch.Tensor) and getattr(
            dtype, "kind", "f") not in "fiu":
        return repr(value)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return repr(value)
