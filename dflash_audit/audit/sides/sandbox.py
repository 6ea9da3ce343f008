"""The candidate's sandbox: the bubblewrap (``bwrap``) command line around its process.

The candidate is untrusted code (DESIGN.md section 9). Inside the sandbox it has:

- **no capability**, as root too (``--cap-drop ALL``; bubblewrap as root otherwise keeps
  every one), and no new privileges on exec, so it **cannot change its mounts**: no remount of
  ``/`` read-write, no unmount of ``/proc``, ``/tmp`` or a cover (also not from a user
  namespace of its own: the mounts it inherits are locked);
- the whole file system **read-only** (``--ro-bind / /``): it cannot edit the cached
  reference tree (``__pycache__`` included), dflash-audit's installed files, site-packages,
  the report folder or another process's files;
- a private, empty ``/tmp`` (``--tmpfs /tmp``) and ``/dev`` (``--dev``, its own ``/dev/shm``),
  with only the folders it needs bound back: read-only its copy of the cases, the folder of
  a ``file.py`` candidate, the working directory and ``PYTHONPATH`` entries under ``/tmp``;
  read-write its own output folder;
- nothing of any report key (every folder of
  :func:`dflash_audit.report.fingerprint.key_dirs`, whatever cache or ``$HOME`` it is in, and
  every other path a bind mount shows it at, is covered by an empty tmpfs) nor of the cached
  reference outputs (:mod:`.reference_records`, covered too), nor of any audit's work folder
  (:func:`work_root`, where every compare keeps
  its cases and both sides' outputs, is covered by an empty tmpfs, and only this candidate's
  own cases and output folder are bound back; every root an audit of this user made, whatever
  its ``$TMPDIR``, is covered too: :func:`known_work_roots`): not even when ``/tmp`` itself is
  readable, ``$TMPDIR`` points outside it or is the candidate's folder, and not for folders
  another audit creates later;
- its own PID namespace (``--unshare-pid``) that ends with it: the kernel kills every process
  of the namespace when its first process exits, so a daemon that ``setsid``s or
  double-forks never outlives the candidate; ``--die-with-parent`` ends it with compare;
- no network (``--unshare-net``: only a loopback), its own IPC and a new session.

:func:`sandbox_status` (once per process) takes only a trusted ``bwrap``
(:func:`.sandbox_proof.trusted_bwrap`: a fixed system path owned by root, never the first on
PATH) and PROVES the above from inside: :mod:`.sandbox_probe` runs under exactly the flags a
candidate gets (:func:`candidate_sandbox_command`) and tries each route. Three outcomes:
proven (the candidate runs sandboxed; the report records each property and its evidence);
no trusted ``bwrap`` or it cannot create its namespaces here (the candidate runs unsandboxed
and the report says so; ``--require-sandbox`` refuses with exit 2); a sandbox that starts but
fails its proof (a setup error, always exit 2: it would be a lie about isolation).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.audit.sides.reference_records import record_dirs
from dflash_audit.data.builtin_verifier import cache_dir
from dflash_audit.folder_registry import folders_with_aliases, record_folder, recorded_folders
from dflash_audit.report.fingerprint import key_dirs

#: ``DFLASH_AUDIT_SANDBOX=off`` runs the candidate without a sandbox (tests of the detection
#: that remains without one; the report says so, and ``--require-sandbox`` refuses).
SANDBOX_ENV = "DFLASH_AUDIT_SANDBOX"
#: Devices a CUDA candidate needs (bound when present).
GPU_DEVICES = ("/dev/nvidia*", "/dev/dri")
UNAVAILABLE = "candidate ran without a sandbox"
#: The isolation flags of every sandbox: no capability (as root bubblewrap keeps them all
#: otherwise: the candidate could remount / read-write and unmount its covers), own PID
#: namespace (dies with it), no network, own IPC, ended with compare, a new session.
ISOLATION = ("--cap-drop", "ALL", "--unshare-pid", "--unshare-net", "--unshare-ipc",
             "--die-with-parent", "--new-session")
#: States of :class:`SandboxStatus`.
PROVEN, ABSENT, UNPROVEN = "proven", "unavailable", "unproven"


class SandboxError(CompareSetupError):
    """The sandbox started but did not prove its isolation: no candidate runs (exit 2)."""


@dataclass(frozen=True)
class SandboxStatus:
    """What :func:`sandbox_status` found: ``state`` (:data:`PROVEN`, :data:`ABSENT`: no
    trusted ``bwrap`` or it cannot start here, :data:`UNPROVEN`: it starts but fails its
    proof), ``bwrap`` (its path) and ``version``, ``reason`` (why not proven) and ``proof``
    (``{property: {"ok", "evidence"}}``, :func:`.sandbox_proof.judge`)."""

    state: str
    bwrap: str | None = None
    reason: str = ""
    version: str = ""
    proof: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Whether the candidate runs sandboxed (the sandbox proved its isolation)."""
        return self.state == PROVEN

    def to_dict(self) -> dict[str, object]:
        """The report's ``candidate.sandbox`` entry (``proof``: as :attr:`proof`)."""
        return {"sandboxed": self.available, "tool": "bubblewrap" if self.available else None,
                "bwrap": self.bwrap, "version": self.version, "proof": self.proof,
                "note": "" if self.available else f"{UNAVAILABLE}: {self.reason}"}


