"""The candidate in its own process, in its sandbox, with a per-case timeout.

The process runs inside bubblewrap where it can start (:mod:`.sandbox`, :func:`sandboxed`):
read-only file system, private ``/tmp``, its own PID namespace, no network; elsewhere it runs
as it is and the report says so.

:func:`run_candidate_process` starts :mod:`dflash_audit.audit.sides.candidate_runner` on cases
already written to disk (``compare.write_cases``) in a new process group, with its stdout and
stderr captured to files (they never mix into ours). The runner announces each case in
``started.json`` and publishes each finished case atomically; this side watches the clock.
A case that runs past its limit (``--candidate-timeout``, else 600 s scaled with the machine's
load: :mod:`dflash_audit.limits`), or during which the process dies (``sys.exit`` caught by
the runner, ``os._exit``, a segfault, SIGKILL from the OOM killer), is a failure of that case
with its cause and the tail of the candidate's stderr; the process group is killed and a new
runner continues with the remaining cases, so one bad case never loses the others and the
audit never hangs. The only way the candidate influences the verdict is the outputs it wrote
(read back with :meth:`dflash_audit.audit.case.SideOutputs.read`, as the reference's are).
Loading the candidate (its identity, the audit's waiting process) is :mod:`.candidate_load`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_audit.audit.options import (
    CANDIDATE_START_TIMEOUT_ENV,
    CANDIDATE_START_TIMEOUT_S,
    CANDIDATE_TIMEOUT_ENV,
    DEFAULT_CANDIDATE_TIMEOUT_S,
)
from dflash_audit.audit.sides.candidate_runner import (
    EXIT_LOAD_ERROR,
    HEARTBEAT,
    LOAD_ERROR,
    STATUS,
)
from dflash_audit.audit.sides.case_run import CandidateCaseRun, death_summary
from dflash_audit.audit.sides.launch import TAIL_CHARS, CandidateLaunch, launch_env
from dflash_audit.audit.sides.sandbox import links_in, sandboxed
from dflash_audit.candidate import CandidateError
from dflash_audit.limits import Watch, exceeded
from dflash_audit.user_input import read_output_json

POLL_S = 0.05
class CandidateLoadError(CandidateError):
    """The candidate process could not load the candidate (a setup error, exit 2)."""


def load_error(out_dir: Path, launch: CandidateLaunch) -> CandidateLoadError:
    """The setup error of the runner's ``load_error.json`` in ``out_dir``: its message, or,
    when a framework cannot import a module, one naming the module, who imports it and the
    fix (:func:`dflash_audit.audit.frameworks.import_failure.import_failure_message`)."""
    try:
        data = read_output_json(out_dir / LOAD_ERROR)
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    if launch.framework is not None and data.get("missing_module"):
        from dflash_audit.audit.frameworks.import_failure import import_failure_message

        return CandidateLoadError(import_failure_message(launch, data))
    message = str(data.get("message", ""))
    if launch.framework is not None:  # named as the user named it, not by its adapter's spec
        key, info = launch.shown, launch.framework
        for name in filter(None, [launch.spec, (launch.spec or "").rpartition(":")[0]]):
            message = message.replace(repr(name), repr(key))  # where the runner quotes it
        label = f"{info.get('name', '')} {info.get('version', '')}".strip()
        message = f"{key}{f' ({label})' if label else ''}: {message}"
    return CandidateLoadError(message)


def log_tail(path: Path) -> str:
    """The last ``TAIL_CHARS`` of a log file ("" when unreadable); a symlink is never followed
    (the logs live outside what the candidate can write, and this holds if one does not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - TAIL_CHARS))
        return f.read().decode(errors="replace")


def new_log(path: Path) -> Any:
    """A fresh log file opened for writing: created, never an existing file or a symlink."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                     "wb")


def runner_env(threads: int | None, launch: CandidateLaunch | None = None) -> dict[str, str]:
    """The candidate process's environment (:func:`dflash_audit.audit.sides.launch.launch_env`):
    this dflash_audit first on PYTHONPATH, then the launch's folders, unbuffered output."""
    return launch_env(launch, threads)


def unwrapped_code(returncode: int, cmd: list[str]) -> int:
    """The runner's own exit status: bubblewrap reports a child killed by signal S as exit
    code 128 + S, which is read back as -S (as :mod:`subprocess` reports a signal)."""
    if cmd and Path(cmd[0]).name == "bwrap" and returncode > 128:
        try:
            return -signal.Signals(returncode - 128)
        except ValueError:
            return returncode
    return returncode


def as_launch(spec: str | CandidateLaunch | None) -> CandidateLaunch:
    """A candidate spec (``module:attr``, ``file.py:attr``, None) or launch as a launch."""
    return spec if isinstance(spec, CandidateLaunch) else CandidateLaunch(spec=spec)


