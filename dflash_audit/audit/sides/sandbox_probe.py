"""What the sandbox's proof runs INSIDE the candidate's sandbox (standard library only, run as
``python -I -S -c <this file's source> <json>``): it tries what a hostile candidate running as
root would try and prints the raw facts as one JSON object on stdout;
:func:`dflash_audit.audit.sides.sandbox_proof.judge` decides from them.

The JSON argument: ``{"read_only": [folders bound read-only], "hidden": [folders covered by an
empty tmpfs: the report keys], "host_pid": the auditing process's pid, "host_pidns": its
``/proc/self/ns/pid`` link, "mounts": [mount points to try to unmount]}``.

Facts printed (errno names, never the content of any file):

- ``status``: ``/proc/self/status`` lines ``CapInh CapPrm CapEff CapBnd CapAmb NoNewPrivs``
  and ``uid``;
- ``writes``: ``{folder: "ok" | errno name}`` for creating a new file in each read-only
  folder (a file that was created is removed at once);
- ``remount``: errno name of ``mount(NULL, "/", NULL, MS_REMOUNT|MS_BIND, NULL)`` (read-write)
  or ``"ok"``; ``umount``: ``{mount point: "ok" | errno name}`` (``umount2(MNT_DETACH)``);
- ``pids``: the pids ``/proc`` lists; ``pidns``: this process's PID namespace link;
- ``hidden``: ``{folder: [entry names] | errno name}``;
- ``interfaces``: the network interfaces this process sees;
- ``nested``: the same unmount / remount attempts from a child that first made its own user and
  mount namespace (``"unshare": errno name`` when it cannot make one).
"""

import ctypes
import errno
import json
import os
import socket
import sys
import uuid

MS_REMOUNT, MS_BIND, MNT_DETACH = 32, 4096, 2
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
LIBC = ctypes.CDLL(None, use_errno=True)


def _err(code):
    return errno.errorcode.get(code, str(code))


def _call(fn, *args):
    """``"ok"`` when the libc call succeeded, else its errno name."""
    return "ok" if fn(*args) == 0 else _err(ctypes.get_errno())


def _status():
    out = {"uid": os.getuid()}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"):
                out[key] = value.strip()
    return out


def _write(folder):
    path = os.path.join(folder, f".dflash-audit-sandbox-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return _err(exc.errno)
    os.close(fd)
    os.unlink(path)  # it reached that folder: never leave it there
    return "ok"


def _mounts(points):
    """Unmount each point, then remount / read-write: what a candidate as root would do."""
    umount = {p: _call(LIBC.umount2, p.encode(), MNT_DETACH) for p in points}
    remount = _call(LIBC.mount, None, b"/", None, MS_REMOUNT | MS_BIND, None)
    return umount, remount


def _nested(points):
    """The mount attempts from a child in its own user + mount namespace (where it holds every
    capability of that namespace): the sandbox's mounts must stay locked."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        result = {"unshare": _call(LIBC.unshare, CLONE_NEWUSER | CLONE_NEWNS)}
        if result["unshare"] == "ok":
            result["umount"], result["remount"] = _mounts(points)
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"{}")


def _hidden(folder):
    try:
        return sorted(os.listdir(folder))
    except OSError as exc:
        return _err(exc.errno)


def main():
    args = json.loads(sys.argv[1])
    facts = {"status": _status(), "pidns": os.readlink("/proc/self/ns/pid"),
             "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
             "writes": {f: _write(f) for f in args["read_only"]},
             "hidden": {f: _hidden(f) for f in args["hidden"]},
             "interfaces": sorted(name for _, name in socket.if_nameindex())}
    # the writes and reads above come first: a mount change that succeeds must not make them
    facts["nested"] = _nested(args["mounts"])
    facts["umount"], facts["remount"] = _mounts(args["mounts"])
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
