"""A drafter checkpoint folder as ``serve-check`` reads it, before any side loads it.

Two formats: speculators' (``config.json`` with ``speculators_model_type: "dflash"``, as
``dflash-audit train`` and the reference's ``save_pretrained`` write it; see
:mod:`dflash_audit.model.checkpoint`) and z-lab's (a Qwen3-style ``config.json`` with a
``dflash_config`` block, as z-lab's published drafters ship). The weights are every
``*.safetensors`` file of the folder; only their headers are read here (names and shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.serve.engines import ServeCheckError
from dflash_audit.user_input import loads_json

SPECULATORS, ZLAB = "speculators", "zlab"


@dataclass
class CheckpointFolder:
    """``path``; ``format`` (``speculators`` / ``zlab``); the parsed ``config``; ``weights``
    (tensor name -> shape, from the safetensors headers); ``verifier`` (the verifier the
    config names, or None)."""

    path: Path
    format: str
    config: dict[str, Any]
    weights: dict[str, list[int]] = field(default_factory=dict)
    verifier: str | None = None


def read_checkpoint(path: str | Path) -> CheckpointFolder:
    """Read and classify ``path``.

    Raises:
        ServeCheckError: not a folder, no or unreadable ``config.json``, a config that is not
            a DFlash drafter's, no ``*.safetensors`` weights or a damaged one (each one line
            naming the folder and what to give instead).
    """
    from safetensors import SafetensorError, safe_open

    from dflash_audit.model.checkpoint import follow_latest

    # a run folder or its checkpoints/latest pointer, as `eval --checkpoint` takes them;
    # absolute, as the engines' probes and the reference run in folders of their own
    path = follow_latest(Path(path).expanduser().absolute())
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ServeCheckError(f"{path} {what}: give a drafter checkpoint folder (its "
                              "config.json and model.safetensors), e.g. one under "
                              "runs/<run>/checkpoints/")
    config_path = path / "config.json"
    if not config_path.is_file():
        if config_path.is_symlink():
            raise ServeCheckError(f"{config_path} is a link that leads to no file (broken or "
                                  "a loop): replace it with the config itself")
        raise ServeCheckError(f"{path} has no config.json: not a drafter checkpoint; give a "
                              "checkpoint folder (config.json + model.safetensors), a run "
                              "folder or its checkpoints/latest")
    try:
        config = loads_json(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServeCheckError(f"{config_path} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ServeCheckError(f"{config_path} holds a {type(config).__name__}, not a config")
    if config.get("speculators_model_type") == "dflash":
        fmt = SPECULATORS
        for key in ("speculators_config", "transformer_layer_config"):
            if not isinstance(config.get(key) or {}, dict):
                raise ServeCheckError(f"{config_path}: {key} is a "
                                      f"{type(config[key]).__name__}, not an object: not a "
                                      "DFlash drafter config")
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
        verifier = verifier.get("name_or_path") if isinstance(verifier, dict) else None
        verifier = verifier if isinstance(verifier, str) else None
    elif isinstance(config.get("dflash_config"), dict):
        fmt, verifier = ZLAB, None
    else:
        raise ServeCheckError(
            f"{config_path} is not a DFlash drafter config (no speculators_model_type "
            f"'dflash', no dflash_config; speculators_model_type="
            f"{config.get('speculators_model_type')!r}): give a DFlash checkpoint folder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ServeCheckError(f"{path} has no *.safetensors weights: not a finished checkpoint")
    weights: dict[str, list[int]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    weights[key] = list(f.get_slice(key).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ServeCheckError(f"{file} is not a readable safetensors file ({exc}): use an "
                                  "intact checkpoint") from None
    return CheckpointFolder(path, fmt, config, weights, verifier)
