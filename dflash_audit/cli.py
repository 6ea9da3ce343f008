"""Command-line entry point: ``dflash-audit data | compare | check-batches | serve-check | train |
eval``.

Each command lives in the module that does its job; this file only wires them to typer,
each through :func:`~dflash_audit.command_errors.command_boundary` (one error contract: a
one-line message and exit 2 for bad input, setup and OS errors, never a traceback).
Exit codes: 0 success / audit pass, 1 conformance failure, 2 usage or setup error.
"""

from __future__ import annotations

import os
import sys



def quiet_third_party_bars() -> None:
    """In a CI log (stderr not a TTY): no third-party carriage-return bars (ours print
    lines). tqdm reads ``TQDM_DISABLE`` when it is imported, hence at this module's import;
    the variables also reach the processes the commands start."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def refuse_a_deleted_working_directory() -> None:
    """One line and exit 2 when the working directory was deleted: importing torch there
    dies with an "Intel oneMKL FATAL ERROR" instead (and every path would resolve wrongly)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        sys.stderr.write("error: the current working directory no longer exists (deleted "
                         "while this shell was in it): cd to an existing folder and rerun\n")
        sys.exit(2)


quiet_third_party_bars()
refuse_a_deleted_working_directory()

import typer

from dflash_audit.command_errors import EXIT_CODES_HELP, command_boundary

app = typer.Typer(
    name="dflash-audit",
    help="Audit a DFlash drafter against vllm-project/speculators, then train it. "
         + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    # click's own help wraps every column at any width; rich's tables cut the help of long
    # options to "speculators@<bra…" on an 80-column terminal
    rich_markup_mode=None,
)

# --- data (dflash_audit/data) ---------------------------------------------------------
from dflash_audit.data.command import data_command  # noqa: E402

app.command("data")(command_boundary(data_command))

# --- compare (dflash_audit/audit) -----------------------------------------------------
from dflash_audit.audit.compare_cli import compare_command  # noqa: E402

app.command("compare")(command_boundary(compare_command))

# --- check-batches (dflash_audit/batch_audit) ---------------------------------------
from dflash_audit.batch_audit.command import check_batches_command  # noqa: E402

app.command("check-batches")(check_batches_command)

# --- serve-check (dflash_audit/serve) ------------------------------------------------
from dflash_audit.serve.command import serve_check_command  # noqa: E402

app.command("serve-check")(command_boundary(serve_check_command))

# --- train / eval (dflash_audit/train) -----------------------------------------------
from dflash_audit.train.commands import eval_command, train_command  # noqa: E402

app.command("train")(command_boundary(train_command))
app.command("eval")(command_boundary(eval_command))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
