"""The Python installation the verdict runs on, verified: every file that the audit's own
process and the reference's processes run code from (standard-library and site-packages
sources, extension modules and the shared libraries they map, the interpreter;
:func:`~dflash_audit.reference_source.imported_files.imported_files`) and the folders they are
found in (a new ``.pth``, a package that shadows a module) and what Python's start-up runs
(:func:`startup_paths`: an edited ``.pth``, a created ``python311.zip`` or user site,
``pyvenv.cfg``), against a baseline taken before any candidate code runs; a change is
recorded in the tool cache, so every later audit refuses too until the files are restored
(:mod:`.tamper_record`). Bytecode in those folders that is new or changed is deleted.

The reference's tree, dflash-audit's own files and the reference's bytecode prefix are
covered (and repaired) by :mod:`.integrity` and left out here.

- :class:`InstallBaseline`: a stat signature (device, inode, size, mtime, ctime: a write or a
  replacement changes the ctime, which no user can set back) of each file, what every check
  compares; the sha256 of each file up to :data:`HASH_LIMIT` (in the background: what a repair
  must restore); the entries of each folder. A file first seen after the baseline began (a
  module imported later, a file the reference listed) must be older than the baseline. The
  bytecode in those folders' ``__pycache__`` is not compared but swept: what is new or
  changed is deleted (:meth:`InstallBaseline.sweep_bytecode`).
- :class:`InstallGuard`: one audit's baseline and its checks.

The record of changes that later audits refuse on: :mod:`.tamper_record`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
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


def _stat_signature(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def signature(path: str) -> str | None:
    """``"device:inode:size:mtime_ns:ctime_ns"`` of ``path`` (followed), None when absent."""
    try:
        return _stat_signature(os.stat(path))
    except OSError:
        return None


def folder_names(folder: str) -> frozenset[str] | None:
    """The entries of ``folder`` but ``__pycache__``; None when it is no readable folder."""
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


def importable(folder: str, names: frozenset[str] | None) -> frozenset[str] | None:
    """The ``names`` of ``folder`` an import could find: module files (any import suffix),
    ``.pth`` files and regular packages (a folder with ``__init__.py``); other entries
    (``.hypothesis``, ``reports``) are left out."""
    from importlib.machinery import all_suffixes

    if names is None:
        return None
    suffixes = (*all_suffixes(), ".pth")
    return frozenset(n for n in names if n.endswith(suffixes)
                     or os.path.isfile(os.path.join(folder, n, "__init__.py")))


def listing_digest(names: Iterable[str] | None) -> str | None:
    """sha256 of the sorted ``names`` (None stays None)."""
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
        #: Paths that did not exist (a ``sys.path`` entry such as ``python311.zip``, the user
        #: site): creating one is a change.
        self.absent: set[str] = set()
        #: Folders watched only for what an import could find in them (:func:`importable`):
        #: ``sys.path`` entries no module was imported from yet (a checkout on PYTHONPATH).
        self.importable: set[str] = set()
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
            if signature(path) == self.files.get(path):
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
            names = folder_names(folder)
            if names is not None:
                self.folders[folder] = names
                for path, sig in _bytecode(folder).items():
                    if int(sig.rsplit(":", 1)[1]) < self.since_ns:  # else: swept
                        self.bytecode[path] = sig

    def watch(self, paths: Iterable[str]) -> list[str]:
        """Add ``paths`` whatever they are: a folder's entries (:meth:`add_folders`), a file
        (:meth:`add`; returned when written since the baseline began), or -- when absent --
        the fact that it is absent."""
        changed = []
        for path in paths:
            if self._covered(os.path.join(path, "")):
                continue
            if os.path.isdir(path):
                if path not in self.folders:  # only what an import could find there
                    self.importable.add(path)
                self.add_folders([path])
            elif os.path.exists(path):
                changed += self.add([path])
            else:
                self.absent.add(path)
        return changed

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
        out = [p for p, sig in self.files.items() if signature(p) != sig]
        out += [f for f, names in self.folders.items()
                if (importable(f, folder_names(f)) if f in self.importable
                    else folder_names(f)) != (importable(f, names) if f in self.importable
                                              else names)]
        out += [p for p in self.absent if os.path.lexists(p)]
        return sorted(set(out + self.add(current)))

    def good(self, path: str) -> str:
        """What ``path`` held when the baseline was taken: ``sha256:HEX`` (files up to
        :data:`HASH_LIMIT`, once hashed), ``dir:HEX`` (a folder's entries), ``stat:SIGNATURE``
        (a larger file, one not hashed before it changed, one first seen after it had changed)
        or :data:`ABSENT`."""
        if path in self.absent:
            return ABSENT
        if path in self.folders:
            return f"dir:{listing_digest(self.folders[path])}"
        if path in self.sha:
            return f"sha256:{self.sha[path]}"
        if path in self.files or os.path.exists(path):
            return f"stat:{self.files.get(path, '')}"
        return ABSENT

    def describe(self, path: str) -> str:
        """``path`` as a message names it: a folder with the entries added or removed."""
        if path not in self.folders:
            return path
        now = folder_names(path) or frozenset()
        added = [f"+{n}" for n in sorted(now - self.folders[path])]
        removed = [f"-{n}" for n in sorted(self.folders[path] - now)]
        return f"{path}/ ({' '.join((added + removed)[:3])})"


def startup_paths() -> list[str]:
    """What Python's start-up runs code from without it being a module's file, in this
    process and the next audit's: every ``sys.path`` entry (a folder's new module shadows a
    later one; an absent ``pythonXY.zip`` created with an ``encodings`` package runs first in
    every process, the reference's ``-I -S`` ones included) but the current folder (the
    user's own, where an honest candidate may write), each site folder's ``.pth`` files
    (their ``import`` lines run at every start), the user site when it is enabled (absent:
    a ``usercustomize`` or ``.pth`` created there runs at the next start) and
    ``<sys.prefix>/pyvenv.cfg`` (it chooses the base interpreter and its site-packages)."""
    import site
    import sys

    from dflash_audit.reference_source.runner import site_dirs

    here = {"", os.getcwd()}
    sites = list(site_dirs())
    if site.ENABLE_USER_SITE:
        sites.append(site.getusersitepackages())
    paths = [p for p in sys.path if p not in here and os.path.isabs(p)] + sites
    for folder in sites:
        try:
            paths += sorted(os.path.join(folder, n) for n in os.listdir(folder)
                            if n.endswith(".pth"))
        except OSError:
            continue
    paths.append(os.path.join(sys.prefix, "pyvenv.cfg"))
    return list(dict.fromkeys(paths))


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
        self.pending += self.baseline.watch(startup_paths())
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
