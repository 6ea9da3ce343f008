"""The reference's import check of a compare: a small reference process, in the background
while the candidate loads and the cases are built, that proves the reference imports from its
resolved tree (:func:`dflash_audit.reference_source.check_reference_importable`); a passed
check is recorded in the cache and not repeated. The record lists the files the reference's
processes import (the check's, then its runs'), which the audit verifies
(:mod:`.install_guard`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError


def import_ok_marker(identity: Any, cache_dir: Path | None) -> Path:
    """Marker file that records a passed import check for this reference tree's content (the
    sha256 of each of its files but bytecode, wherever the cache keeps it: not its ``short_id``,
    which for a path ref is its path and newest mtime, unchanged by a rename or an edit that
    keeps the mtime), by this check (the probe's, its file list's and the adapter's sources: a
    newer check asks more) under this interpreter and the site-packages the reference imports from
    (their mtimes change when packages are installed or removed, which invalidates the
    marker). In an audit whose candidate fails every case the reference is not run, and this
    record is all that shows it imports. It holds ``{"files": [...]}``: what the reference's
    processes import (:meth:`ImportCheck.remember`)."""
    import hashlib
    import os

    from dflash_audit.atomic import file_sha256
    from dflash_audit.audit.sides.integrity import reference_tree_digest
    from dflash_audit.data.builtin_verifier import cache_dir as user_cache_dir
    from dflash_audit.reference_source import import_probe, imported_files
    from dflash_audit.reference_source.identity import reference_dir
    from dflash_audit.reference_source.runner import site_dirs

    tree = {k.partition("/")[2]: v
            for k, v in reference_tree_digest(identity, skip_pycache=True).items()}
    check = [Path(import_probe.__file__), Path(imported_files.__file__),
             *sorted(reference_dir().glob("*.py"))]
    state = {"tree": tree, "check": {p.name: file_sha256(p) for p in check},
             "python": sys.executable, "version": sys.version,
             "site": {p: os.stat(p).st_mtime_ns for p in sorted(site_dirs())}}
    key = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir or user_cache_dir()) / "compare" / "import-ok" / key


class Background:
    """``fn(*args)`` in a daemon thread (its work is a subprocess, so it overlaps with the
    in-process steps; a daemon thread never delays the exit of a failed audit)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "dflash-audit"):
        import threading

        self._result: Any = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self._error = exc

        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def result(self) -> Any:
        """Wait for ``fn``; return its value or raise its exception."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def _listed_files(marker: Path) -> list[str]:
    """The files a marker lists (``{"files": [...]}``); [] for an older, empty one."""
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return []
    files = data.get("files") if isinstance(data, dict) else None
    return [str(f) for f in files] if isinstance(files, list) else []


class ImportCheck:
    """``check_reference_importable`` in the background; :meth:`wait` is called before
    expensive work. A check that passed before for the same tree content, interpreter and
    site-packages (:func:`import_ok_marker`) is not repeated. ``files``: the files the
    reference's processes import, as far as known (the marker's list, then the check's)."""

    def __init__(self, identity: Any, marker: Path | None = None):
        from dflash_audit.reference_source import check_reference_importable

        self._marker = marker
        self.cached = marker is not None and marker.is_file()
        self.files: list[str] = _listed_files(marker) if self.cached and marker else []
        self._job = None if self.cached else Background(
            check_reference_importable, identity, None, name="dflash-audit-import-check")

    def wait(self) -> None:
        """Block until the check is done.

        Raises:
            CompareSetupError: missing import-time dependencies (with the install command),
                speculators imported from elsewhere, or an API this adapter does not know.
        """
        from dflash_audit.reference_source import ReferenceSourceError

        if self._job is None:
            return
        try:
            files = self._job.result()
        except ReferenceSourceError as exc:
            raise CompareSetupError(str(exc)) from None
        self._job = None
        self.remember(files or [])

    def remember(self, files: list[str]) -> None:
        """Add ``files`` (what a reference process imported) to :attr:`files` and to the
        marker, which records the passed check; an unwritable cache is left as it is."""
        self.files = sorted(set(self.files) | set(files))
        if self._marker is None:
            return
        try:
            self._marker.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._marker.with_name(f".{self._marker.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"files": self.files}))
            os.replace(tmp, self._marker)
        except OSError:
            pass
