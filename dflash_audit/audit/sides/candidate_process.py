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
"""

from __future__ import annotations

import json
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
    IDENTITY,
    LOAD_ERROR,
    STATUS,
)
from dflash_audit.audit.sides.case_run import CandidateCaseRun, death_summary
from dflash_audit.audit.sides.launch import TAIL_CHARS, CandidateLaunch, launch_env, run_with_tails
from dflash_audit.audit.sides.sandbox import links_in, sandboxed
from dflash_audit.candidate import CandidateError
from dflash_audit.limits import Watch, exceeded, limit_s
from dflash_audit.user_input import read_output_json

POLL_S = 0.05
class CandidateLoadError(CandidateError):
    """The candidate process could not load the candidate (a setup error, exit 2)."""


def load_error(out_dir: Path, launch: CandidateLaunch) -> CandidateLoadError:
    """The setup error of the runner's ``load_error.json`` in ``out_dir``: its message, or,
    when a framework cannot import a module, one naming the module, who imports it and the
    fix (:func:`dflash_audit.audit.frameworks.registry.import_failure_message`)."""
    try:
        data = read_output_json(out_dir / LOAD_ERROR)
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    if launch.framework is not None and data.get("missing_module"):
        from dflash_audit.audit.frameworks.registry import import_failure_message

        return CandidateLoadError(import_failure_message(launch, data))
    return CandidateLoadError(str(data.get("message", "")))


def _tail(path: Path) -> str:
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


def _new_log(path: Path) -> Any:
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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc.stdin is not None:  # a waiting process's (WaitingCandidate)
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


#: The longest name or class a candidate's identity keeps (the rest is cut).
MAX_IDENTITY_TEXT = 200


def _checked_identity(data: Any, spec: str | None) -> dict[str, Any]:
    """The identity the candidate's process wrote, with the types its readers rely on:
    ``name`` and ``class`` short strings, ``source_files`` strings, ``has_select_anchors`` a
    bool, ``adapter`` an object when present.

    Raises:
        CandidateLoadError: it is not a JSON object.
    """
    if not isinstance(data, dict):
        raise CandidateLoadError(f"the process loading candidate {spec!r} wrote an identity "
                                 f"({IDENTITY}) that is a JSON {type(data).__name__}, not an "
                                 "object: the candidate's code replaced it")
    files = data.get("source_files")
    out = {**data, "name": str(data.get("name") or spec or "")[:MAX_IDENTITY_TEXT],
           "class": str(data.get("class") or "")[:MAX_IDENTITY_TEXT],
           "source_files": [f for f in files if isinstance(f, str)]
           if isinstance(files, list) else [],
           "has_select_anchors": data.get("has_select_anchors") is True}
    if not isinstance(out.get("adapter", {}), dict):
        out["adapter"] = {}
    return out


def run_candidate_process(spec: str | CandidateLaunch | None, cases_dir: Path, names: list[str],
                          out_dir: Path, timeout_s: float | None = None, *,
                          threads: int | None = None,
                          startup_timeout_s: float | None = None,
                          on_case: Callable[[CandidateCaseRun], None] = lambda run: None,
                          waiting: WaitingCandidate | None = None
                          ) -> dict[str, CandidateCaseRun]:
    """Run the candidate ``spec`` (``module:attr``, ``file.py:attr``, None: our drafter, or a
    :class:`CandidateLaunch`: interpreter, spec and path of a framework adapter) on the cases ``names`` of ``cases_dir`` in its own process; outputs land in
    ``out_dir/<case>/`` (read them with :func:`read_candidate_outputs`).

    Args:
        timeout_s: seconds one case may run (from the runner's announcement of the case);
            None: ``$DFLASH_AUDIT_CANDIDATE_TIMEOUT``, else 600 scaled with the load
            (:class:`dflash_audit.limits.Watch`: stretched while the load rises).
        startup_timeout_s: seconds a (re)started process may take before announcing a case;
            None: ``$DFLASH_AUDIT_CANDIDATE_START_TIMEOUT``, else 300 scaled with the load.
        threads: torch intra-op threads of the candidate process.
        on_case: called once per case as its result is known (progress).
        waiting: the audit's candidate process, started before the cases were written
            (:class:`WaitingCandidate`, on ``cases_dir`` and ``out_dir``): it runs them, when
            it can (:meth:`WaitingCandidate.hand_over`); a process started after a crash, a
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
            with _new_log(stdout) as fo, _new_log(stderr) as fe:
                proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
        try:
            current, watch, timed_out = _watch(proc, out_dir, remaining, results, timeout_s,
                                               startup_timeout_s, stdout, stderr, on_case)
        finally:
            _kill_group(proc)  # also any child the candidate left behind
        _collect(out_dir, remaining, results, stdout, stderr, on_case)
        if (out_dir / LOAD_ERROR).is_file() and proc.returncode == EXIT_LOAD_ERROR:
            raise load_error(out_dir, launch)
        if not remaining:
            break
        tails = {"stderr_tail": _tail(stderr), "stdout_tail": _tail(stdout)}
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
            run.stderr_tail, run.stdout_tail = _tail(stderr), _tail(stdout)
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


def load_candidate_identity(spec: str | CandidateLaunch | None, out_dir: Path,
                            timeout_s: float | None = None) -> dict[str, Any]:
    """Load the candidate in a runner process (``--load-only``) and return its
    ``candidate.json`` (name, class, source_files, has_select_anchors): the setup check that
    replaces importing the candidate into our process. ``timeout_s``: seconds it may take;
    None: ``$DFLASH_AUDIT_CANDIDATE_START_TIMEOUT``, else 300 scaled with the load.

    Raises:
        CandidateLoadError: it cannot be loaded (message from the runner), or the process
            died, hung (the message names the setting to raise) or wrote nothing (with the
            tail of its stderr).
        LimitError: the limit's variable is not a positive number.
    """
    launch = as_launch(spec)
    spec = launch.spec
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / IDENTITY).unlink(missing_ok=True)
    env = runner_env(None, launch)
    limit = (limit_s(CANDIDATE_START_TIMEOUT_S, CANDIDATE_START_TIMEOUT_ENV)
             if timeout_s is None else timeout_s)
    cmd = sandboxed(runner_command(launch, out_dir, out_dir, None, None, "--load-only"),
                    spec, out_dir, out_dir, env)
    try:  # its output to files, only their tails read: a flood of output costs no memory
        returncode, _, stderr = run_with_tails(cmd, env, limit)
    except subprocess.TimeoutExpired:
        raise _load_timeout(spec, limit, timeout_s) from None
    return _ended_identity(returncode, cmd, out_dir, launch, stderr)


