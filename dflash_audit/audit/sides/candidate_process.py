"""The candidate in its own process, in its sandbox, with a per-case timeout.

The process runs inside bubblewrap where it can start (:mod:`.sandbox`, :func:`sandboxed`):
read-only file system, private ``/tmp``, its own PID namespace, no network; elsewhere it runs
as it is and the report says so.

:func:`run_candidate_process` starts :mod:`dflash_audit.audit.sides.candidate_runner` on cases
already written to disk (``compare.write_cases``) in a new process group, with its stdout and
stderr captured to files (they never mix into ours). The runner announces each case in
``started.json`` and publishes each finished case atomically; this side watches the clock.
A case that runs past ``timeout_s``, or during which the process dies (``sys.exit`` caught by
the runner, ``os._exit``, a segfault, SIGKILL from the OOM killer), is a failure of that case
with its cause and the tail of the candidate's stderr; the process group is killed and a new
runner continues with the remaining cases, so one bad case never loses the others and the
audit never hangs. The only way the candidate influences the verdict is the outputs it wrote
(read back with :meth:`dflash_audit.audit.case.SideOutputs.read`, as the reference's are).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.audit.options import DEFAULT_CANDIDATE_TIMEOUT_S
from dflash_audit.audit.sides.candidate_runner import (
    EXIT_LOAD_ERROR,
    HEARTBEAT,
    IDENTITY,
    LOAD_ERROR,
    STATUS,
)
from dflash_audit.audit.sides.launch import CandidateLaunch, launch_env
from dflash_audit.audit.sides.sandbox import links_in, sandboxed
from dflash_audit.candidate import CandidateError
from dflash_audit.user_input import loads_json

#: Default of ``--candidate-timeout``: seconds one case may take (a real case with the
#: verifier's vocabulary on a loaded CPU takes well under a minute).
#: Seconds the process may take to start (import torch, load the candidate) before a case.
DEFAULT_STARTUP_TIMEOUT_S = 300.0
TAIL_CHARS = 3000
POLL_S = 0.05
#: Statuses of :class:`CandidateCaseRun` (``ok`` and the failure causes).
CAUSES = {"ok": "ran", "raised": "raised an exception", "exit": "exited",
          "protocol": "broke the output protocol", "crash": "crashed", "killed": "was killed",
          "timeout": "timed out", "startup": "did not start"}
SIGNAL_HINTS = {
    signal.SIGSEGV: "segmentation fault: native code (an extension, a kernel) read invalid "
                    "memory",
    signal.SIGKILL: "the kernel's OOM killer sends SIGKILL when memory runs out",
    signal.SIGABRT: "abort: a native assertion or an uncaught C++ exception",
    signal.SIGBUS: "bus error: invalid memory access in native code",
}


class CandidateLoadError(CandidateError):
    """The candidate process could not load the candidate (a setup error, exit 2)."""


@dataclass
class CandidateCaseRun:
    """What the candidate process did on one case.

    ``status`` is a key of :data:`CAUSES`; ``summary`` one line for the report; ``detail``
    the candidate's traceback when it raised; ``stderr_tail`` / ``stdout_tail`` the last
    :data:`TAIL_CHARS` characters of what the process printed up to then.
    """

    case: str
    status: str
    summary: str = ""
    detail: str = ""
    stderr_tail: str = ""
    stdout_tail: str = ""
    seconds: float | None = None
    #: causes named from the raise's message (:func:`dflash_audit.audit.sides.raised.name_raise`)
    diagnosis: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_status(cls, case: str, status: dict[str, Any]) -> CandidateCaseRun:
        """The run recorded by a ``status.json`` of :mod:`.candidate_runner`."""
        return cls(case, status.get("status", "protocol"), status.get("summary", ""),
                   status.get("traceback", ""), diagnosis=list(status.get("diagnosis", [])))

    def to_check_result(self) -> Any:
        """The failing ``run`` CheckResult of a failed case (cause, traceback, stderr tail)."""
        from dflash_audit.audit.result import FAIL, CheckResult

        hint = {"timeout": [("the candidate did not finish the case in time: an endless loop, "
                            "a deadlock, or a case far slower than the reference (raise "
                            "--candidate-timeout if it is only slow)")],
                "killed": ["out of memory is the usual cause of SIGKILL"],
                "exit": ["the candidate must return SideOutputs from run_case, not exit"],
                "raised": ["the candidate's parameters do not match the reference's state dict "
                           "(names or shapes): compare fc in/out features, layer count and "
                           "head sizes with the reference"]
                if "state_dict" in self.summary or "size mismatch" in self.summary else [],
                "protocol": [("the candidate does not follow the protocol of "
                             "dflash_audit.candidate")]}.get(self.status, [])
        return CheckResult(name="run", case=self.case, status=FAIL, summary=self.summary,
                           diagnosis=[*self.diagnosis, *hint],
                           details={"cause": self.status, "traceback": self.detail,
                                    "stderr_tail": self.stderr_tail,
                                    "stdout_tail": self.stdout_tail, "seconds": self.seconds})


def load_error(out_dir: Path, launch: CandidateLaunch) -> CandidateLoadError:
    """The setup error of the runner's ``load_error.json`` in ``out_dir``: its message, or,
    when a framework cannot import a module, one naming the module, who imports it and the
    fix (:func:`dflash_audit.audit.frameworks.registry.import_failure_message`)."""
    try:
        data = loads_json((out_dir / LOAD_ERROR).read_text())
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


def death_summary(returncode: int) -> tuple[str, str]:
    """``(status, summary)`` for a candidate process that ended with ``returncode`` while a
    case ran (negative: killed by that signal, as :mod:`subprocess` reports it)."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        hint = SIGNAL_HINTS.get(sig)
        status = "killed" if sig in (signal.SIGKILL, signal.SIGTERM) else "crash"
        verb = "was killed by" if status == "killed" else "crashed with"
        return status, (f"the candidate process {verb} {sig.name} while running the case"
                        + (f" ({hint})" if hint else ""))
    return "exit", (f"the candidate process exited with code {returncode} while running the "
                    "case (os._exit or sys.exit in the candidate's code, or an interpreter "
                    "abort)")


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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_status(folder: Path) -> dict[str, Any] | None:
    try:
        return loads_json((folder / STATUS).read_text())
    except (OSError, ValueError):
        return None


