"""A fork server for the suite: one interpreter that has imported the heavy modules once and
forks a fresh child per call, so a test pays for its work, not for ~3-5 s of importing torch,
transformers (and, for the reference's, speculators). Users: :mod:`cli_zygote` (the
``dflash-audit`` CLI) and :mod:`reference_zygote` (scripts in the reference's process).

Each call is a fresh ``fork()``: its own process, exit code, signals, file descriptors, working
folder and environment (replaced before the child's code runs, as ``subprocess.run(env=...)``
would), and nothing of one call carries into the next. stdout and stderr are one pipe the
caller reads. The server imports with one OpenMP thread and starts no thread before forking
(checked): a child's torch uses one intra-op thread, as the suite's workers do.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

from dflash_audit.limits import Watch, limit_s

#: The server, after the preload code and ``def _child(req):`` with the run body: each request
#: forks a child that runs ``req["prelude"]``, then ``_child(req)`` (req: args, cwd, env).
_CHECK = r"""
assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, \
    "the zygote must not fork with threads"
"""
_LOOP = r"""
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
        code = 0
        try:
            exec("import sys\n" + req["prelude"], {"__name__": "__main__"})
            _child(req)
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
    """One pre-imported interpreter that forks a child per :meth:`run`.

    Args:
        launch: ``launch(code, fd)`` -> the argv that runs Python ``code`` with the socket's
            file descriptor ``fd`` as ``sys.argv[1]``.
        preload: Python run once before the first fork (the imports).
        run: the body of ``_child(req)``, indented by four spaces.
        env, cwd: the server's environment and folder (some libraries read it at import).
    """

    def __init__(self, launch: Callable[[str, str], list[str]], preload: str, run: str,
                 env: dict[str, str], cwd: Path) -> None:
        ours, theirs = socket.socketpair()
        code = (f"import json, os, socket, struct, sys, threading\n{preload}\n{_CHECK}"
                f"def _child(req):\n{run}\n{_LOOP}")
        self.proc = subprocess.Popen(launch(code, str(theirs.fileno())),
                                     pass_fds=[theirs.fileno()], env=env, cwd=cwd)
        theirs.close()
        self.sock = ours

    def alive(self) -> bool:
        """Whether the server still runs."""
        return self.proc.poll() is None

    def close(self) -> None:
        """End the server (it exits when its socket closes)."""
        self.sock.close()
        self.proc.wait(timeout=limit_s(60))

    def run(self, args: list[str], cwd: Path, env: dict[str, str], prelude: str = "",
            timeout: float = 600.0) -> subprocess.CompletedProcess:
        """A child with ``args`` in ``cwd`` and exactly ``env``, after ``prelude`` (Python run
        in the child first). stdout and stderr merged into ``stdout``.

        ``timeout``: seconds on a quiet machine, scaled with the load
        (:class:`dflash_audit.limits.Watch`).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (the child's group is killed).
            RuntimeError: the zygote died.
        """
        read, write = os.pipe()
        request = json.dumps({"args": list(map(str, args)), "cwd": str(cwd), "env": env,
                              "prelude": prelude}).encode()
        try:
            socket.send_fds(self.sock, [request], [write])
        except OSError:
            raise self._died() from None
        finally:
            os.close(write)
        pid = struct.unpack("!q", self._recv(8))[0]
        chunks, watch = [], Watch(timeout)  # stretched while the machine is busy
        with os.fdopen(read, "rb") as pipe:
            while True:
                if watch.over():
                    os.killpg(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(args, watch.limit, b"".join(chunks))
                ready, _, _ = select.select([pipe], [], [], 1.0)
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
            try:
                part = self.sock.recv(n - len(data))
            except OSError:
                part = b""
            if not part:
                raise self._died()
            data += part
        return data

    def _died(self) -> RuntimeError:
        try:
            code = self.proc.wait(timeout=limit_s(30))
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"the zygote died (exit {code}; its preload's error is on stderr)")
