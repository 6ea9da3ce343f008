"""Signed records in the tool's cache: a folder ``<key>/`` of files and ``record.json`` =
``{"format", "key", "kind", "files": {file: sha256}, ..., "signature"}``, trusted only when
its ``signature`` -- HMAC-SHA256 over its canonical body under a key derived from this
machine's report key (:func:`dflash_audit.report.fingerprint.report_key`, which the
candidate's sandbox hides) -- is valid, it is a record of the ``kind`` and ``key`` it is read
for, and every file's sha256 is the one it lists (:func:`read_signed`); in an audit without a
sandbox also unchanged since before any candidate code ran (:class:`RecordsWatch`: the
candidate's process can read the key and sign a record of its own). The kinds: the
reference's outputs of a case (:mod:`.reference_records`), an audit's built cases
(:mod:`dflash_audit.audit.cases.case_records`) and a passed import check of the reference
(:mod:`.import_check`); a record without ``kind`` is one of the reference's outputs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from dflash_audit.atomic import atomic_folder

RECORD_FILE = "record.json"
RECORD_FORMAT = 1
#: The kind of a record without a ``kind`` field (the first kind there was).
REFERENCE_OUTPUTS = "reference-outputs"
#: The largest file a record may hold (a larger one is refused from its size, never read).
MAX_FILE_BYTES = 4 << 30
#: Why a record is not trusted in an audit without a sandbox (:class:`RecordsWatch`).
CHANGED = "it changed after this audit started (no sandbox)"
#: Where the key of records is derived from the report key (never the same MAC as a report's).
_DOMAIN = b"dflash-audit reference-output records v1"


def canonical(value: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces; non-JSON values as ``str``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def sha(data: bytes) -> str:
    """sha256 (hex) of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _records_key(report_key: bytes) -> bytes:
    return hmac.new(report_key, _DOMAIN, hashlib.sha256).digest()


def sign_record(body: dict[str, Any], report_key: bytes) -> str:
    """HMAC-SHA256 (hex) of a record's canonical body (without ``signature``) under the
    records' key derived from ``report_key``."""
    text = canonical({k: v for k, v in body.items() if k != "signature"})
    return hmac.new(_records_key(report_key), text, hashlib.sha256).hexdigest()


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """A regular file's bytes, never through a symlink, never waiting on a FIFO or a device
    (opened non-blocking) and never reading past ``limit`` bytes (default
    :data:`MAX_FILE_BYTES`; a larger file is refused from its size).

    Raises:
        OSError: missing, a link or not a regular file, or over ``limit`` bytes."""
    limit = MAX_FILE_BYTES if limit is None else limit
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if info.st_size > limit:
            raise OSError(f"{path.name} is larger than {limit} bytes")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path.name} is larger than {limit} bytes")
    return data


def read_signed(folder: Path, key: str, report_key: bytes, want: set[str],
                kind: str = REFERENCE_OUTPUTS, watch: RecordsWatch | None = None
                ) -> tuple[tuple[dict[str, bytes], dict[str, Any]] | None, str]:
    """``((files, body), "")`` for the record in ``folder`` when it is trusted as the
    ``kind`` record ``key`` holding exactly the files ``want`` (and, with ``watch``, is the
    record that was there before any candidate code ran, before and after it is read);
    ``(None, why)`` when it is not; ``(None, "")`` when there is none."""
    if not os.path.lexists(folder):
        return None, ""
    if watch is not None and not watch.unchanged(folder):
        return None, CHANGED
    found, why = _read_signed(folder, key, report_key, want, kind)
    if found is not None and watch is not None and not watch.unchanged(folder):
        return None, CHANGED  # swapped while it was read
    return found, why


def _read_signed(folder: Path, key: str, report_key: bytes, want: set[str], kind: str
                 ) -> tuple[tuple[dict[str, bytes], dict[str, Any]] | None, str]:
    if folder.is_symlink() or not folder.is_dir():
        return None, "it is not a folder (a link, a file or a FIFO planted in its place)"
    try:
        body = json.loads(read_regular(folder / RECORD_FILE, limit=1 << 20))
        if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
            return None, "its record.json is not a record"
        signature = body.get("signature")
        if not isinstance(signature, str) or not hmac.compare_digest(
                signature, sign_record(body, report_key)):
            return None, "its signature does not match (changed, or signed with another key)"
        if body.get("kind", REFERENCE_OUTPUTS) != kind:
            return None, f"it is a record of another kind ({body.get('kind')}), not {kind}"
        if body.get("key") != key or body.get("format") != RECORD_FORMAT:
            return None, "it is the record of another case or reference (its key differs)"
        if set(body["files"]) != want:
            return None, f"it holds {sorted(body['files'])}, not {sorted(want)}"
        files = {}
        for name, digest in sorted(body["files"].items()):
            data = read_regular(folder / name)
            if sha(data) != digest:
                return None, f"{name} is not the file it was stored as (its sha256 differs)"
            files[name] = data
    except (OSError, ValueError) as exc:
        return None, f"it is unreadable ({exc})"
    return (files, body), ""