def runner_command(launch: CandidateLaunch, cases_dir: Path, out_dir: Path,
                   threads: int | None, names: list[str] | None, *extra: str) -> list[str]:
    """The runner's command line (unsandboxed): the cases ``names`` of ``cases_dir`` (None:
    none named, as with ``--load-only`` and ``--wait``), outputs into ``out_dir``, ``extra``
    flags last."""
    return [launch.executable, "-m", "dflash_audit.audit.sides.candidate_runner",
            str(cases_dir), str(out_dir), *(["--candidate", launch.spec] if launch.spec else []),
            *(["--threads", str(threads)] if threads else []),
            *(["--framework"] if launch.framework else []),
            *[a for n in names or () for a in ("--case", n)], *extra]


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc.stdin is not None:  # a waiting process's (.candidate_load.WaitingCandidate)
        try:
            proc.stdin.close()
        except OSError:  # it ended before reading what was written
            pass


def _read_status(folder: Path) -> dict[str, Any] | None:
    """The case's ``status.json`` (None while it is not published); one that is not a JSON
    object is the candidate's protocol failure."""
    try:
        status = read_output_json(folder / STATUS)
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict):
        return {"status": "protocol", "summary": f"its {STATUS} is a JSON "
                                                 f"{type(status).__name__}, not an object"}
    return status


def run_candidate_process(spec: str | CandidateLaunch | None, cases_dir: Path, names: list[str],
                          out_dir: Path, timeout_s: float | None = None, *,
                          threads: int | None = None,
                          startup_timeout_s: float | None = None,
                          on_case: Callable[[CandidateCaseRun], None] = lambda run: None,
                          waiting: Any = None
                          ) -> dict[str, CandidateCaseRun]:
    """Run the candidate ``spec`` (``module:attr``, ``file.py:attr``, None: our drafter, or a
    :class:`CandidateLaunch`: interpreter, spec and path of a framework adapter) on the cases
    ``names`` of ``cases_dir`` in its own process; outputs land in ``out_dir/<case>/`` (read
    them with :func:`read_candidate_outputs`).

    Args:
        timeout_s: seconds one case may run (from the runner's announcement of the case);
            None: ``$DFLASH_AUDIT_CANDIDATE_TIMEOUT``, else 600 scaled with the load
            (:class:`dflash_audit.limits.Watch`: stretched while the load rises).
        startup_timeout_s: seconds a (re)started process may take before announcing a case;
            None: ``$DFLASH_AUDIT_CANDIDATE_START_TIMEOUT``, else 300 scaled with the load.
        threads: torch intra-op threads of the candidate process.
        on_case: called once per case as its result is known (progress).
        waiting: the audit's candidate process, started before the cases were written
            (:class:`.candidate_load.WaitingCandidate`, on ``cases_dir`` and ``out_dir``): it
            runs them, when it can (its ``hand_over``); a process started after a crash, a
            timeout, or in its place loads the candidate again.

    Returns:
        ``{case name: CandidateCaseRun}`` for every name, in no particular order.

    Raises:
        CandidateLoadError: the runner could not load the candidate (bad spec, import error).
        LimitError: a limit's variable is not a positive number.
    """
    launch = as_launch(spec)
    spec = launch.spec
    out_dir = Path(out_dir)
    # beside the output folder, not in it: the candidate (sandboxed) can write only out_dir
    out_dir.mkdir(parents=True, exist_ok=True)  # bound into the sandbox: it must exist
    logs = out_dir.parent / f".{out_dir.name}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    remaining = list(dict.fromkeys(names))
    results: dict[str, CandidateCaseRun] = {}
    attempt = 0
    first = waiting.hand_over(remaining) if waiting is not None else None
    while remaining:
        attempt += 1
        if first is not None:  # the audit's process: loaded, now told to run the cases
            proc, cmd, stdout, stderr = first
            first = None
        else:
            stdout, stderr = logs / f"stdout-{attempt}.txt", logs / f"stderr-{attempt}.txt"
            (out_dir / HEARTBEAT).unlink(missing_ok=True)
            cmd = sandboxed(runner_command(launch, cases_dir, out_dir, threads, remaining),
                            spec, cases_dir, out_dir, env := runner_env(threads, launch))
            with new_log(stdout) as fo, new_log(stderr) as fe:
                proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
        try:
            current, watch, timed_out = _watch(proc, out_dir, remaining, results, timeout_s,
                                               startup_timeout_s, stdout, stderr, on_case)
        finally:
            kill_group(proc)  # also any child the candidate left behind
        _collect(out_dir, remaining, results, stdout, stderr, on_case)
        if (out_dir / LOAD_ERROR).is_file() and proc.returncode == EXIT_LOAD_ERROR:
            raise load_error(out_dir, launch)
        if not remaining:
            break
        tails = {"stderr_tail": log_tail(stderr), "stdout_tail": log_tail(stdout)}
        if current in remaining:
            if timed_out:  # killed at the limit: named with the setting that raises it
                status, summary = "timeout", exceeded(
                    "the candidate's run_case", watch.limit, CANDIDATE_TIMEOUT_ENV,
                    option="--candidate-timeout", scaled=timeout_s is None)
            else:
                status, summary = death_summary(unwrapped_code(proc.returncode, cmd))
            _record(results, remaining, on_case, CandidateCaseRun(
                current, status, summary, seconds=round(watch.elapsed(), 3), **tails))
            continue
        summary = (exceeded("starting the candidate's process (imports, loading the "
                            "candidate)", watch.limit, CANDIDATE_START_TIMEOUT_ENV,
                            scaled=startup_timeout_s is None) if timed_out else
                   f"the candidate process ended (code {proc.returncode}) before running it")
        for name in list(remaining):  # no progress possible: fail them all, never loop
            _record(results, remaining, on_case, CandidateCaseRun(
                name, "startup", summary, **tails))
    return results


