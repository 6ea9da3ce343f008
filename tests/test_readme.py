"""Every `dflash-audit` command line in README.md parses with the real CLI: each option exists
and each value has the option's type (the commands are not run here; `.ci/run` runs the main
job, and the closing notes record the training recipe's run)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from dflash_audit.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("dflash-audit ")]


COMMANDS = _readme_commands()


def test_the_readme_has_the_main_job_and_the_training_recipe():
    assert "dflash-audit compare" in COMMANDS
    assert {c.split()[1] for c in COMMANDS} >= {"compare", "data", "train", "eval"}


@pytest.mark.parametrize("line", COMMANDS)
def test_readme_command_parses(line):
    group = typer.main.get_command(app)
    name, *args = shlex.split(line)[1:]
    command = group.get_command(None, name)
    assert command is not None, f"README names an unknown subcommand: {line}"
    command.make_context(name, list(args))  # raises click.UsageError on a bad option or value