@functools.lru_cache(maxsize=1)
def sandbox_status() -> SandboxStatus:
    """Find the trusted ``bwrap`` and prove the sandbox once per process (module docstring).

    Returns:
        :class:`SandboxStatus`: :data:`ABSENT` when ``$DFLASH_AUDIT_SANDBOX`` is ``off``, when
        no trusted ``bwrap`` is installed (``apt-get install -y bubblewrap``;
        ``scripts/setup.sh`` does it) or when it cannot create its namespaces here (the reason
        is its stderr); :data:`UNPROVEN` when the probe ran but a property does not hold (the
        reason names each with its evidence); else :data:`PROVEN`.
    """
    from dflash_audit.audit.sides import sandbox_proof as sp

    if os.environ.get(SANDBOX_ENV, "").lower() in ("off", "0", "no", "false"):
        return SandboxStatus(ABSENT, reason=f"${SANDBOX_ENV}=off")
    try:
        bwrap = str(sp.trusted_bwrap())
    except sp.UntrustedBwrap as exc:
        return SandboxStatus(ABSENT, reason=str(exc))
    version = sp.bwrap_version(Path(bwrap))
    found = {"bwrap": bwrap, "version": version}
    try:
        return _prove(bwrap, found)
    except CompareSetupError as exc:  # no usable work root: compare refuses on it too
        return SandboxStatus(ABSENT, reason=str(exc), **found)


def _prove(bwrap: str, found: dict[str, str]) -> SandboxStatus:
    """The status of the trusted ``bwrap``: can it start, and what its probe proves.

    Raises:
        CompareSetupError: the work root cannot be used (:func:`work_root`).
    """
    from dflash_audit.audit.sides import sandbox_proof as sp

    with _proof_folder() as scratch:
        try:  # the namespaces themselves first: a machine without them has no sandbox
            proc = subprocess.run(candidate_sandbox_command(["true"], None, scratch, scratch,
                                                            {}, bwrap), capture_output=True,
                                  text=True, timeout=sp.PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return SandboxStatus(ABSENT, reason=f"bwrap cannot start ({exc})", **found)
        if proc.returncode != 0:
            tail = " ".join(proc.stderr.split())[-300:]
            return SandboxStatus(ABSENT, reason=f"bwrap cannot create its namespaces here "
                                                f"({tail})", **found)
        hidden = folders_with_aliases(key_dirs())  # and every path a bind mount shows them at
        probe = sp.probe_command(_read_only_probes(), hidden,
                                 ["/proc", "/tmp", *map(str, hidden)])
        try:
            facts = sp.run_probe(candidate_sandbox_command(probe, None, scratch, scratch, {},
                                                           bwrap))
        except RuntimeError as exc:
            return SandboxStatus(UNPROVEN, reason=f"its proof did not run ({exc})", **found)
    proof = sp.judge(facts, os.getpid(), os.readlink("/proc/self/ns/pid"))
    failed = sp.failed(proof)
    if failed:
        return SandboxStatus(UNPROVEN, reason="; ".join(failed), proof=proof, **found)
    return SandboxStatus(PROVEN, proof=proof, **found)


def _read_only_probes() -> list[Path]:
    """Folders where the proof tries to create a file (each must refuse): ``/``, ``/etc``,
    the working directory, this interpreter's site-packages and dflash-audit's own folder."""
    import sysconfig

    import dflash_audit

    folders = [Path("/"), Path("/etc"), Path.cwd(), Path(sysconfig.get_paths()["purelib"]),
               Path(dflash_audit.__file__).resolve().parent]
    return [p for p in dict.fromkeys(folders) if p.is_dir()]


@contextlib.contextmanager
def _proof_folder() -> Iterator[Path]:
    """A fresh folder in the work root (where the cases and outputs live), removed after.

    Raises:
        CompareSetupError: the work root cannot be used (:func:`work_root`).
    """
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="dflash-audit-sandbox-proof-", dir=work_root()))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: The name of the work root in a temporary directory (:func:`work_root`).
WORK_ROOT_NAME = "dflash-audit-work"
#: The work root of the default temporary directory: hidden from every candidate, whatever
#: ``$TMPDIR`` its own audit has.
DEFAULT_WORK_ROOT = Path("/tmp") / WORK_ROOT_NAME

#: The registry (:mod:`dflash_audit.folder_registry`) of every work root :func:`work_root`
#: made, whatever the ``$TMPDIR`` or ``$DFLASH_AUDIT_CACHE`` of its audit.
ROOTS_REGISTRY = "work-roots"


