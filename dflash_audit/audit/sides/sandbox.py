"""The candidate's sandbox: the bubblewrap (``bwrap``) command line around its process.

The candidate is untrusted code (DESIGN.md section 9). Inside the sandbox it sees:

- the whole file system **read-only** (``--ro-bind / /``): it cannot edit the cached
  reference tree (``__pycache__`` included), dflash-audit's installed files, site-packages,
  the report folder or another process's files;
- a private, empty ``/tmp`` (``--tmpfs /tmp``) and ``/dev`` (``--dev``, its own ``/dev/shm``),
  with only the folders it needs bound back: read-only its copy of the cases, the folder of
  a ``file.py`` candidate, the working directory and ``PYTHONPATH`` entries under ``/tmp``;
  read-write its own output folder;
- nothing of the report key (:data:`dflash_audit.report.fingerprint.KEY_DIR` is covered by an
  empty tmpfs) nor of the cached reference outputs (:mod:`.reference_records`, covered too), nor of any audit's work folder (:func:`work_root`, where every compare keeps
  its cases and both sides' outputs, is covered by an empty tmpfs, and only this candidate's
  own cases and output folder are bound back; every root an audit of this user made, whatever
  its ``$TMPDIR``, is covered too: :func:`known_work_roots`): not even when ``/tmp`` itself is
  readable, ``$TMPDIR`` points outside it or is the candidate's folder, and not for folders
  another audit creates later;
- its own PID namespace (``--unshare-pid``) that ends with it: the kernel kills every process
  of the namespace when its first process exits, so a daemon that ``setsid``s or
  double-forks never outlives the candidate; ``--die-with-parent`` ends it with compare;
- no network (``--unshare-net``: only a loopback), its own IPC and a new session.

:func:`sandbox_status` probes once per process whether ``bwrap`` can start here (it needs
user namespaces, or root); where it cannot, the candidate runs unsandboxed and the report
says so (``--require-sandbox`` then refuses with exit 2).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: ``DFLASH_AUDIT_SANDBOX=off`` runs the candidate without a sandbox (tests of the detection
#: that remains without one; the report says so, and ``--require-sandbox`` refuses).
SANDBOX_ENV = "DFLASH_AUDIT_SANDBOX"
#: Devices a CUDA candidate needs (bound when present).
GPU_DEVICES = ("/dev/nvidia*", "/dev/dri")
UNAVAILABLE = "candidate ran without a sandbox"


@dataclass(frozen=True)
class SandboxStatus:
    """Whether the sandbox can start: ``bwrap`` (its path) or None with ``reason``."""

    bwrap: str | None
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.bwrap is not None

    def to_dict(self) -> dict[str, object]:
        """The report's ``sandbox`` entry."""
        return {"sandboxed": self.available, "tool": "bubblewrap" if self.available else None,
                "note": "" if self.available else f"{UNAVAILABLE}: {self.reason}"}


@functools.lru_cache(maxsize=1)
def sandbox_status() -> SandboxStatus:
    """Probe ``bwrap`` once: run ``true`` under the same flags the candidate gets.

    Returns:
        :class:`SandboxStatus`; unavailable when ``$DFLASH_AUDIT_SANDBOX`` is ``off``, when
        no ``bwrap`` is on PATH (``apt-get install -y bubblewrap``; ``scripts/setup.sh`` does
        it), or when it cannot create its namespaces here (the reason is its stderr).
    """
    if os.environ.get(SANDBOX_ENV, "").lower() in ("off", "0", "no", "false"):
        return SandboxStatus(None, f"${SANDBOX_ENV}=off")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return SandboxStatus(None, "bubblewrap (bwrap) is not installed; `sudo apt-get "
                                   "install -y bubblewrap` or `bash scripts/setup.sh` adds it")
    try:
        proc = subprocess.run(sandbox_command(["true"], bwrap=bwrap), capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SandboxStatus(None, f"bwrap cannot start ({exc})")
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.split())[-300:]
        return SandboxStatus(None, f"bwrap cannot create its namespaces here ({tail})")
    return SandboxStatus(bwrap)


#: The name of the work root in a temporary directory (:func:`work_root`).
WORK_ROOT_NAME = "dflash-audit-work"
#: The work root of the default temporary directory: hidden from every candidate, whatever
#: ``$TMPDIR`` its own audit has.
DEFAULT_WORK_ROOT = Path("/tmp") / WORK_ROOT_NAME