def processes_started(out_dir: Path) -> int:
    """How many candidate processes wrote into ``out_dir`` (one log of each, kept beside it
    where the candidate cannot write): 1 for an audit where nothing restarted it."""
    logs = Path(out_dir).parent / f".{Path(out_dir).name}.logs"
    return len(list(logs.glob("stdout-*.txt"))) if logs.is_dir() else 0


def _watch(proc: subprocess.Popen, out_dir: Path, remaining: list[str],
           results: dict[str, CandidateCaseRun], timeout_s: float | None,
           startup_timeout_s: float | None, stdout: Path, stderr: Path,
           on_case: Callable[[CandidateCaseRun], None]) -> tuple[str | None, Watch, bool]:
    """Poll until the process ends or the current case (or the start) runs out of time;
    returns (case announced last, the watch that timed it since it was first seen, whether
    time ran out)."""
    case = Watch(DEFAULT_CANDIDATE_TIMEOUT_S, CANDIDATE_TIMEOUT_ENV, timeout_s)
    start = Watch(CANDIDATE_START_TIMEOUT_S, CANDIDATE_START_TIMEOUT_ENV, startup_timeout_s)
    current = None
    while True:
        ended = proc.poll() is not None
        _collect(out_dir, remaining, results, stdout, stderr, on_case)
        try:
            beat = read_output_json(out_dir / HEARTBEAT)
        except (OSError, ValueError):
            beat = None
        announced = beat.get("case") if isinstance(beat, dict) else None
        if announced != current:
            current = announced
            case.restart()
            start.restart()
        watch = case if current in remaining else start
        if ended:
            return current, watch, False
        if watch.over():
            return current, watch, True
        time.sleep(POLL_S)


def _collect(out_dir: Path, remaining: list[str], results: dict[str, CandidateCaseRun],
             stdout: Path, stderr: Path, on_case: Callable[[CandidateCaseRun], None]) -> None:
    """Move every case whose result folder is published from ``remaining`` to ``results``."""
    for name in list(remaining):
        status = _read_status(out_dir / name)
        if status is None:
            continue
        run = CandidateCaseRun.from_status(name, status)
        if not run.ok:
            run.stderr_tail, run.stdout_tail = log_tail(stderr), log_tail(stdout)
        _record(results, remaining, on_case, run)


def _record(results: dict[str, CandidateCaseRun], remaining: list[str],
            on_case: Callable[[CandidateCaseRun], None], run: CandidateCaseRun) -> None:
    results[run.case] = run
    remaining.remove(run.case)
    on_case(run)


def read_candidate_outputs(out_dir: Path, name: str) -> Any:
    """The SideOutputs the candidate process wrote for case ``name`` (same reader as the
    reference's: :meth:`SideOutputs.read`).

    Raises:
        OSError / ValueError / KeyError: no complete outputs for that case.
    """
    from dflash_audit.audit.case import SideOutputs

    return SideOutputs.read(Path(out_dir) / name)


def candidate_side(runs: dict[str, CandidateCaseRun], out_dir: Path) -> dict[str, tuple[Any, Any]]:
    """``{case: (SideOutputs, None) | (None, failing "run" CheckResult)}`` -- the form
    ``compare.run_both_sides`` returns for the candidate side. Outputs that cannot be read
    back are a protocol failure of that case."""
    from dflash_audit.audit.result import FAIL, CheckResult

    side: dict[str, tuple[Any, Any]] = {}
    for name, run in runs.items():
        if not run.ok:
            side[name] = (None, run.to_check_result())
            continue
        planted = links_in(Path(out_dir) / name) if (Path(out_dir) / name).is_dir() else []
        if planted or (Path(out_dir) / name).is_symlink():
            side[name] = (None, CheckResult(
                name="run", case=name, status=FAIL, summary="the candidate left symlinks or "
                f"special files in its output folder ({', '.join(planted[:5]) or name}): its "
                "outputs are not read", details={"cause": "protocol"}))
            continue
        try:
            side[name] = (read_candidate_outputs(out_dir, name), None)
        except (OSError, KeyError, ValueError) as exc:
            side[name] = (None, CheckResult(
                name="run", case=name, status=FAIL, summary=f"the candidate's outputs cannot "
                f"be read back: {type(exc).__name__}: {exc}", details={"cause": "protocol"}))
    return side