def known_work_roots() -> list[Path]:
    """Every audit's work root a candidate must not read: the default one and those of the
    registry :data:`ROOTS_REGISTRY` (audits run with another ``$TMPDIR``)."""
    return list(dict.fromkeys([DEFAULT_WORK_ROOT, *recorded_folders(ROOTS_REGISTRY)]))


def work_root() -> Path:
    """The folder every compare makes its work folder in (``<tempdir>/dflash-audit-work``,
    created here, recorded in :data:`ROOTS_REGISTRY`): one root the sandbox hides as a whole,
    so a candidate never reads another audit's cases or reference outputs.

    Raises:
        CompareSetupError: it is not a folder this user owns and can write (a file, a link,
            another user's folder, chmod 000): no audit keeps its cases there.
    """
    import tempfile

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
    record_folder(ROOTS_REGISTRY, root)
    return root


def interpreter_folders(executable: str) -> list[Path]:
    """What the interpreter ``executable`` runs from, wherever it lives (also under ``/tmp``,
    which the sandbox replaces): its environment (``bin/..``: a venv with its site-packages),
    the folder of the file it links to and that file's prefix; for this interpreter also its
    ``sys.prefix``, ``sys.base_prefix`` and every ``sys.path`` folder (an editable install's
    project). Bound back read-only by :func:`sandbox_command`."""
    if not executable:
        return []
    exe, real = Path(executable), Path(executable).resolve()
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
    args += [*ISOLATION, "--chdir", str(Path(cwd).resolve() if cwd else "/"), "--", *cmd]
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
              env: dict[str, str], hidden: list[Path] = (), readable: list[Path] = ()
              ) -> list[str]:
    """``cmd`` inside the candidate's sandbox (:func:`candidate_sandbox_command`; ``hidden``:
    more folders covered, e.g. the recorded canary; ``readable``: more folders bound, e.g. the
    ``--verifier`` folder) when the sandbox proved itself here, else ``cmd`` itself.

    Raises:
        SandboxError: the sandbox starts but did not prove its isolation (never run then).
    """
    status = sandbox_status()
    if status.state == UNPROVEN:
        raise SandboxError(unproven_message(status))
    return candidate_sandbox_command(cmd, spec, cases_dir, out_dir, env, status.bwrap, hidden,
                                     readable) if status.available else cmd


def unproven_message(status: SandboxStatus) -> str:
    """The one-line setup error of a sandbox that starts but fails its proof."""
    return (f"the candidate's sandbox (bubblewrap {status.version or '?'}, {status.bwrap}) "
            f"starts but does not prove its isolation: {status.reason}. No candidate runs in "
            "it: fix the sandbox (a bubblewrap that supports --cap-drop, from the system's "
            f"package manager), or set {SANDBOX_ENV}=off with --no-require-sandbox to run the "
            f"candidate knowingly unsandboxed (the report then says '{UNAVAILABLE}')")


def candidate_sandbox_command(cmd: list[str], spec: str | None, cases_dir: Path,
                              out_dir: Path, env: dict[str, str], bwrap: str,
                              hidden: list[Path] = (), readable: list[Path] = ()) -> list[str]:
    """``bwrap ... -- cmd``, the candidate's sandbox (:func:`sandbox_command`): ``out_dir``
    writable; ``cases_dir``, a ``.py`` spec's folder, the cwd, ``PYTHONPATH``, the interpreter's
    environment, ``<cache>/verifiers`` and ``readable`` (from the start: a waiting process has
    its cases' sandbox) readable; keys' folders and ``hidden`` hidden; work roots private."""
    def within(path: Path, roots: list[Path]) -> bool:  # the path or a parent is a root
        return not {path.resolve(), *path.resolve().parents}.isdisjoint(roots)

    target = (spec or "").rpartition(":")[0]
    private = [work_root(), *known_work_roots()]
    roots = [Path(p).resolve() for p in private]  # no extra folder in one: another audit's
    verifiers = [p for p in [cache_dir() / "verifiers", *readable]
                 if p.is_dir() and not within(p, roots)]
    readable = [Path(cases_dir), Path.cwd(), *(Path(p) for p in
                                               env.get("PYTHONPATH", "").split(os.pathsep) if p),
                Path(cmd[0]).parent.parent]  # the interpreter's environment (--candidate-python)
    readable += [*verifiers, *([Path(target).resolve().parent] if target.endswith(".py") else [])]
    covered = [*roots, *(p.resolve() for p in verifiers)]  # once per command, not per case
    for derive in Path(cases_dir).glob("*/derive.json"):  # the verifier a case derives from
        try:
            folder = Path(json.loads(derive.read_text())["verifier_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        # one in a work folder (a proxy verifier's config, in the reference's copy of the
        # case) stays covered, the candidate's copy holding its own; bound ones stay as they are
        if not within(folder, covered):
            readable.append(folder)
    return sandbox_command(cmd, bwrap=bwrap, writable=[Path(out_dir)], readable=readable,
                           hidden=folders_with_aliases([*key_dirs(), *record_dirs(), *hidden]),
                           private=private, cwd=Path.cwd())