def _roots_registry() -> Path:
    """``~/.cache/dflash-audit/work-roots``: every work root :func:`work_root` made (one
    resolved path a line), shared by all audits of this user whatever their ``$TMPDIR`` or
    ``$DFLASH_AUDIT_CACHE``, so the sandbox hides them all, not only its own audit's."""
    return Path.home() / ".cache" / "dflash-audit" / "work-roots"


def _record_root(root: Path) -> None:
    """Add ``root`` to :func:`_roots_registry` (under a lock), dropping roots that are gone;
    best effort: a registry that cannot be written leaves the default root and this audit's
    own hidden."""
    import fcntl

    registry = _roots_registry()
    try:
        registry.parent.mkdir(parents=True, exist_ok=True)
        with open(registry, "a+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            known = [line for line in f.read().splitlines() if line]
            keep = [line for line in dict.fromkeys(known) if Path(line).is_dir()]
            if str(root) not in keep:
                keep.append(str(root))
            if keep != known:
                f.seek(0)
                f.truncate()
                f.write("".join(f"{line}\n" for line in keep))
    except (OSError, UnicodeDecodeError):
        pass


def known_work_roots() -> list[Path]:
    """Every audit's work root a candidate must not read: the default one and those of
    :func:`_roots_registry` (audits run with another ``$TMPDIR``)."""
    roots = [DEFAULT_WORK_ROOT]
    try:
        text = _roots_registry().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = ""
    roots += [Path(line) for line in text.splitlines() if line.startswith("/")]
    return list(dict.fromkeys(roots))


def work_root() -> Path:
    """The folder every compare makes its work folder in (``<tempdir>/dflash-audit-work``,
    created here, recorded in :func:`_roots_registry`): one root the sandbox hides as a whole,
    so a candidate never reads another audit's cases or reference outputs.

    Raises:
        CompareSetupError: it is not a folder this user owns and can write (a file, a link,
            another user's folder, chmod 000): no audit keeps its cases there.
    """
    import tempfile

    from dflash_audit.audit.setup_error import CompareSetupError

    root = Path(tempfile.gettempdir()).resolve() / WORK_ROOT_NAME
    try:
        if not os.path.lexists(root):  # a link (maybe dangling) is refused below, not followed
            root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
    except OSError as exc:
        raise CompareSetupError(
            f"cannot use the work folder {root} (every audit keeps its cases there): {exc}; "
            "remove it or set $TMPDIR to another folder") from None
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()
            or not os.access(root, os.W_OK | os.X_OK)):
        what = ("a link" if stat.S_ISLNK(info.st_mode) else "not a folder"
                if not stat.S_ISDIR(info.st_mode) else "another user's folder"
                if info.st_uid != os.geteuid() else "a folder this user cannot write")
        raise CompareSetupError(
            f"cannot use the work folder {root} (every audit keeps its cases there): it is "
            f"{what}; remove it or set $TMPDIR to another folder")
    _record_root(root)
    return root


def interpreter_folders(executable: str) -> list[Path]:
    """What the interpreter ``executable`` runs from, wherever it lives (also under ``/tmp``,
    which the sandbox replaces): its environment (``bin/..``: a venv with its site-packages),
    the folder of the file it links to and that file's prefix; for this interpreter also its
    ``sys.prefix``, ``sys.base_prefix`` and every ``sys.path`` folder (an editable install's
    project). Bound back read-only by :func:`sandbox_command`."""
    if not executable:
        return []
    exe = Path(executable)
    real = exe.resolve()
    out = [exe.parent.parent, real.parent, real.parent.parent]
    if exe.absolute() == Path(sys.executable).absolute():
        out += [Path(sys.prefix), Path(sys.base_prefix)]
        out += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    return out


def _under_tmp(path: Path) -> bool:
    return path == Path("/tmp") or Path("/tmp") in path.parents


