"""``dflash-audit check-batches DIR --verifier V``: run every batch check and write the report.

Exit codes: 0 every check passed (skips allowed), 1 findings, 2 usage / setup errors (missing
folder, unreadable file, what train refuses in a file (a dtype, a loss mask other than 0/1,
non-finite hidden states: :func:`~dflash_audit.data.batch.tensor_problem`, in train's words),
token ids outside the verifier's vocabulary, a verifier that does not have the layers or
hidden size the files name, an unreadable drafter config or profile), each as one line
without a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from dflash_audit.data.errors import DataError


def check_batches_command(
    directory: Annotated[Path, typer.Argument(help="Batch folder: batch_*.safetensors (ours) "
                                              "or the reference's offline format.")],
    verifier: Annotated[str, typer.Option(
        help="Local HF causal-LM folder, or the built-in 'smollm2-135m'.")] = "smollm2-135m",
    rows_to_check: Annotated[int, typer.Option(
        help="Rows recomputed with the verifier (spread over the folder).", min=1)] = 2,
    drafter_config: Annotated[Path | None, typer.Option(
        help="The drafter's config.json (or its folder) that will read these batches.")
    ] = None,
    profile: Annotated[str | None, typer.Option(
        help="Profile (zlab, reference-model... or a TOML) for the drafter's layer ids.")
    ] = None,
    target_layer_ids: Annotated[str | None, typer.Option(
        help="What slice j is (comma list, speculators ids) when the files do not say.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Report folder parent.")] = Path("reports"),
) -> None:
    """Audit a user's batch files (hidden states, loss mask, positions, mask token, layer ids)
    against a recomputation with the verifier. Exit 0 pass, 1 findings, 2 setup error."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        ids = None
        if target_layer_ids is not None:
            try:
                ids = [int(x) for x in target_layer_ids.split(",") if x.strip()]
            except ValueError:
                raise DataError(f"--target-layer-ids {target_layer_ids!r}: give a comma list "
                                "of integers like 2,9,15") from None
        from dflash_audit.batch_audit.run import run_check_batches  # torch: not for --help

        report = run_check_batches(directory, verifier, rows_to_check, drafter_config, profile,
                                   ids)
        folder = _write(report, out)
    except (DataError, OSError) as exc:
        console.print(f"error: {exc}", style="bold red", highlight=False, markup=False,
                      soft_wrap=True)
        raise typer.Exit(2) from None
    for note in report.notes:
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    for c in report.failures + report.warnings:
        console.print(f"{c.status.upper()} [{c.finding or c.name}] {c.row or 'folder'}: "
                      f"{c.message}",
                      highlight=False, markup=False, soft_wrap=True)
    console.print(f"check-batches: {report.verdict.upper()} ({len(report.checks)} checks, "
                  f"{len(report.failures)} failed, {len(report.warnings)} warnings) report: {folder}", highlight=False,
                  markup=False, soft_wrap=True)
    raise typer.Exit(report.exit_code)


def _write(report: Any, out: Path) -> Path:
    from dflash_audit.batch_audit.report import write_report
    return write_report(report, out)