def run_candidate_process(spec: str | CandidateLaunch | None, cases_dir: Path, names: list[str], out_dir: Path,
                          timeout_s: float = DEFAULT_CANDIDATE_TIMEOUT_S, *,
                          threads: int | None = None,
                          startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                          on_case: Callable[[CandidateCaseRun], None] = lambda run: None
                          ) -> dict[str, CandidateCaseRun]:
    """Run the candidate ``spec`` (``module:attr``, ``file.py:attr``, None: our drafter, or a
    :class:`CandidateLaunch`: interpreter, spec and path of a framework adapter) on the cases ``names`` of ``cases_dir`` in its own process; outputs land in
    ``out_dir/<case>/`` (read them with :func:`read_candidate_outputs`).

    Args:
        timeout_s: seconds one case may run (from the runner's announcement of the case).
        startup_timeout_s: seconds a (re)started process may take before announcing a case.
        threads: torch intra-op threads of the candidate process.
        on_case: called once per case as its result is known (progress).

    Returns:
        ``{case name: CandidateCaseRun}`` for every name, in no particular order.

    Raises:
        CandidateLoadError: the runner could not load the candidate (bad spec, import error).
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
    while remaining:
        attempt += 1
        stdout, stderr = logs / f"stdout-{attempt}.txt", logs / f"stderr-{attempt}.txt"
        (out_dir / HEARTBEAT).unlink(missing_ok=True)
        cmd = [launch.executable, "-m", "dflash_audit.audit.sides.candidate_runner", str(cases_dir),
               str(out_dir), *(["--candidate", spec] if spec else []),
               *(["--threads", str(threads)] if threads else []),
               *(["--framework"] if launch.framework else []),
               *[a for n in remaining for a in ("--case", n)]]
        env = runner_env(threads, launch)
        cmd = sandboxed(cmd, spec, cases_dir, out_dir, env)
        with _new_log(stdout) as fo, _new_log(stderr) as fe:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        try:
            current, since, timed_out = _watch(proc, out_dir, remaining, results, timeout_s,
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
            seconds = time.monotonic() - since
            if timed_out:
                status, summary = "timeout", (f"the candidate did not finish the case within "
                                              f"{timeout_s:g} s and was killed")
            else:
                status, summary = death_summary(unwrapped_code(proc.returncode, cmd))
            _record(results, remaining, on_case, CandidateCaseRun(
                current, status, summary, seconds=round(seconds, 3), **tails))
            continue
        why = (f"did not start a case within {startup_timeout_s:g} s" if timed_out else
               f"ended (code {proc.returncode}) before running it")
        for name in list(remaining):  # no progress possible: fail them all, never loop
            _record(results, remaining, on_case, CandidateCaseRun(
                name, "startup", f"the candidate process {why}", **tails))
    return results


def _watch(proc: subprocess.Popen, out_dir: Path, remaining: list[str],
           results: dict[str, CandidateCaseRun], timeout_s: float, startup_timeout_s: float,
           stdout: Path, stderr: Path, on_case: Callable[[CandidateCaseRun], None]
           ) -> tuple[str | None, float, bool]:
    """Poll until the process ends or the current case (or the start) runs out of time;
    returns (case announced last, when it was first seen, whether time ran out)."""
    current, since = None, time.monotonic()
    while True:
        ended = proc.poll() is not None
        _collect(out_dir, remaining, results, stdout, stderr, on_case)
        try:
            announced = loads_json((out_dir / HEARTBEAT).read_text()).get("case")
        except (OSError, ValueError):
            announced = None
        if announced != current:
            current, since = announced, time.monotonic()
        if ended:
            return current, since, False
        limit = timeout_s if current in remaining else startup_timeout_s
        if time.monotonic() - since > limit:
            return current, since, True
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
                            timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> dict[str, Any]:
    """Load the candidate in a runner process (``--load-only``) and return its
    ``candidate.json`` (name, class, source_files, has_select_anchors): the setup check that
    replaces importing the candidate into our process.

    Raises:
        CandidateLoadError: it cannot be loaded (message from the runner), or the process
            died, hung or wrote nothing (with the tail of its stderr).
    """
    launch = as_launch(spec)
    spec = launch.spec
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / IDENTITY).unlink(missing_ok=True)
    cmd = [launch.executable, "-m", "dflash_audit.audit.sides.candidate_runner", str(out_dir),
           str(out_dir), "--load-only", *(["--candidate", spec] if spec else []),
           *(["--framework"] if launch.framework else [])]
    env = runner_env(None, launch)
    try:
        proc = subprocess.run(sandboxed(cmd, spec, out_dir, out_dir, env), capture_output=True,
                              stdin=subprocess.DEVNULL, env=env, timeout=timeout_s,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        raise CandidateLoadError(f"loading the candidate {spec!r} took more than "
                                 f"{timeout_s:g} s") from None
    if proc.returncode == EXIT_LOAD_ERROR and (out_dir / LOAD_ERROR).is_file():
        raise load_error(out_dir, launch)
    try:
        return loads_json((out_dir / IDENTITY).read_text())
    except (OSError, ValueError):
        rc = unwrapped_code(proc.returncode, proc.args)
        how = (f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}")
        tail = proc.stderr.decode(errors="replace")[-TAIL_CHARS:].strip()
        raise CandidateLoadError(f"the process loading candidate {spec!r} ended ({how}) "
                                 "before the candidate was loaded (its import or factory "
                                 "exits or crashes)" + (f"\n{tail}" if tail else "")) from None