def sandbox_command(cmd: list[str], *, bwrap: str = "bwrap", writable: list[Path] = (),
                    readable: list[Path] = (), hidden: list[Path] = (),
                    private: list[Path] = (), cwd: Path | None = None) -> list[str]:
    """``bwrap ... -- cmd``: the sandbox of the module docstring.

    Args:
        cmd: the command to run inside.
        writable: folders bound read-write (the candidate's output folder); must exist.
        readable: folders bound back read-only over the private ``/tmp`` (those outside
            ``/tmp`` are visible read-only anyway); missing ones are skipped. When ``/tmp``
            itself is one of them (``cd /tmp && dflash-audit compare``), ``/tmp`` stays
            read-only as it is, and ``$TMPDIR`` is the sandbox's private ``/dev/shm``.
        hidden: folders covered by an empty tmpfs (the report key's folder); missing ones
            are skipped.
        private: folders covered by an empty tmpfs (every audit's work root): after the
            ``readable`` folders that hold them are bound (a candidate's folder or working
            directory that is ``$TMPDIR``, or the root itself, never binds a root back), before
            those inside them and ``writable`` (this candidate's cases and output folder);
            missing ones are skipped.
        cwd: working directory inside (default ``/``).
    """
    readable = list(dict.fromkeys(Path(p).resolve() for p in
                                  [*readable, *interpreter_folders(cmd[0] if cmd else "")]))
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    tmp_visible = Path("/tmp") in readable
    if tmp_visible:
        # the working directory (or the candidate's folder, a PYTHONPATH entry) is /tmp
        # itself: it stays visible, read-only, like the rest; the private scratch space is
        # the sandbox's own /dev/shm
        args += ["--setenv", "TMPDIR", "/dev/shm"]
    else:
        args += ["--tmpfs", "/tmp"]
    for pattern in GPU_DEVICES:
        for dev in sorted(glob.glob(pattern)):
            args += ["--dev-bind-try", dev, dev]
    covered = list(dict.fromkeys(Path(p).resolve() for p in private if Path(p).is_dir()))

    def inside_covered(path: Path) -> bool:
        return any(c in path.parents for c in covered)

    # readable folders first, the covers after them: a readable folder that holds a work root
    # (the candidate's folder or the working directory is $TMPDIR, or the root itself) must
    # not bind the host's root back over its cover
    for path in readable:
        if _under_tmp(path) and not tmp_visible and not inside_covered(path) and path.exists():
            args += ["--ro-bind", str(path), str(path)]
    for path in covered:
        args += ["--tmpfs", str(path)]
    for path in readable:  # this candidate's own cases inside a covered root
        if inside_covered(path) and path.exists():
            args += ["--ro-bind", str(path), str(path)]
    for path in dict.fromkeys(Path(p).resolve() for p in writable):
        args += ["--bind", str(path), str(path)]
    for path in dict.fromkeys(Path(p).resolve() for p in hidden):
        if path.is_dir():
            args += ["--tmpfs", str(path)]
    args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent",
             "--new-session", "--chdir", str(Path(cwd).resolve() if cwd else "/"), "--", *cmd]
    return args


def links_in(folder: Path) -> list[str]:
    """Entries of ``folder`` (recursively) that are symlinks or not regular files / folders:
    what a candidate may plant to make the tool read or write elsewhere."""
    out = []
    for path in sorted(Path(folder).rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            out.append(path.relative_to(folder).as_posix())
    return out


def sandboxed(cmd: list[str], spec: str | None, cases_dir: Path, out_dir: Path,
              env: dict[str, str]) -> list[str]:
    """``cmd`` inside the candidate's sandbox (:mod:`.sandbox`) when it can start here, else
    ``cmd`` itself: read-only everything, ``out_dir`` writable, ``cases_dir`` (its private copy
    of the cases), the folder of a ``file.py`` candidate, the working directory and the
    ``PYTHONPATH`` entries readable, the report key's folder and the cached reference
    outputs (:func:`.reference_records.record_dirs`) hidden."""
    from dflash_audit.audit.sides.reference_records import record_dirs
    from dflash_audit.report.fingerprint import key_dirs

    status = sandbox_status()
    if not status.available:
        return cmd
    target = (spec or "").rpartition(":")[0]
    readable = [Path(cases_dir), Path.cwd(), *(Path(p) for p in
                                               env.get("PYTHONPATH", "").split(os.pathsep) if p),
                Path(cmd[0]).parent.parent]  # the interpreter's environment (--candidate-python)
    if target.endswith(".py"):
        readable.append(Path(target).resolve().parent)
    for derive in Path(cases_dir).glob("*/derive.json"):  # the verifier a case derives from
        try:
            readable.append(Path(json.loads(derive.read_text())["verifier_dir"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return sandbox_command(cmd, bwrap=status.bwrap, writable=[Path(out_dir)], readable=readable,
                           hidden=[*key_dirs(), *record_dirs()], private=[work_root(), *known_work_roots()],
                           cwd=Path.cwd())
