"""Command-line entry point: ``dflash-audit data | compare | check-batches | train | eval``.

Each command lives in the module that does its job; this file only wires them to typer.
Exit codes: 0 success / audit pass, 1 conformance failure, 2 usage or setup error.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="dflash-audit",
    help="Audit a DFlash drafter against vllm-project/speculators, then train it.",
    no_args_is_help=True,
    add_completion=False,
)

# --- data (dflash_audit/data) ---------------------------------------------------------
from dflash_audit.data.pipeline import data_command  # noqa: E402

app.command("data")(data_command)

# --- compare (dflash_audit/audit) -----------------------------------------------------
from dflash_audit.audit.compare import compare_command  # noqa: E402

app.command("compare")(compare_command)

# --- check-batches (dflash_audit/batch_audit) ---------------------------------------
from dflash_audit.batch_audit.command import check_batches_command  # noqa: E402

app.command("check-batches")(check_batches_command)

# --- train / eval (dflash_audit/train) -----------------------------------------------
from dflash_audit.train.commands import eval_command, train_command  # noqa: E402

app.command("train")(train_command)
app.command("eval")(eval_command)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
