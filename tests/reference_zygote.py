"""Scripts in the reference's process, forked from one that has already imported the reference
(speculators from the resolved source, torch, transformers): the suite's shared fixture for the
tests that run ``reference/adapter.py`` on their own cases or a script of
``tests/reference_scripts`` (a :class:`zygote.Zygote`; each run still imports ~5 s less).

The server starts exactly as the audit's reference processes do
(:func:`dflash_audit.reference_source.runner.reference_command`: isolated mode, no ``site``,
bytecode under the tool's prefix, the resolved source then site-packages on ``sys.path``, the
environment of :func:`~dflash_audit.reference_source.runner.reference_env`) and imports the
reference through the adapter's own :func:`import_reference`; a child runs its script as
``__main__`` with the script's folder first on ``sys.path``, as the audit's boot code does.
The audit's own reference runs (every full compare) never come through here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]

_PRELOAD = f"""\
import tempfile
from pathlib import Path
sys.path.insert(0, {str(ROOT / "reference")!r})
import adapter
with tempfile.TemporaryDirectory(prefix="reference-zygote-") as failed:  # its error.json
    adapter.import_reference(Path(failed))
import safetensors.torch, transformers
sys.path.pop(0)
"""
_RUN = """\
    import runpy
    sys.argv = list(req["args"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


#: The server's environment for a fork without threads: one OpenMP thread (torch starts none
#: at import), and no background purging thread of pyarrow's jemalloc (speculators imports
#: ``datasets``, hence pyarrow).
QUIET_THREADS = {"OMP_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}


class ReferenceZygote:
    """The forking reference interpreter of one resolved reference (``identity``)."""

    def __init__(self, identity: Any) -> None:
        from dflash_audit.reference_source.runner import (
            pycache_prefix,
            reference_command,
            reference_env,
        )

        self.env = reference_env(identity)
        self._zygote = Zygote(
            lambda code, fd: reference_command(identity, "", [fd], pycache_prefix(), code=code),
            _PRELOAD, _RUN, {**self.env, **QUIET_THREADS}, ROOT)

    def run(self, script: Path | str, args: list[str], cwd: Path,
            timeout: float = 900.0) -> subprocess.CompletedProcess:
        """``script ARGS`` in a forked reference process in ``cwd``; stdout and stderr merged.

        Raises:
            subprocess.TimeoutExpired, RuntimeError: see :meth:`zygote.Zygote.run`.
        """
        return self._zygote.run([str(script), *map(str, args)], cwd,
                                {**self.env, "OMP_NUM_THREADS": os.environ.get(
                                    "OMP_NUM_THREADS", "1")}, timeout=timeout)

    def close(self) -> None:
        """End the server (:meth:`zygote.Zygote.close`)."""
        self._zygote.close()
