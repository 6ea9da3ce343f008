"""The work of ``dflash-audit check-batches``: open the folder, run every batch check on
sampled rows against a recomputation with the verifier, and return the
:class:`~dflash_audit.batch_audit.result.BatchReport` (the command is
:mod:`dflash_audit.batch_audit.command`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from dflash_audit.batch_audit.capture_attention import PackedStates
from dflash_audit.batch_audit.files import BatchFolder, open_batch_folder
from dflash_audit.batch_audit.ids import (
    check_mask_token,
    check_target_layer_ids,
    drafter_layer_ids,
    find_key,
    read_drafter_config,
)
from dflash_audit.batch_audit.layers import check_layers
from dflash_audit.batch_audit.layout import check_layout, rope_types
from dflash_audit.batch_audit.loss_mask import check_loss_mask
from dflash_audit.batch_audit.recompute import Recomputer, file_precision
from dflash_audit.batch_audit.result import BatchReport
from dflash_audit.data.batch import token_id_problem
from dflash_audit.data.errors import BatchFileError, DataError
from dflash_audit.data.verifier import Verifier, load_verifier


def sample_rows(count: int, k: int) -> list[int]:
    """``k`` row indices spread evenly over ``count`` rows (first and last included)."""
    k = max(1, min(k, count))
    return sorted({round(i * (count - 1) / max(k - 1, 1)) for i in range(k)})


def _setup_checks(folder: BatchFolder, verifier: Verifier, row: Any) -> None:
    """Raise :class:`DataError` when the files cannot be checked with this verifier."""
    H, N = verifier.hidden_size, verifier.num_layers
    if row.last.shape[-1] != H:
        raise DataError(f"{folder.path}: the files hold hidden size {row.last.shape[-1]}, "
                        f"verifier {verifier.identity.name} has {H}: pass the verifier the "
                        "batches were captured with")
    n = row.hidden_states.shape[-1] // H
    if row.hidden_states.shape[-1] % H:
        raise BatchFileError(f"{folder.path}/{row.name}: hidden_states width "
                             f"{row.hidden_states.shape[-1]} is not a multiple of H={H}")
    ids = folder.target_layer_ids
    if ids is not None and len(ids) != n:
        raise BatchFileError(f"{folder.path}/{row.name}: the metadata names {len(ids)} target "
                             f"layers {ids}, hidden_states holds {n} slices")
    if ids is not None and max(ids) > N:
        raise DataError(f"the files name target layer {max(ids)}, verifier "
                        f"{verifier.identity.name} has {N} layers (ids 0..{N}): pass the "
                        "verifier the batches were captured with")


def run_check_batches(directory: str | Path, verifier: str | Verifier, rows_to_check: int = 2,
                      drafter_config: str | Path | None = None, profile: str | None = None,
                      target_layer_ids: list[int] | None = None,
                      progress: bool = True) -> BatchReport:
    """Audit the batch folder ``directory`` against a recomputation with ``verifier``.

    Args:
        directory: ``batch_*.safetensors`` (ours) or a reference offline folder.
        verifier: a spec (local HF folder or ``smollm2-135m``) or a loaded verifier.
        rows_to_check: rows recomputed (spread over the folder); the mask token's "unused"
            check scans every row's ``input_ids``.
        drafter_config: the drafter's config.json (or folder) that will read the files.
        profile: a built-in profile name or TOML path (z-lab vs speculators ids).
        target_layer_ids: what slice j is (speculators convention) when the files do not say.
        progress: a rich progress bar on stderr.

    Returns:
        The :class:`BatchReport` (``exit_code`` 0 / 1).

    Raises:
        DataError: any setup error (see the module docstring).
    """
    folder = open_batch_folder(directory)
    if not folder.names:
        raise BatchFileError(f"{folder.path}: the folder holds no rows")
    if isinstance(verifier, str):
        verifier = load_verifier(verifier)
    prof = None
    if profile is not None:
        from dflash_audit.profile import Profile, ProfileError
        try:
            prof = Profile.load(profile)
        except ProfileError as exc:
            raise DataError(f"--profile: {exc}") from exc
    config, config_file = read_drafter_config(drafter_config) if drafter_config else (None, "")
    if target_layer_ids is not None:
        folder.target_layer_ids = list(target_layer_ids)
    all_ids = folder.all_input_ids()  # every row, as train checks every file up front
    for name, ids in zip(folder.names, all_ids):
        problem = token_id_problem(ids, verifier.embedding_rows)
        if problem:
            raise BatchFileError(f"{folder.path / name}: {problem}")
    recompute, checks, measured, names = Recomputer(verifier), [], None, []
    start = time.perf_counter()
    with _progress(progress) as bar:
        task = bar.add_task("recomputing rows", total=None) if bar else None
        indices = sample_rows(len(folder.names), rows_to_check)
        if bar:
            bar.update(task, total=len(indices))
        for i in indices:
            row = folder.load(i)
            _setup_checks(folder, verifier, row)
            names.append(row.name)
            checks += check_layout(row, rope_types(verifier.model.config))
            checks.append(check_loss_mask(row, verifier.tokenizer,
                                          getattr(verifier.model, "generation_config", None)))
            precision = file_precision(row.hidden_states)
            states = recompute.layer_states(row.input_ids, row.documents, precision)
            packed = PackedStates(lambda plan, row=row, p=precision: recompute.layer_states(
                row.input_ids, row.documents, p, plan))
            layer_checks, ids = check_layers(row, states, folder.target_layer_ids,
                                             verifier.hidden_size, packed)
            checks += layer_checks
            measured, noise = measured or ids, states.noise
            if bar:
                bar.advance(task)
    drafter_ids, source, computed = drafter_layer_ids(config, prof, verifier.num_layers,
                                                      str(config_file))
    notes = [f"target layer ids {drafter_ids}: {source}"] if computed else []
    checks.append(check_target_layer_ids(measured, folder.target_layer_ids, drafter_ids, source))
    checks.append(check_mask_token(folder.mask_token_id,
                                   find_key(config, "mask_token_id") if config else None,
                                   verifier.tokenizer, verifier.embedding_rows, all_ids))
    precision = str(states.dtype)
    return BatchReport(
        folder=str(folder.path), format=folder.format, verifier=verifier.identity.to_dict(),
        rows_checked=names, checks=checks, notes=notes,
        context={"rows_in_folder": len(folder.names), "files_precision":
                 precision.removeprefix("torch."),
                 "noise_per_layer": [round(x, 5) for x in noise],
                 "tolerance": "4 x measured bf16-vs-fp32 noise per layer (>= 1e-3), mean "
                              "per-token relative error",
                 "target_layer_ids (files)": folder.target_layer_ids,
                 "check_seconds": round(time.perf_counter() - start, 2)})


def _progress(enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True))
