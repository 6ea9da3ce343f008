"""The reference's import check of a compare: a small reference process, in the background
while the candidate loads and the cases are built, that proves the reference imports from its
resolved tree (:func:`dflash_audit.reference_source.check_reference_importable`); a passed
check is recorded in the cache and not repeated. The record lists the files the reference's
processes import (the check's, then its runs'), which the audit verifies
(:mod:`.install_guard`). It is a signed record (:mod:`.signed_records`, kind
:data:`KIND`) in a folder the candidate's sandbox hides
(:func:`.reference_records.record_dirs`): one that is not trusted (changed, signed elsewhere,
another tree's) is removed and the check runs again, as with ``--no-reference-cache``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError

#: The kind of an import check's record, and the file that lists what the reference imports.
KIND = "import-check"
IMPORTED_FILE = "imported.json"


def import_ok_marker(identity: Any, cache_dir: Path | None) -> Path:
    """Marker file that records a passed import check for this reference tree's content (the
    sha256 of each of its files but bytecode, wherever the cache keeps it: not its ``short_id``,
    which for a path ref is its path and newest mtime, unchanged by a rename or an edit that
    keeps the mtime), by this check (the probe's, its file list's and the adapter's sources: a
    newer check asks more) under this interpreter and the site-packages the reference imports from
    (their mtimes change when packages are installed or removed, which invalidates the
    marker). In an audit whose candidate fails every case the reference is not run, and this
    record is all that shows it imports. Its :data:`IMPORTED_FILE` holds ``{"files": [...]}``:
    what the reference's processes import (:meth:`ImportCheck.remember`). The folder is
    ``<cache>/import-checks/<key>`` (``cache_dir``: ``<cache_dir>/import-checks/<key>``)."""
    import hashlib
    import os

    from dflash_audit.atomic import file_sha256
    from dflash_audit.audit.sides.integrity import reference_tree_digest
    from dflash_audit.audit.sides.reference_records import IMPORT_CHECKS_DIR, records_root
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
    root = Path(cache_dir) / IMPORT_CHECKS_DIR if cache_dir else records_root(IMPORT_CHECKS_DIR)
    return root / key


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


def _listed_files(data: bytes) -> list[str]:
    """The files a record lists (``{"files": [...]}``)."""
    try:
        body = json.loads(data)
    except ValueError:
        return []
    files = body.get("files") if isinstance(body, dict) else None
    return [str(f) for f in files] if isinstance(files, list) else []


class ImportCheck:
    """``check_reference_importable`` in the background; :meth:`wait` is called before
    expensive work. A check that passed before for the same tree content, interpreter and
    site-packages (:func:`import_ok_marker`, a trusted signed record read here, before any
    candidate code runs) is not repeated, unless ``read`` is False (``--no-reference-cache``).
    ``files``: the files the reference's processes import, as far as known (the record's
    list, then the check's); ``ignored``: why a record found was not trusted ("" when none
    was)."""

    def __init__(self, identity: Any, marker: Path | None = None, read: bool = True):
        from dflash_audit.audit.sides.signed_records import read_or_drop
        from dflash_audit.reference_source import check_reference_importable
        from dflash_audit.report.fingerprint import report_key

        self._marker, self.ignored, self.files = marker, "", []
        try:
            self._key = report_key(create=True) if marker is not None else None
        except OSError:
            self._key = None  # no record read or written
        found = None
        if read and marker is not None and self._key is not None:
            found, self.ignored = read_or_drop(marker, marker.name, self._key,
                                               {IMPORTED_FILE}, KIND)
        self.cached = found is not None
        if found is not None:
            self.files = _listed_files(found[IMPORTED_FILE])
        self._job = None if self.cached else Background(
            check_reference_importable, identity, None, name="dflash-audit-import-check")

    def summary(self) -> dict[str, Any]:
        """The report's ``reference.import_check`` entry: whether the passed check came from
        its record (``from_cache``), the record's key, why a record found was ignored."""
        return {"from_cache": self.cached, "record": self._marker.name if self._marker
                else None, "ignored": self.ignored}

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
        signed record of the passed check; an unwritable cache is left as it is."""
        from dflash_audit.audit.sides.signed_records import write_signed

        merged = sorted(set(self.files) | set(files))
        if self._marker is None or self._key is None or (self.cached and merged == self.files):
            return  # a record read here that lists them all already
        self.files = merged
        try:
            write_signed(self._marker, self._marker.name,
                         {IMPORTED_FILE: json.dumps({"files": self.files}).encode()}, {},
                         self._key, KIND)
        except OSError:
            pass
