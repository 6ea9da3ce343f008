"""Signed records in the tool's cache: a folder ``<key>/`` of files and ``record.json`` =
``{"format", "key", "kind", "files": {file: sha256}, ..., "signature"}``, trusted only when
its ``signature`` -- HMAC-SHA256 over its canonical body under a key derived from this
machine's report key (:func:`dflash_audit.report.fingerprint.report_key`, which the
candidate's sandbox hides) -- is valid, it is a record of the ``kind`` and ``key`` it is read
for, and every file's sha256 is the one it lists (:func:`read_signed`). The kinds: the
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
    """A regular file's bytes, never through a symlink.

    Raises:
        OSError: missing, a link or not a regular file, or over ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(f"{path.name} is larger than {limit} bytes")
    return data


def read_signed(folder: Path, key: str, report_key: bytes, want: set[str],
                kind: str = REFERENCE_OUTPUTS
                ) -> tuple[tuple[dict[str, bytes], dict[str, Any]] | None, str]:
    """``((files, body), "")`` for the record in ``folder`` when it is trusted as the
    ``kind`` record ``key`` holding exactly the files ``want``; ``(None, why)`` when it is
    not; ``(None, "")`` when there is none."""
    if not os.path.lexists(folder):
        return None, ""
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


def read_or_drop(folder: Path, key: str, report_key: bytes, want: set[str], kind: str
                 ) -> tuple[dict[str, bytes] | None, str]:
    """:func:`read_signed`'s files; a record found and not trusted is removed (it is then
    recomputed and stored again), and ``why`` names what was wrong."""
    found, why = read_signed(folder, key, report_key, want, kind)
    if found is None:
        if why and (folder.is_symlink() or folder.is_file()):
            folder.unlink(missing_ok=True)
        elif why:
            shutil.rmtree(folder, ignore_errors=True)
        return None, why
    touch(folder)
    return found[0], ""


def prune(root: Path, max_bytes: int) -> list[str]:
    """Remove the least recently used records of ``root`` (by ``record.json``'s mtime, which
    a read refreshes: :func:`touch`) until the rest hold at most ``max_bytes``; returns the
    removed keys."""
    entries = []
    for folder in root.iterdir() if root.is_dir() else []:
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
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder.name)
    return removed


def touch(folder: Path) -> None:
    """Mark a record as used now (for :func:`prune`); best effort."""
    try:
        os.utime(folder / RECORD_FILE)
    except OSError:
        pass


def stat_signature(root: Path) -> dict[str, str]:
    """``{path: "inode:size:mtime_ns:ctime_ns"}`` of everything under ``root`` (a write or a
    replacement changes the inode or ctime, which no user can set back)."""
    out = {}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            try:
                info = path.lstat()
            except OSError:
                continue
            out[path.relative_to(root).as_posix()] = (
                f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}")
    return out
