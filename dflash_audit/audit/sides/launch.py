"""How the candidate's process starts: which interpreter, which candidate spec, and what goes
on its path -- the same for a user's ``module:attr`` and for a framework adapter
(:mod:`dflash_audit.audit.frameworks.registry` builds the latter: the framework's cached
install folder or source tree on ``PYTHONPATH``, ``--candidate-python`` as the interpreter);
and so where its spec's module is found (:func:`runner_search_path`) and the fingerprint of
the candidate it loads (:func:`identity_fingerprint`, shared by compare and train).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CandidateLaunch:
    """What :mod:`.candidate_process` starts.

    ``spec``: the candidate spec the runner loads (``module:attr``, ``file.py:attr`` or None:
    our drafter); ``python``: the interpreter (None: this one); ``pythonpath``: folders put on
    the process's ``PYTHONPATH`` after dflash_audit's package root and before the inherited
    ones; ``env``: extra environment variables; ``framework``: ``{"key", "name", "version",
    "spec", ...}`` of an audited framework (None for a plain candidate), for the report.
    """

    spec: str | None = None
    python: str | None = None
    pythonpath: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    framework: dict[str, Any] | None = None

    @property
    def shown(self) -> str | None:
        """The candidate as the user named it: ``framework:KEY`` for a framework (not its
        adapter module's spec), else the spec."""
        return f"framework:{self.framework.get('key')}" if self.framework else self.spec

    @property
    def executable(self) -> str:
        """The interpreter the candidate process runs under."""
        return self.python or sys.executable


def package_root() -> str:
    """The folder holding this ``dflash_audit`` package (what the runner must import)."""
    import dflash_audit

    return str(Path(dflash_audit.__file__).resolve().parent.parent)


def launch_env(launch: CandidateLaunch | None, threads: int | None) -> dict[str, str]:
    """Our environment, with dflash_audit's package root first on PYTHONPATH (the runner
    imports the same code), then the launch's folders, unbuffered output (tails are complete
    when the process is killed), the launch's variables, and ``threads`` intra-op threads."""
    launch = launch or CandidateLaunch()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root(), *launch.pythonpath,
                                         *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(launch.env)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def runner_search_path(launch: CandidateLaunch) -> list[str]:
    """Where the candidate's process (``python -m`` in the working folder, with
    :func:`launch_env`'s ``PYTHONPATH``) looks for a ``module:attr`` candidate: the working
    folder, dflash_audit's root and the launch's folders, then this interpreter's
    ``sys.path``."""
    env_path = launch_env(launch, None).get("PYTHONPATH", "")
    return list(dict.fromkeys([os.getcwd(), *filter(None, env_path.split(os.pathsep)),
                               *sys.path]))


def identity_fingerprint(identity: dict[str, Any], spec: str | CandidateLaunch | None,
                         profile_fingerprint: str) -> dict[str, Any]:
    """The fingerprint of a candidate known by its identity (the ``source_files`` its own
    process reported:
    :func:`~dflash_audit.audit.sides.candidate_load.load_candidate_identity`) and its spec
    or launch (whose files are located here without running code:
    :func:`dflash_audit.report.fingerprint.audited_fingerprint`): what compare records in the
    report and train recomputes before it decides."""
    from dflash_audit.report.fingerprint import audited_fingerprint

    files = identity.get("source_files") if isinstance(identity, dict) else None
    files = [str(f) for f in files if isinstance(f, str)] if isinstance(files, list) else []
    launch = spec if isinstance(spec, CandidateLaunch) else CandidateLaunch(spec=spec)
    return audited_fingerprint(files, launch.spec, profile_fingerprint,
                               runner_search_path(launch))


#: Characters kept of the end of a candidate process's stdout / stderr (the rest is never read).
TAIL_CHARS = 3000


def run_with_tails(cmd: list[str], env: dict[str, str], timeout_s: float
                   ) -> tuple[int, str, str]:
    """Run ``cmd`` (a candidate's process or a user's interpreter, sandboxed by the caller) in
    a session of its own to its end, its stdout and stderr into unlinked temporary files:
    whatever it prints costs disk space for its run, never this process's memory.

    Returns:
        its exit code and the last :data:`TAIL_CHARS` characters of its stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (its process group was killed).
        OSError: it could not be started.
    """
    import signal
    import subprocess
    import tempfile

    def tail(f: Any) -> str:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_CHARS))
        return f.read().decode(errors="replace")

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        finally:  # also what it left behind in its session (unsandboxed)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        return returncode, tail(out), tail(err)


#: What the candidate process imports before any candidate code: checked under
#: ``--candidate-python`` so a wrong interpreter is one clear message, not a dead runner.
PROBE = ("import importlib, sys\n"
         "for name in ('torch', 'safetensors'):\n"
         "    try:\n"
         "        importlib.import_module(name)\n"
         "    except Exception as exc:\n"
         "        print(f'{name}\\t{type(exc).__name__}: {exc}'); sys.exit(5)\n"
         "try:\n"
         "    import dflash_audit.audit.sides.candidate_runner, dflash_audit.candidate\n"
         "except Exception as exc:\n"
         "    print(f'dflash_audit\\t{type(exc).__name__}: {exc}'); sys.exit(5)\n")


def check_interpreter(launch: CandidateLaunch, timeout_s: float | None = None) -> None:
    """Check that ``launch.python`` exists and, with dflash_audit's package root on its
    PYTHONPATH, imports torch, safetensors and dflash_audit's candidate runner within
    ``timeout_s`` (None: 120 s scaled with the load, :func:`dflash_audit.limits.limit_s`). The
    interpreter is the user's (a ``python`` that is a script runs anything): it runs in the
    candidate's sandbox (:func:`dflash_audit.audit.sides.sandbox.sandboxed`), like the candidate.

    Raises:
        ValueError: one line naming the interpreter, what it cannot import and what to do.
        SandboxError: the sandbox starts but did not prove its isolation (nothing runs).
    """
    import subprocess
    import tempfile

    from dflash_audit.audit.sides.sandbox import sandboxed, work_root
    from dflash_audit.limits import exceeded, limit_s

    python = launch.executable
    where = f"--candidate-python {python}"
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        raise ValueError(f"{where}: no such executable interpreter; pass the python of the "
                         "environment where the framework is installed (e.g. .venv/bin/python)")
    limit = limit_s(120.0) if timeout_s is None else timeout_s
    env = launch_env(launch, 1)
    with tempfile.TemporaryDirectory(prefix="dflash-audit-interpreter-",
                                     dir=work_root()) as folder:
        try:
            returncode, stdout, stderr = run_with_tails(
                sandboxed([python, "-c", PROBE], launch.spec, Path(folder), Path(folder), env),
                env, limit)
        except subprocess.TimeoutExpired:
            raise ValueError(exceeded(f"{where} (importing torch, safetensors, dflash_audit)",
                                      limit)) from None
        except OSError as exc:
            raise ValueError(f"{where} could not be started: {exc}") from None
    if returncode == 0:
        return
    module, _, error = stdout.strip().rpartition("\n")[2].partition("\t")
    if module in ("torch", "safetensors"):
        raise ValueError(f"{where} cannot import {module} ({error}); install it into that "
                         f"environment ({python} -m pip install {module})")
    if module == "dflash_audit":
        raise ValueError(f"{where} cannot import dflash_audit's candidate runner from "
                         f"{package_root()} (put on its PYTHONPATH): {error}; that environment "
                         "needs dflash-audit's dependencies (torch, safetensors, transformers)")
    tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
    raise ValueError(f"{where} does not run Python code (exit {returncode}: {tail[0][-300:]})")