def _load_timeout(spec: str | None, limit: float, timeout_s: float | None) -> CandidateLoadError:
    return CandidateLoadError(exceeded(f"loading the candidate {spec!r}", limit,
                                       CANDIDATE_START_TIMEOUT_ENV, scaled=timeout_s is None))


def _ended_identity(returncode: int, cmd: list[str], out_dir: Path, launch: CandidateLaunch,
                    stderr: str) -> dict[str, Any]:
    """The identity a runner that ended with ``returncode`` wrote into ``out_dir``.

    Raises:
        CandidateLoadError: its load error, or none written (the process died first)."""
    if returncode == EXIT_LOAD_ERROR and (out_dir / LOAD_ERROR).is_file():
        raise load_error(out_dir, launch)
    try:
        data = read_output_json(out_dir / IDENTITY)
    except (OSError, ValueError):
        rc = unwrapped_code(returncode, cmd)
        how = (f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
        tail = stderr.strip()
        raise CandidateLoadError(f"the process loading candidate {launch.spec!r} ended ({how}) "
                                 "before the candidate was loaded (its import or factory "
                                 "exits or crashes)" + (f"\n{tail}" if tail else "")) from None
    return _checked_identity(data, launch.spec)


class WaitingCandidate:
    """The audit's one candidate process: started before its cases exist, it loads the
    candidate, reports its identity (:attr:`identity`, as :func:`load_candidate_identity`
    does), then blocks on its stdin (``candidate_runner --wait``) until
    :func:`run_candidate_process` hands it the cases (:meth:`hand_over`), so the candidate's
    imports are paid once per audit.

    It lives on only in the sandbox, where the candidate sees nothing of the audit but its
    own, read-only ``cases_dir`` (the private copy, still empty) and writable ``out_dir``:
    the cases written and their digests taken meanwhile are out of its reach. Without a
    sandbox it ends once its identity is read (it could change the cases before their
    digests), and the cases run in a fresh process, as does a restart after a crash or a
    timeout. A context manager: leaving it kills the process group.

    Raises (from the constructor):
        CandidateLoadError: as :func:`load_candidate_identity` (the candidate cannot be
            loaded, its process died or hung while loading it).
        LimitError: the start limit's variable is not a positive number.
        SandboxError: the sandbox starts but did not prove its isolation.
    """

    def __init__(self, spec: str | CandidateLaunch | None, cases_dir: Path, out_dir: Path, *,
                 threads: int | None = None, timeout_s: float | None = None) -> None:
        from dflash_audit.audit.sides.sandbox import sandbox_status

        self.launch = as_launch(spec)
        self.cases_dir, self.out_dir, self.threads = Path(cases_dir), Path(out_dir), threads
        for folder in (self.cases_dir, self.out_dir):  # bound into the sandbox: they must exist
            folder.mkdir(parents=True, exist_ok=True)
        (self.out_dir / IDENTITY).unlink(missing_ok=True)
        logs = self.out_dir.parent / f".{self.out_dir.name}.logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout, self.stderr = logs / "stdout-load.txt", logs / "stderr-load.txt"
        self.env = runner_env(threads, self.launch)
        self.cmd = self._sandboxed()
        with _new_log(self.stdout) as fo, _new_log(self.stderr) as fe:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                self.cmd, stdout=fo, stderr=fe, stdin=subprocess.PIPE, env=self.env,
                start_new_session=True)
        try:
            self.identity = self._await_identity(timeout_s)
        except BaseException:
            self.close()
            raise
        if not sandbox_status().available:
            self.close()

    def _sandboxed(self) -> list[str]:
        """The sandboxed ``--wait`` command as the folders are now."""
        return sandboxed(runner_command(self.launch, self.cases_dir, self.out_dir, self.threads,
                                        None, "--wait"),
                         self.launch.spec, self.cases_dir, self.out_dir, self.env)

    def _await_identity(self, timeout_s: float | None) -> dict[str, Any]:
        limit = (limit_s(CANDIDATE_START_TIMEOUT_S, CANDIDATE_START_TIMEOUT_ENV)
                 if timeout_s is None else timeout_s)
        deadline = time.monotonic() + limit
        while True:
            returncode = self.proc.poll()
            if returncode is not None:
                return _ended_identity(returncode, self.cmd, self.out_dir, self.launch,
                                       _tail(self.stderr))
            if (self.out_dir / IDENTITY).is_file():
                try:
                    return _checked_identity(read_output_json(self.out_dir / IDENTITY),
                                             self.launch.spec)
                except (OSError, ValueError):
                    pass  # not a whole file: read again, or the process ends
            if time.monotonic() > deadline:
                raise _load_timeout(self.launch.spec, limit, timeout_s)
            time.sleep(POLL_S)

    def hand_over(self, names: list[str]
                  ) -> tuple[subprocess.Popen, list[str], Path, Path] | None:
        """Tell the waiting process to run ``names`` (of ``cases_dir``, written by now):
        ``(process, command, stdout log, stderr log)``; None (the process ended or killed)
        when a fresh process must run them as before: it ended meanwhile, no sandbox, or
        its sandbox would differ from a fresh one's now (a case needs a folder bound that
        did not exist or was not named when it started)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is not None or self._sandboxed() != self.cmd:
            _kill_group(proc)
            return None
        (self.out_dir / HEARTBEAT).unlink(missing_ok=True)
        try:
            proc.stdin.write((json.dumps(list(names)) + "\n").encode())
            proc.stdin.close()
        except OSError:  # it ended meanwhile
            _kill_group(proc)
            return None
        return proc, self.cmd, self.stdout, self.stderr

    def close(self) -> None:
        """Kill the process group when it was not handed over (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc)

    def __enter__(self) -> WaitingCandidate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
