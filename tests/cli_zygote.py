"""``dflash-audit ARGS`` as a real child process, forked from an interpreter that has already
imported the CLI and its heavy dependencies (torch, transformers): the suite's shared
fixture for the many one-command tests (bad inputs, faults), which otherwise spend ~3 s each
importing before the 0.1 s of work they test.

Each call is a fresh ``fork()`` of the zygote (one per test process, started on first use):
its own process, exit code, signals, file descriptors, working folder and environment
(replaced before ``main()`` runs, as ``subprocess.run(env=...)`` would), and nothing of one
call carries into the next. stdout and stderr are one pipe the caller reads. The zygote
imports only, with one OpenMP thread, and starts no thread before forking (checked): a
child's torch uses one intra-op thread, as the suite's workers do.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the zygote imports before it forks: the CLI and what its commands import lazily.
PRELOAD = ("dflash_audit.cli", "transformers", "transformers.models.llama.modeling_llama",
           "dflash_audit.train.commands", "dflash_audit.audit.compare", "safetensors.torch")

_SERVER = r"""
import array, importlib, json, os, socket, struct, sys, threading
for name in PRELOAD:
    importlib.import_module(name)
from dflash_audit.cli import quiet_third_party_bars
assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, \
    "the zygote must not fork with threads"
sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
    if not msg:
        break
    req = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        sock.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        os.close(fds[0])
        os.setpgid(0, 0)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["dflash-audit", *req["args"]]
        code = 0
        try:
            exec("import sys\n" + req["prelude"], {"__name__": "__main__"})
            quiet_third_party_bars()  # what importing the CLI does, now with this env
            from dflash_audit.cli import main
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    os.close(fds[0])
    sock.sendall(struct.pack("!q", pid))
    _, status = os.waitpid(pid, 0)
    sock.sendall(struct.pack("!q", os.waitstatus_to_exitcode(status)))
"""


class Zygote:
    """One pre-imported interpreter that forks a child per :meth:`run`."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        # one OpenMP thread: torch then starts no thread at import (the zygote must fork
        # without threads); the children's own children get the caller's environment
        env = {"OMP_NUM_THREADS": "1", **os.environ, **FIXED_ENV}
        code = f"PRELOAD = {PRELOAD!r}\n{_SERVER}"
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, cwd=ROOT)
        theirs.close()
        self.sock = ours

    def run(self, args: list[str], cwd: Path, env: dict[str, str], prelude: str = "",
            timeout: float = 600.0) -> subprocess.CompletedProcess:
        """``dflash-audit ARGS`` in ``cwd`` with exactly ``env``, after ``prelude`` (Python run
        in the child first). stdout and stderr merged into ``stdout``.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (the child's group is killed).
            RuntimeError: the zygote died.
        """
        read, write = os.pipe()
        request = json.dumps({"args": list(map(str, args)), "cwd": str(cwd), "env": env,
                              "prelude": prelude}).encode()
        socket.send_fds(self.sock, [request], [write])
        os.close(write)
        pid = struct.unpack("!q", self._recv(8))[0]
        chunks, deadline = [], time.monotonic() + timeout
        with os.fdopen(read, "rb") as pipe:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    os.killpg(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(args, timeout, b"".join(chunks))
                ready, _, _ = select.select([pipe], [], [], min(left, 1.0))
                if ready:
                    data = os.read(pipe.fileno(), 1 << 16)
                    if not data:
                        break
                    chunks.append(data)
        code = struct.unpack("!q", self._recv(8))[0]
        return subprocess.CompletedProcess(args, code, b"".join(chunks).decode(errors="replace"))

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = self.sock.recv(n - len(data))
            if not part:
                raise RuntimeError(f"the CLI zygote died (exit {self.proc.poll()})")
            data += part
        return data


#: What every call's environment holds (the zygote's too: some libraries read it at import).
FIXED_ENV = {"PYTHONPATH": str(ROOT), "DFLASH_AUDIT_PROGRESS_INTERVAL": "0", "COLUMNS": "200"}
_ZYGOTE: Zygote | None = None


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None,
            prelude: str = "", timeout: float = 600.0) -> subprocess.CompletedProcess:
    """``dflash-audit ARGS`` in a forked child of this test process's zygote, with this
    process's environment plus ``env`` (this checkout first on PYTHONPATH, progress lines at
    once, 200 columns); stdout and stderr merged."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = Zygote()
    return _ZYGOTE.run(args, cwd, {**os.environ, **FIXED_ENV, **(env or {})}, prelude, timeout)
