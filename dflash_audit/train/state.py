"""Training checkpoints: the drafter in the reference's format plus everything a resume needs.

Layout of ``<out>/checkpoints/step-<NNNNNNNN>/`` (written into a temporary sibling folder and
renamed into place, so a crash never leaves a half checkpoint):

* ``config.json`` + ``model.safetensors``: :func:`dflash_audit.model.checkpoint.save_pretrained`
  (loads in speculators' ``DFlashDraftModel.from_pretrained``); the safetensors metadata holds
  the audit report fingerprint (``dflash_audit_report_fingerprint``) and the step.
* ``training_state.pt`` (``torch.save``, loadable with ``weights_only=True``):
  ``{"format", "version", "step", "world_size", "run": run-identity dict, "report_fingerprint",
  "optimizers": [state_dict...], "schedulers": [state_dict...], "ranks": [{"torch_rng",
  "data"}, ...] (one entry per rank)}``; under ``--fsdp`` the optimizer states are full
  (unsharded, keyed by parameter name: :func:`dflash_audit.train.fsdp.full_optimizer_state`).
  Anchors need no state: each row's are drawn from a generator seeded by the row's key.

``<out>/checkpoints/latest`` (a one-line text file, replaced atomically) names the newest one.
Each checkpoint folder carries ``dflash_audit_manifest.json`` (size and sha256 of its files,
published with them): ``--resume`` verifies it and falls back to the newest intact
checkpoint when the latest is damaged (:func:`resolve_checkpoint`).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_audit.atomic import atomic_folder, manifest_problems, write_manifest
from dflash_audit.model.checkpoint import (  # noqa: F401 (follow_latest: train's API too)
    CHECKPOINTS,
    LATEST,
    CheckpointError,
    follow_latest,
    save_pretrained,
    validate_checkpoint,
)

STATE_FILE = "training_state.pt"
STATE_FORMAT = "dflash-audit-train-state"
STATE_VERSION = 2  # 1: anchors drawn from a per-rank generator (its state saved)


class ResumeError(Exception):
    """A checkpoint cannot be resumed (missing, incomplete, or from a different run)."""


@dataclass
class RankState:
    """Per-rank randomness and data position."""

    torch_rng: torch.Tensor
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"torch_rng": self.torch_rng, "data": self.data}


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(out: Path, step: int, model: torch.nn.Module,
                    optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
                    ranks: list[RankState], run: dict[str, Any], report_fingerprint: str,
                    metadata: dict[str, str], verifier_path: str | None,
                    verifier_architectures: list[str] | None, keep: int = 2,
                    extra: dict[str, Any] | None = None,
                    optimizer_states: list[dict[str, Any]] | None = None) -> Path:
    """Write ``<out>/checkpoints/step-<step>`` atomically, point ``latest`` at it, and delete
    older step folders beyond the newest ``keep`` (``keep <= 0`` keeps all). ``extra``
    entries are added to the training state; ``optimizer_states`` replace the optimizers'
    own ``state_dict()`` (FSDP: the full states gathered from every rank).

    Returns:
        The checkpoint folder.
    """
    root = Path(out) / CHECKPOINTS
    target = root / checkpoint_name(step)
    with atomic_folder(target) as tmp:
        try:
            save_pretrained(model, tmp, verifier_name_or_path=verifier_path,
                            verifier_architectures=verifier_architectures,
                            metadata={**metadata, "dflash_audit_step": str(step)})
            torch.save({"format": STATE_FORMAT, "version": STATE_VERSION, "step": step,
                        "world_size": len(ranks), "run": run,
                        "report_fingerprint": report_fingerprint,
                        "optimizers": optimizer_states if optimizer_states is not None
                        else [o.state_dict() for o in optimizers],
                        "schedulers": [s.state_dict() for s in schedulers],
                        "ranks": [r.to_dict() for r in ranks], **(extra or {})},
                       tmp / STATE_FILE)
        except (RuntimeError, OSError) as exc:
            # torch / safetensors report a full disk as RuntimeError ("unexpected pos")
            free = shutil.disk_usage(root).free
            raise ResumeError(f"cannot write checkpoint {target} ({free / 2**20:.0f} MiB free "
                              f"on its disk): {str(exc).splitlines()[0][:200]}; free space "
                              "or use another --out, then --resume from the previous "
                              "checkpoint") from exc
        write_manifest(tmp)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(target.name + "\n")
    os.replace(pointer, root / LATEST)
    if keep > 0:
        older = sorted(p for p in root.glob("step-*") if p.is_dir() and p != target)
        for old in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def checkpoint_problems(path: Path) -> list[str]:
    """What is wrong with a training checkpoint folder (empty: intact): missing files, and
    files that differ from its manifest (size always, sha256 once per process), or, for a
    checkpoint written before manifests, a truncated ``model.safetensors``."""
    from dflash_audit.atomic import safetensors_problem

    path = Path(path)
    missing = [n for n in ("model.safetensors", "config.json", STATE_FILE)
               if not (path / n).is_file()]
    if missing:
        return [f"no {', '.join(missing)}"]
    problems = manifest_problems(path)
    if problems is None:  # written before manifests: a structural check
        bad = safetensors_problem(path / "model.safetensors")
        problems = [bad] if bad else []
    return problems


def resolve_checkpoint(out: Path, resume: str, warn=None) -> Path:
    """``resume`` = ``"latest"`` (``<out>/checkpoints/latest``) or a checkpoint folder.

    With ``"latest"``, a damaged latest checkpoint (see :func:`checkpoint_problems`) is
    skipped for the newest intact ``step-*`` folder, with a line on stderr (or ``warn``).

    Raises:
        ResumeError: nothing (intact) to resume from; an explicit folder that is damaged.
    """
    warn = warn or (lambda m: print(f"dflash-audit: {m}", file=sys.stderr, flush=True))
    if resume != LATEST:
        path = Path(resume)
        problems = checkpoint_problems(path)
        if problems:
            raise ResumeError(f"--resume-from: {path} is not an intact training checkpoint "
                              f"({'; '.join(problems)}); pick another checkpoint folder")
        return path
    root = Path(out) / CHECKPOINTS
    pointer = root / LATEST
    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    if not pointer.is_file() and not steps:
        raise ResumeError(f"--resume: no checkpoint in {root} "
                          "(nothing to resume; drop --resume to start fresh)")
    latest = follow_latest(pointer) if pointer.is_file() else steps[0]
    candidates = [latest] + [p for p in steps if p.name != latest.name]
    damaged = []
    for path in candidates:
        problems = checkpoint_problems(path)
        if not problems:
            if damaged:
                warn(f"--resume: {'; '.join(damaged)}; resuming from the newest intact "
                     f"checkpoint {path}")
            return path
        damaged.append(f"{path} is damaged ({'; '.join(problems)})")
    raise ResumeError(f"--resume: no intact checkpoint in {root}: {'; '.join(damaged)}; "
                      "start a new run with --overwrite (or another --out)")


RUN_FILES = ("metrics.jsonl", "summary.json")


def check_run_folder(out: Path, resume: str | None, overwrite: bool, remove: bool = True
                     ) -> None:
    """Refuse to write a new run over an existing one.

    ``out`` holds a run when it has ``checkpoints/`` with anything in it, ``metrics.jsonl``
    or ``summary.json``. Then a fresh start needs ``overwrite`` (which removes them,
    ``tensorboard/`` and ``curves.png``; only when ``remove``: rank 0 of a multi-process
    run), else ``resume``.
    Also proves ``out`` is a writable folder.

    Raises:
        ResumeError: an existing run without ``--resume`` / ``--overwrite``; or both given.
        OSError: ``out`` is not a writable folder (a file, a path under a file, read-only).
    """
    from dflash_audit.atomic import ensure_writable_dir

    out = Path(out)
    if resume and overwrite:
        raise ResumeError("give --resume/--resume-from or --overwrite, not both")
    ensure_writable_dir(out)
    root = out / CHECKPOINTS
    has_run = (root.is_dir() and any(root.iterdir())) or any(
        (out / n).exists() for n in RUN_FILES)
    if not has_run or resume:
        return
    if not overwrite:
        raise ResumeError(f"--out {out} already holds a training run (checkpoints or "
                          "metrics); continue it with --resume, or replace it with "
                          "--overwrite")
    if not remove:
        return
    for name in (CHECKPOINTS, "tensorboard"):
        shutil.rmtree(out / name, ignore_errors=True)
    from dflash_audit.train.plot import PLOT_FILE

    for name in (*RUN_FILES, PLOT_FILE):  # the picture of the old run too
        (out / name).unlink(missing_ok=True)


def load_training_state(path: Path) -> dict[str, Any]:
    """Read ``training_state.pt``.

    Raises:
        ResumeError: unreadable or not a training state of this version.
    """
    try:
        state = torch.load(Path(path) / STATE_FILE, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch raises many types on a damaged file
        raise ResumeError(f"cannot read {Path(path) / STATE_FILE}: {exc}") from exc
    if state.get("format") == STATE_FORMAT and state.get("version") == 1:
        raise ResumeError(f"{path}/{STATE_FILE} was written by an older dflash-audit (training "
                          "state v1: anchors drawn per rank, not per row), so this version "
                          "cannot continue it exactly; finish it with the version that wrote "
                          "it, or start a new run (--overwrite)")
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise ResumeError(f"{path}/{STATE_FILE} is not a {STATE_FORMAT} v{STATE_VERSION} file")
    return state


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Load the checkpoint's saved tensors (trained weights, draft-vocab buffers) into
    ``model`` in place; verifier-owned weights stay as they are.

    Raises:
        ResumeError: a trainable parameter is missing or a tensor does not fit.
    """
    try:
        validate_checkpoint(path, model.config.num_verifier_layers, model.config.hidden_size)
    except CheckpointError as exc:
        raise ResumeError(str(exc)) from exc
    saved = load_file(Path(path) / "model.safetensors")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(saved))
    if missing:
        raise ResumeError(f"{path}/model.safetensors lacks trained weights {missing}")
    try:
        model.load_state_dict(saved, strict=False)
    except RuntimeError as exc:
        raise ResumeError(f"{path}/model.safetensors does not fit this drafter: {exc}") from exc


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the bytes of every trainable parameter, in name order (ranks compare it)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Fields of the run identity that differ between a checkpoint and this run."""
    keys = sorted(set(saved) | set(current))
    return [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in keys
            if saved.get(k) != current.get(k)]
