"""``dflash-audit --help``, each command's ``--help`` and the one-line errors found before any
work answer without importing torch or transformers (seconds on a busy machine): each command
module imports its work when it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_audit.limits import limit_s

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors", "numpy")
#: runs the CLI in-process, then prints (as JSON) the exit code and which HEAVY modules loaded
PROBE = """
import json, sys
from dflash_audit.cli import app
try:
    app(sys.argv[1:], prog_name="dflash-audit")
    code = 0
except SystemExit as exc:
    code = exc.code
print("\\nPROBE " + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _probe(args: list[str], cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=limit_s(120), env={"PYTHONPATH": str(ROOT),
                                                              "PATH": "/usr/bin:/bin"})
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert line, proc.stdout + proc.stderr
    return {**json.loads(line[-1][len("PROBE "):]), "output": proc.stdout + proc.stderr}


@pytest.mark.parametrize("args", [[], ["compare"], ["data"], ["check-batches"],
                                  ["serve-check"], ["train"], ["eval"]])
def test_help_imports_no_torch(args, tmp_path):
    result = _probe([*args, "--help"], tmp_path)
    assert result["code"] == 0 and "Usage:" in result["output"], result["output"]
    assert result["heavy"] == [], result["output"]


@pytest.mark.parametrize("args,message", [
    (["compare", "--cases", "-1", "--out", "."], "--cases must be >= 0, got -1"),
    (["compare", "--candidate-timeout", "0"], "--candidate-timeout"),
    (["data", "--out", "o", "--seq-len", "4"], "--seq-len"),
    (["data", "--out", "a-file/o"], "a-file is not a folder"),
    (["check-batches", "d", "--rows-to-check", "0"], "--rows-to-check"),
    (["compare", "--candidate", "framework:nosuch"], "unknown framework 'nosuch'; choices:"),
    (["compare", "--candidate", "framework:zlab==9"], "framework:zlab==0.1.0"),
    (["compare", "--candidate", "gone.py:candidate"], "gone.py does not exist"),
    # a verifier that cannot be: answered before the reference and the cases (65 s at load 12)
    (["compare", "--verifier", "family:nosuch"], "unknown verifier family; use one of"),
    (["compare", "--verifier", "no-such-folder"], "'no-such-folder' is neither a built-in"),
    (["compare", "--verifier", "a-file"], "'a-file' is a file but not a .json one"),
])
def test_a_usage_error_is_one_line_without_torch(args, message, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    result = _probe(args, tmp_path)
    assert result["code"] == 2 and message in result["output"], result["output"]
    assert "Traceback" not in result["output"]
    assert result["heavy"] == [], result["output"]


def test_every_setup_error_is_named_by_its_defining_module():
    import importlib

    from dflash_audit.command_errors import SETUP_ERRORS

    for module, name in SETUP_ERRORS:
        cls = getattr(importlib.import_module(module), name)
        assert cls.__module__ == module and issubclass(cls, Exception), (module, name)


def test_compare_help_names_every_built_in_framework(tmp_path):
    """``--candidate``'s help lists every built-in framework key (NeMo was missing)."""
    from dflash_audit.audit.frameworks.registry import builtin_frameworks

    output = _probe(["compare", "--help"], tmp_path)["output"]
    words = set(output.replace(",", " ").replace(";", " ").replace("(", " ").split())
    assert builtin_frameworks()[0] - words == set(), output
