"""The Python installation the verdict runs on, verified: every file that the audit's own
process and the reference's processes run code from (standard-library and site-packages
sources, extension modules and the shared libraries they map, the interpreter;
:func:`~dflash_audit.reference_source.imported_files.imported_files`) and the folders they are
found in (a new ``.pth``, a package that shadows a module), against a baseline taken before any
candidate code runs; a change is recorded in the tool cache, so every later audit refuses too
until the files are restored. Bytecode in those folders that is new or changed is deleted.

The reference's tree, dflash-audit's own files and the reference's bytecode prefix are
covered (and repaired) by :mod:`.integrity` and left out here.

- :class:`InstallBaseline`: a stat signature (device, inode, size, mtime, ctime: a write or a
  replacement changes the ctime, which no user can set back) of each file, what every check
  compares; the sha256 of each file up to :data:`HASH_LIMIT` (in the background: what a repair
  must restore); the entries of each folder. A file first seen after the baseline began (a
  module imported later, a file the reference listed) must be older than the baseline. The
  bytecode in those folders' ``__pycache__`` is not compared but swept: what is new or
  changed is deleted (:meth:`InstallBaseline.sweep_bytecode`).
- the record (``<cache>/integrity/tampered.json``): :func:`record_tampering`,
  :func:`outstanding_tampering`; a recorded file counts as repaired when its sha256 is the
  good one again (a larger file: when it was replaced since), a folder when its entries are
  the good ones again, an added file when it is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

from dflash_audit.atomic import file_sha256
from dflash_audit.reference_source.imported_files import imported_files

#: Files up to this size get a sha256 (~6,000 files, ~200 MB for compare's and the
#: reference's processes: 0.6 s warm, ~5 s from disk, hence in the background); larger ones
#: (``libtorch_cpu.so``, ~430 MB) only their stat signature.
HASH_LIMIT = 4 << 20
#: The good value of a file that was not there before the audit.
ABSENT = "absent"
PYCACHE = "__pycache__"
RECORD = ("integrity", "tampered.json")


def _stat_signature(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _signature(path: str) -> str | None:
    try:
        return _stat_signature(os.stat(path))
    except OSError:
        return None


def _names(folder: str) -> frozenset[str] | None:
    try:
        return frozenset(n for n in os.listdir(folder) if n != PYCACHE)
    except OSError:
        return None


def _bytecode(folder: str) -> dict[str, str]:
    """``{path: stat signature}`` of the files of ``folder/__pycache__``."""
    out = {}
    try:
        entries = list(os.scandir(os.path.join(folder, PYCACHE)))
    except OSError:
        return out
    for entry in entries:
        try:
            out[entry.path] = _stat_signature(entry.stat(follow_symlinks=False))
        except OSError:
            continue
    return out


def _listing_digest(names: Iterable[str] | None) -> str | None:
    if names is None:
        return None
    return hashlib.sha256("\0".join(sorted(names)).encode()).hexdigest()


class InstallBaseline:
    """Signatures of the files and folders of the installation, taken from ``since_ns`` (the
    wall clock when it was made, before any candidate code runs). Paths under ``excluded``
    (covered elsewhere) are left out."""

    def __init__(self, excluded: Iterable[Path | str] = ()) -> None:
        import queue
        import threading

        self.since_ns = time.time_ns()
        self.excluded = tuple(os.path.join(str(p), "") for p in excluded)
        self.files: dict[str, str] = {}
        self.sha: dict[str, str] = {}
        self.folders: dict[str, frozenset[str]] = {}
        self.bytecode: dict[str, str] = {}
        self._to_hash: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._hash, name="dflash-audit-install-digests",
                         daemon=True).start()

    def _covered(self, path: str) -> bool:
        return path.startswith(self.excluded)

    def _hash(self) -> None:
        """Hash the queued files in the background (reading ~100 MB of sources the imports did
        not read costs seconds when they are not in the page cache). A digest is kept only
        when the file's signature after reading is still the baseline's: then no write
        happened since the baseline began, and it is the good content."""
        while True:
            path = self._to_hash.get()
            try:
                digest = file_sha256(path)
            except OSError:
                continue
            if _signature(path) == self.files.get(path):
                self.sha[path] = digest

    def add(self, paths: Iterable[str]) -> list[str]:
        """Add the files of ``paths`` not in the baseline yet (and their folders); returns the
        ones written since the baseline began (mtime or ctime not older than it), which are
        not added. Files that do not exist are skipped."""
        changed = []
        for path in paths:
            if path in self.files or self._covered(path):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if max(st.st_mtime_ns, st.st_ctime_ns) >= self.since_ns:
                changed.append(path)
                continue
            self.files[path] = _stat_signature(st)
            if st.st_size <= HASH_LIMIT:
                self._to_hash.put(path)
            self.add_folders([os.path.dirname(path)])
        return changed

    def add_folders(self, folders: Iterable[str]) -> None:
        """Record the entries (``__pycache__`` aside) of ``folders`` not recorded yet, and the
        signatures of the bytecode in their ``__pycache__`` (:meth:`sweep_bytecode`)."""
        for folder in folders:
            if (folder in self.folders or self._covered(os.path.join(folder, ""))
                    or os.path.basename(folder) == PYCACHE):
                continue
            names = _names(folder)
            if names is not None:
                self.folders[folder] = names
                for path, sig in _bytecode(folder).items():
                    if int(sig.rsplit(":", 1)[1]) < self.since_ns:  # else: swept
                        self.bytecode[path] = sig

    def sweep_bytecode(self) -> list[str]:
        """Delete the files of the recorded folders' ``__pycache__`` that are new or changed
        since the baseline (returned): Python compiles them again from the sources, which the
        baseline verifies. Never a refusal: an unsandboxed candidate writes bytecode of
        modules that had none (an install without compiled bytecode, as uv makes), and a
        planted ``.pyc`` must be gone before this process or a later audit imports it (the
        reference's processes read bytecode only from the tool's own prefix)."""
        swept = []
        for folder in list(self.folders):
            for path, sig in _bytecode(folder).items():
                if self.bytecode.get(path) != sig:
                    try:
                        os.unlink(path)
                    except OSError:
                        continue
                    swept.append(path)
        return swept

    def changes(self, current: Iterable[str] = ()) -> list[str]:
        """Files of the baseline whose signature differs now (or that are gone), folders whose
        entries differ, and files of ``current`` first seen now that were written since the
        baseline began (the others are added). Sorted."""
        out = [p for p, sig in self.files.items() if _signature(p) != sig]
        out += [f for f, names in self.folders.items() if _names(f) != names]
        return sorted(set(out + self.add(current)))

    def good(self, path: str) -> str:
        """What ``path`` held when the baseline was taken: ``sha256:HEX`` (files up to
        :data:`HASH_LIMIT`, once hashed), ``dir:HEX`` (a folder's entries), ``stat:SIGNATURE``
        (a larger file, one not hashed before it changed, one first seen after it had changed)
        or :data:`ABSENT`."""
        if path in self.folders:
            return f"dir:{_listing_digest(self.folders[path])}"
        if path in self.sha:
            return f"sha256:{self.sha[path]}"
        if path in self.files or os.path.exists(path):
            return f"stat:{self.files.get(path, '')}"
        return ABSENT

    def describe(self, path: str) -> str:
        """``path`` as a message names it: a folder with the entries added or removed."""
        if path not in self.folders:
            return path
        now = _names(path) or frozenset()
        added = [f"+{n}" for n in sorted(now - self.folders[path])]
        removed = [f"-{n}" for n in sorted(self.folders[path] - now)]
        return f"{path}/ ({' '.join((added + removed)[:3])})"


def _state(path: str, good: str) -> str:
    """What ``path`` holds now, in the form of ``good`` (:meth:`InstallBaseline.good`)."""
    if good.startswith("dir:"):
        return f"dir:{_listing_digest(_names(path))}"
    if good.startswith("sha256:"):
        try:
            return f"sha256:{file_sha256(path)}"
        except OSError:
            return ABSENT
    return f"stat:{_signature(path)}" if os.path.exists(path) else ABSENT


def _repaired(path: str, entry: dict) -> bool:
    good = str(entry.get("good", ""))
    if good.startswith("stat:"):  # no digest of the good file: replaced since it was seen
        return os.path.exists(path) and _state(path, good) != entry.get("seen")
    return _state(path, good) == good


def record_path() -> Path:
    """The tamper record of this tool cache (``$DFLASH_AUDIT_CACHE``)."""
    from dflash_audit.data.builtin_verifier import cache_dir

    return cache_dir().joinpath(*RECORD)


def _update_record(change: Callable[[dict[str, dict]], None]) -> None:
    """Read the record, apply ``change`` to its ``files`` and write it back (atomically,
    under a lock: concurrent audits share the cache); an empty record is removed."""
    import fcntl

    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        files = _read_record(path)
        before = json.dumps(files, sort_keys=True)
        change(files)
        if json.dumps(files, sort_keys=True) == before:
            return
        if not files:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
        os.replace(tmp, path)


def _read_record(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # damaged: refuse until it is looked at
        return {str(path): {"good": ABSENT, "seen": "unreadable"}}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {str(path): {"good": ABSENT, "seen": "unreadable"}}
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


def record_tampering(good: dict[str, str]) -> None:
    """Record ``{path: good value}`` (:meth:`InstallBaseline.good`) as changed by a
    candidate, with what each holds now: every later audit refuses until it is repaired.

    Raises:
        OSError: the record cannot be written (the cache is not writable).
    """
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def change(files: dict[str, dict]) -> None:
        for path, value in good.items():
            if path not in files:  # an earlier record keeps its good value
                files[path] = {"good": value, "seen": _state(path, value), "at": at}

    _update_record(change)


def outstanding_tampering(relevant: Callable[[str], bool]) -> list[str]:
    """Recorded paths, among those ``relevant`` to this audit, that are not repaired yet
    (sorted); the repaired ones are dropped from the record. [] when it cannot be read."""
    found: list[str] = []

    def change(files: dict[str, dict]) -> None:
        for path in sorted(files):
            if path == str(record_path()):
                found.append(path)
            elif relevant(path):
                if _repaired(path, files[path]):
                    del files[path]
                else:
                    found.append(path)

    try:
        _update_record(change)
    except OSError:
        return found
    return found


def installation_roots() -> list[str]:
    """Where this interpreter's code lives: ``sys.prefix``, ``sys.base_prefix`` and every
    site-packages folder (:func:`dflash_audit.reference_source.runner.site_dirs`)."""
    from dflash_audit.reference_source.runner import site_dirs

    return list(dict.fromkeys([sys.prefix, sys.base_prefix, *site_dirs()]))


def repair_hint(paths: list[str], tool: Iterable[Path] = ()) -> str:
    """What restores ``paths``: reinstalling dflash-audit (under ``tool``), ``pip install
    --force-reinstall`` of the distributions that own site-packages files, removing what was
    added to a folder, or reinstalling Python."""
    from importlib.metadata import packages_distributions

    from dflash_audit.reference_source.runner import site_dirs

    tool_roots = tuple(os.path.join(str(p), "") for p in tool)
    sites = [os.path.join(d, "") for d in site_dirs()]
    owners: dict[str, list[str]] = {}
    hints, dists, other = [], [], False
    for path in paths:
        if path.startswith(tool_roots):
            hints.append("reinstall dflash-audit")
            continue
        if path == str(record_path()):
            hints.append(f"delete the unreadable record {path} once the files are checked")
            continue
        if os.path.isdir(path) or not os.path.exists(path):
            hints.append(f"remove what was added to {path}" if os.path.isdir(path)
                         else f"restore {path}")
            continue
        site = next((s for s in sites if path.startswith(s)), None)
        if site is None:
            other = True
            continue
        top = path[len(site):].split(os.sep)[0].split(".")[0]
        if not owners:
            owners = packages_distributions()
        dists += owners.get(top, [top])
    if dists:
        hints.append(f"{sys.executable} -m pip install --force-reinstall --no-deps "
                     + " ".join(sorted(set(dists))))
    if other:
        hints.append("reinstall Python (or the system package) that holds the others")
    return "; ".join(dict.fromkeys(hints))


class InstallGuard:
    """One audit's :class:`InstallBaseline`: this process's files and folders, the
    site-packages folders and the reference's files known so far (``reference_files``: its
    import check's list), taken before any candidate code runs; ``seconds`` is what it cost."""

    def __init__(self, excluded: Iterable[Path | str], reference_files: Iterable[str] = ()
                 ) -> None:
        from dflash_audit.reference_source.runner import site_dirs

        start = time.perf_counter()
        self.baseline = InstallBaseline(excluded)
        self.baseline.add_folders(site_dirs())
        self.pending = self.baseline.add(imported_files())
        self.pending += self.baseline.add(reference_files)
        self.seconds = time.perf_counter() - start
        #: Set once a change was reported (and recorded): not reported twice.
        self.reported = False

    def add_reference(self, files: Iterable[str]) -> None:
        """Add files the reference imports (its import check's list, when it arrives after the
        baseline); those written since the baseline began are changes."""
        self.pending += self.baseline.add(files)

    def changes(self, reference_files: Iterable[str] = ()) -> list[str]:
        """:meth:`InstallBaseline.changes` over this process's files now and
        ``reference_files`` (the list a reference run wrote), after
        :meth:`InstallBaseline.sweep_bytecode`."""
        self.baseline.sweep_bytecode()
        current = [*imported_files(), *reference_files]
        return sorted(set(self.baseline.changes(current) + self.pending))


def refuse_recorded_tampering(tool: Iterable[Path]) -> None:
    """Refuse an installation that an earlier audit recorded as changed by its candidate and
    that is not restored yet (:func:`outstanding_tampering`, over this process's files, the
    interpreter's folders and dflash-audit's own files, ``tool``).

    Raises:
        CompareSetupError: naming the files and what restores them.
    """
    from dflash_audit.audit.setup_error import CompareSetupError

    tool = [Path(p) for p in tool]
    roots = tuple(os.path.join(str(r), "") for r in [*installation_roots(), *tool])
    mine = set(imported_files())
    found = outstanding_tampering(
        lambda p: p in mine or p.startswith(roots) or os.path.join(p, "") in roots)
    if not found:
        return
    raise CompareSetupError(
        f"files this installation runs the verdict with were changed by an earlier audit's "
        f"candidate and are not restored ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}"
        f"), so no verdict can be given here: {repair_hint(found, tool)}, then rerun (the "
        f"record {record_path()} clears itself once they are back). Run candidates in the "
        "sandbox (bubblewrap).")
