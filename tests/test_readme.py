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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


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


def _matrix_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "conformance_matrix", ROOT / "scripts" / "conformance_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_matrix_is_replaced_and_checked_between_its_markers(tmp_path, capsys):
    m = _matrix_script()
    table = m.render([{"label": "A 1.0", "verdict": "fail", "error": None,
                       "checks": {"mask": ("fail", "window off by one")}}], ["mask"])
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{m.BEGIN}\nold\n{m.END}\nafter\n")
    assert m.update_readme(readme, table, check=True) == 1  # a stale matrix fails CI
    assert m.update_readme(readme, table, check=False) == 0
    assert readme.read_text() == f"intro\n{m.BEGIN}\n{table}{m.END}\nafter\n"
    assert m.update_readme(readme, table, check=True) == 0
    reworded = table.replace("window off by one", "window bound off by +1")
    assert m.update_readme(readme, reworded, check=True) == 0  # wording only: printed
    assert "window bound off by +1" in capsys.readouterr().err
    passing = table.replace("❌ fail", "✅ pass")
    assert m.update_readme(readme, passing, check=True) == 1
    assert "is stale" in capsys.readouterr().err
    (tmp_path / "bare.md").write_text("no markers\n")
    assert m.update_readme(tmp_path / "bare.md", table, check=True) == 2


def test_the_readme_matrix_has_a_column_per_built_in_framework():
    m = _matrix_script()
    table = README.read_text().split(m.BEGIN, 1)[1].split(m.END, 1)[0]
    from dflash_audit.audit.frameworks.registry import available_adapters

    header = table.strip().splitlines()[0]
    for key, adapter in available_adapters().items():  # speculators: at the lock's version
        label = adapter["NAME"] if key == "speculators" else f"{adapter['NAME']} {adapter['VERSION']}"
        assert label in header, key
