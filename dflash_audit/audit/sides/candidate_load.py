"""Loading the candidate in its own process: its identity, read from the ``candidate.json``
its runner writes (the candidate is never imported here).

:func:`load_candidate_identity` loads it once (``candidate_runner --load-only``: a setup
check); :class:`WaitingCandidate` is the audit's one candidate process, which loads it, reports
its identity and waits for the cases that :func:`.candidate_process.run_candidate_process`
then hands it. Both raise :class:`.candidate_process.CandidateLoadError` when it cannot be
loaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from dflash_audit.audit.options import CANDIDATE_START_TIMEOUT_ENV, CANDIDATE_START_TIMEOUT_S
from dflash_audit.audit.sides.candidate_process import (
    POLL_S,
    CandidateLoadError,
    as_launch,
    kill_group,
    load_error,
    log_tail,
    new_log,
    runner_command,
    runner_env,
    unwrapped_code,
)
from dflash_audit.audit.sides.candidate_runner import (
    EXIT_LOAD_ERROR,
    HEARTBEAT,
    IDENTITY,
    LOAD_ERROR,
    READY,
)
from dflash_audit.audit.sides.launch import CandidateLaunch, run_with_tails
from dflash_audit.audit.sides.sandbox import sandboxed
from dflash_audit.limits import exceeded, limit_s
from dflash_audit.user_input import read_output_json

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
        raise CandidateLoadError(f"the process loading candidate {launch.shown!r} ended ({how}) "
                                 "before the candidate was loaded (its import or factory "
                                 "exits or crashes)" + (f"\n{tail}" if tail else "")) from None
    return _checked_identity(data, launch.spec)


def _identities(folders: list[Path]) -> list[tuple[int, int] | None]:
    """``(st_dev, st_ino)`` of each folder (None: gone): a bind holds the folder that was
    there when the sandbox started, so one replaced by a rename since is another folder."""
    out: list[tuple[int, int] | None] = []
    for folder in folders:
        try:
            info = os.stat(folder)
            out.append((info.st_dev, info.st_ino))
        except OSError:
            out.append(None)
    return out


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
    digests), a framework's once it has imported its modules too (so a failure there is the
    load error it is in a sandbox, and no import is killed half way), and the cases run in a
    fresh process, as does a restart after a crash or a timeout. A context manager: leaving
    it kills the process group. ``readable``: folders its cases will need besides
    ``<cache>/verifiers`` (the ``--verifier`` folder), bound from the start, so its sandbox
    is still a fresh one's once the cases name them.

    Raises (from the constructor):
        CandidateLoadError: as :func:`load_candidate_identity` (the candidate cannot be
            loaded, its process died or hung while loading it).
        LimitError: the start limit's variable is not a positive number.
        SandboxError: the sandbox starts but did not prove its isolation.
    """

    def __init__(self, spec: str | CandidateLaunch | None, cases_dir: Path, out_dir: Path, *,
                 threads: int | None = None, timeout_s: float | None = None,
                 readable: list[Path] = ()) -> None:
        from dflash_audit.audit.sides.sandbox import sandbox_status

        self.launch, self.readable = as_launch(spec), list(readable)
        self._bound = _identities(self.readable)  # a folder replaced later: a fresh process
        self.cases_dir, self.out_dir, self.threads = Path(cases_dir), Path(out_dir), threads
        for folder in (self.cases_dir, self.out_dir):  # bound into the sandbox: they must exist
            folder.mkdir(parents=True, exist_ok=True)
        for stale in (IDENTITY, READY):
            (self.out_dir / stale).unlink(missing_ok=True)
        logs = self.out_dir.parent / f".{self.out_dir.name}.logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout, self.stderr = logs / "stdout-load.txt", logs / "stderr-load.txt"
        self.env = runner_env(threads, self.launch)
        self.cmd = self._sandboxed()
        self.fallback = ""  # why a fresh process ran the cases (hand_over), "" when none did
        with new_log(self.stdout) as fo, new_log(self.stderr) as fe:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                self.cmd, stdout=fo, stderr=fe, stdin=subprocess.PIPE, env=self.env,
                start_new_session=True)
        try:
            self.identity = self._await_identity(timeout_s)
        except BaseException:
            self.close()
            raise
        if not sandbox_status().available:
            if self.launch.framework is not None:
                self._await_ready()  # its load error is the load error, not a case's (exit 2)
            self.close()

    def _sandboxed(self) -> list[str]:
        """The sandboxed ``--wait`` command as the folders are now."""
        return sandboxed(runner_command(self.launch, self.cases_dir, self.out_dir, self.threads,
                                        None, "--wait"),
                         self.launch.spec, self.cases_dir, self.out_dir, self.env,
                         readable=self.readable)

    def _await_identity(self, timeout_s: float | None) -> dict[str, Any]:
        limit = (limit_s(CANDIDATE_START_TIMEOUT_S, CANDIDATE_START_TIMEOUT_ENV)
                 if timeout_s is None else timeout_s)
        deadline = time.monotonic() + limit
        while True:
            returncode = self.proc.poll()
            if returncode is not None:
                return _ended_identity(returncode, self.cmd, self.out_dir, self.launch,
                                       log_tail(self.stderr))
            if (self.out_dir / IDENTITY).is_file():
                try:
                    return _checked_identity(read_output_json(self.out_dir / IDENTITY),
                                             self.launch.spec)
                except (OSError, ValueError):
                    pass  # not a whole file: read again, or the process ends
            if time.monotonic() > deadline:
                raise _load_timeout(self.launch.shown, limit, timeout_s)
            time.sleep(POLL_S)

    def _await_ready(self) -> None:
        """Wait until a framework's process has imported its ``FRAMEWORK_MODULES`` (after
        its identity, while the cases were built: ``ready.json``); one that ended first failed
        to load, as before its identity.

        Raises:
            CandidateLoadError: it ended first (its load error, or how it ended with the tail
                of its stderr) or took longer than the start limit.
        """
        limit = limit_s(CANDIDATE_START_TIMEOUT_S, CANDIDATE_START_TIMEOUT_ENV)
        deadline = time.monotonic() + limit
        while not (self.out_dir / READY).is_file():
            returncode = self.proc.poll()
            if returncode is not None:
                self.close()
                (self.out_dir / IDENTITY).unlink(missing_ok=True)  # it did not load after all
                _ended_identity(returncode, self.cmd, self.out_dir, self.launch,
                                log_tail(self.stderr))
            if time.monotonic() > deadline:
                self.close()
                raise _load_timeout(self.launch.shown, limit, None)
            time.sleep(POLL_S)

    def hand_over(self, names: list[str]
                  ) -> tuple[subprocess.Popen, list[str], Path, Path] | None:
        """Tell the waiting process to run ``names`` (of ``cases_dir``, written by now):
        ``(process, command, stdout log, stderr log)``; None (the process ended or killed)
        when a fresh process must run them as before: it ended meanwhile, no sandbox, or
        its sandbox would differ from a fresh one's now (a case needs a folder bound that
        did not exist or was not named when it started, or a ``readable`` folder was
        replaced).

        Raises:
            CandidateLoadError: a framework's process ended or hung before it had imported
                its ``FRAMEWORK_MODULES`` (:meth:`_await_ready`).
        """
        if self.proc is not None and self.launch.framework is not None:
            self._await_ready()
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if (proc.poll() is not None or self._sandboxed() != self.cmd
                or _identities(self.readable) != self._bound):
            # another audit may have registered a folder every sandbox hides meanwhile
            self.fallback = "ended" if proc.poll() is not None else "sandbox changed"
            kill_group(proc)
            return None
        (self.out_dir / HEARTBEAT).unlink(missing_ok=True)
        try:
            proc.stdin.write((json.dumps(list(names)) + "\n").encode())
            proc.stdin.close()
        except OSError:  # it ended meanwhile
            kill_group(proc)
            return None
        return proc, self.cmd, self.stdout, self.stderr

    def close(self) -> None:
        """Kill the process group when it was not handed over (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            kill_group(proc)

    def __enter__(self) -> WaitingCandidate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