def write_signed(folder: Path, key: str, files: dict[str, bytes], extra: dict[str, Any],
                 report_key: bytes, kind: str = REFERENCE_OUTPUTS) -> None:
    """Store ``files`` as the ``kind`` record ``key`` in ``folder`` (atomically, replacing
    what is there), with the body fields ``extra``.

    Raises:
        OSError: it cannot be written (a full disk, a read-only cache)."""
    with atomic_folder(folder) as tmp:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        body = {**extra, "format": RECORD_FORMAT, "key": key,
                "files": {name: sha(data) for name, data in files.items()}}
        if kind != REFERENCE_OUTPUTS:
            body["kind"] = kind
        body["signature"] = sign_record(body, report_key)
        (tmp / RECORD_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))


def read_or_drop(folder: Path, key: str, report_key: bytes, want: set[str], kind: str,
                 watch: RecordsWatch | None = None) -> tuple[dict[str, bytes] | None, str]:
    """:func:`read_signed`'s files; a record found and not trusted is removed (it is then
    recomputed and stored again; one that changed since ``watch`` was taken is left to
    :meth:`RecordsWatch.discard_changed`), and ``why`` names what was wrong."""
    found, why = read_signed(folder, key, report_key, want, kind, watch)
    if found is None:
        if why and why != CHANGED:
            drop(folder)
        return None, why
    touch(folder)
    return found[0], ""


def drop(folder: Path) -> None:
    """Remove a record's folder, or whatever else is planted at its path (a link, a file, a
    FIFO); best effort."""
    try:
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
        else:
            folder.unlink(missing_ok=True)
    except OSError:
        pass


def prune(root: Path, max_bytes: int) -> list[str]:
    """Remove the least recently used records of ``root`` (by ``record.json``'s mtime, which
    a read refreshes: :func:`touch`) until the rest hold at most ``max_bytes``; returns the
    removed keys."""
    entries = []
    try:
        folders = list(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []  # an unreadable cache: nothing to prune here
    for folder in folders:
        try:
            used = (folder / RECORD_FILE).stat().st_mtime
            size = sum(p.stat().st_size for p in folder.iterdir())
        except OSError:
            continue  # being written or removed by another audit
        entries.append((used, size, folder))
    total, removed = sum(size for _, size, _ in entries), []
    for _, size, folder in sorted(entries):
        if total <= max_bytes:
            break
        drop(folder)
        total -= size
        removed.append(folder.name)
    return removed


def touch(folder: Path) -> None:
    """Mark a record as used now (for :func:`prune`); best effort."""
    try:
        os.utime(folder / RECORD_FILE)
    except OSError:
        pass


def _stat(path: Path) -> tuple[str, bool] | None:
    try:
        info = path.lstat()
    except OSError:
        return None
    return (f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}",
            stat.S_ISDIR(info.st_mode))


def record_signature(folder: Path) -> dict[str, str]:
    """``{"<key>" | "<key>/<file>": "inode:size:mtime_ns:ctime_ns"}`` of a record's folder
    ``<root>/<key>`` and the entries in it (never through a link): a write, a rename into or
    out of it or a replacement changes an inode or a ctime, which no user can set back."""
    top = _stat(folder)
    if top is None:
        return {}
    out = {folder.name: top[0]}
    if top[1]:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            names = []  # unreadable: its own signature stands for it
        for name in names:
            info = _stat(folder / name)
            if info is not None:
                out[f"{folder.name}/{name}"] = info[0]
    return out


def stat_signature(root: Path) -> dict[str, str]:
    """:func:`record_signature` of every record of ``root`` (empty when it is unreadable)."""
    out: dict[str, str] = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        out.update(record_signature(root / name))
    return out


class RecordsWatch:
    """The records of folders (every folder of records the sandbox would hide:
    :func:`dflash_audit.audit.sides.reference_records.record_dirs`) as they were before any
    candidate code ran, in an audit without a sandbox, whose candidate can read the report key
    and sign records of its own: only a record unchanged since is trusted
    (:meth:`unchanged`), and whatever changed is removed after the candidate's run
    (:meth:`discard_changed`), except the records this audit stored itself (:meth:`own`)."""

    def __init__(self, roots: list[Path]):
        self.before = {Path(root): stat_signature(Path(root)) for root in dict.fromkeys(roots)}

    def _of(self, folder: Path) -> dict[str, str]:
        before = self.before.get(folder.parent, {})
        prefix = f"{folder.name}/"
        return {k: v for k, v in before.items() if k == folder.name or k.startswith(prefix)}

    def unchanged(self, folder: Path) -> bool:
        """Whether the record ``folder`` (``<root>/<key>``) is as it was when the watch was
        taken (one in a folder not watched never is)."""
        return folder.parent in self.before and record_signature(folder) == self._of(folder)

    def own(self, folder: Path) -> None:
        """Take the record ``folder`` this audit has just stored as it is now."""
        if folder.parent in self.before:
            before = self.before[folder.parent]
            for k in self._of(folder):
                before.pop(k)
            before.update(record_signature(folder))

    def discard_changed(self) -> list[str]:
        """Remove every record that changed, appeared or vanished since the watch was taken
        (written by the candidate, or by another audit at the same time: recomputed when next
        needed); returns their keys."""
        changed = set()
        for root, before in self.before.items():
            now = stat_signature(root)
            for key in {k.split("/", 1)[0] for k in before.keys() | now.keys()
                        if before.get(k) != now.get(k)}:
                changed.add(key)
                drop(root / key)
            self.before[root] = stat_signature(root)
        return sorted(changed)
