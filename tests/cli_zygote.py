"""``dflash-audit ARGS`` as a real child process, forked from an interpreter that has already
imported the CLI and its heavy dependencies (torch, transformers): the suite's shared
fixture for the many one-command tests (bad inputs, faults), which otherwise spend ~3 s each
importing before the 0.1 s of work they test (a :class:`zygote.Zygote`, one per test process,
started on first use).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from cache_support import records_lock
from zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]

#: What the zygote imports before it forks: the CLI and what its commands import lazily.
PRELOAD = ("dflash_audit.cli", "transformers", "transformers.models.llama.modeling_llama",
           "dflash_audit.train.commands", "dflash_audit.audit.compare", "safetensors.torch")

_PRELOAD = f"import importlib\nfor name in {PRELOAD!r}:\n    importlib.import_module(name)"
_RUN = """\
    sys.argv = ["dflash-audit", *req["args"]]
    from dflash_audit.cli import main, quiet_third_party_bars
    quiet_third_party_bars()  # what importing the CLI does, now with this env
    main()
"""

#: What every call's environment holds (the zygote's too: some libraries read it at import).
FIXED_ENV = {"PYTHONPATH": str(ROOT), "DFLASH_AUDIT_PROGRESS_INTERVAL": "0", "COLUMNS": "200"}
_ZYGOTE: Zygote | None = None


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None,
            prelude: str = "", timeout: float = 600.0) -> subprocess.CompletedProcess:
    """``dflash-audit ARGS`` in a forked child of this test process's zygote, with this
    process's environment plus ``env`` (this checkout first on PYTHONPATH, progress lines at
    once, 200 columns); stdout and stderr merged."""
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        # one OpenMP thread: torch then starts no thread at import (the zygote must fork
        # without threads); the children's own children get the caller's environment
        _ZYGOTE = Zygote(lambda code, fd: [sys.executable, "-c", code, fd], _PRELOAD, _RUN,
                         {"OMP_NUM_THREADS": "1", **os.environ, **FIXED_ENV}, ROOT)
    merged = {**os.environ, **FIXED_ENV, **(env or {})}
    unsandboxed = merged.get("DFLASH_AUDIT_SANDBOX") == "off" and "compare" in args[:1]
    with records_lock(exclusive=False) if unsandboxed else contextlib.nullcontext():
        return _ZYGOTE.run(args, cwd, merged, prelude, timeout)
