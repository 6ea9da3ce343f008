"""The records of the reference cache (:mod:`.reference_cache`): the reference's outputs of
one case, kept in the tool's cache, and the key that addresses them.

A **record** is ``<cache>/reference-outputs/<key>/`` (``$DFLASH_AUDIT_CACHE``, default
``~/.cache/dflash-audit``): the files the reference process wrote for one case
(``outputs.safetensors``, ``outputs.json`` -- a bf16 case's fp32 rerun included, as its
``noise`` -- and ``derivation.json``) and ``record.json`` = ``{"format", "key", "files":
{file: sha256}, "reference": {"module_file", "version"}, "signature"}``.

``key`` addresses everything that determines those files (:func:`record_key`): the
reference's tree (every file but ``__pycache__``; its folder, which the outputs name), the
reference process's bytecode of it and of the adapter, the adapter's folder
(``reference/``), the tool's code that resolves and starts the reference
(:data:`LAUNCH_SOURCES`), the case's input files (the derivation's verifier folder by
content: every file but its weights), the interpreter, the versions of torch / transformers
and the other libraries the reference imports, the machine, the device (a GPU's model) and,
on the CPU, the thread count.

A record is trusted only when its ``signature`` -- HMAC-SHA256 over its canonical body under a
key derived from this machine's report key (:func:`dflash_audit.report.fingerprint.
report_key`, which the candidate's sandbox hides) -- is valid, its ``key`` is the key of the
case it is read for, and every file's sha256 is the one it lists (:func:`read_record`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.atomic import atomic_folder

#: The cache's folder of records, under ``$DFLASH_AUDIT_CACHE``.
RECORDS_DIR = "reference-outputs"
RECORD_FILE = "record.json"
RECORD_FORMAT = 1
#: What the adapter writes for a case (:data:`dflash_audit.audit.sides.integrity.
#: REFERENCE_OUTPUT_FILES`): the files a record holds.
OUTPUT_FILES = ("outputs.safetensors", "outputs.json", "derivation.json")
#: Libraries whose version may change the reference's numbers (it imports them from this
#: interpreter's site-packages).
LIBRARIES = ("torch", "transformers", "safetensors", "numpy", "tokenizers", "huggingface-hub",
             "pydantic")
#: dflash-audit's files (keys of :func:`dflash_audit.audit.sides.integrity.tool_digest`) that
#: resolve the reference, start its process or keep its records: part of every record's key.
LAUNCH_SOURCES = ("dflash_audit/reference_source/", "dflash_audit/audit/sides/run_sides.py",
                  "dflash_audit/audit/sides/reference_cache.py",
                  "dflash_audit/audit/sides/reference_records.py")
#: Files of a verifier folder the derivation never reads (weights): left out of the key.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
#: The most the records may hold; the least recently used are removed past it (:func:`prune`).
MAX_BYTES = 2 << 30
#: Where the key of records is derived from the report key (never the same MAC as a report's).
_DOMAIN = b"dflash-audit reference-output records v1"


def _cache_base() -> Path:
    from dflash_audit.reference_source.identity import cache_root

    return cache_root().parent.expanduser().absolute()


def records_root() -> Path:
    """``<cache>/reference-outputs``: this run's folder of records."""
    return _cache_base() / RECORDS_DIR


#: The registry (:mod:`dflash_audit.folder_registry`) of every records folder an audit used.
RECORDS_REGISTRY = "reference-record-folders"


def record_dirs() -> list[Path]:
    """The folders of records a candidate must not read (they hold the reference's outputs of
    cases it may be given), wherever the cache is: this run's (created here, mode 0700, so the
    sandbox covers it even before the first record), the default cache's, and every one an
    audit of this user used with another ``$DFLASH_AUDIT_CACHE`` (:data:`RECORDS_REGISTRY`).
    Best effort: a folder that cannot be created is skipped."""
    from dflash_audit.folder_registry import record_folder, recorded_folders

    root = records_root()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        record_folder(RECORDS_REGISTRY, root.resolve())
    except OSError:
        pass
    default = (Path.home() / ".cache" / "dflash-audit" / RECORDS_DIR).absolute()
    return [p for p in dict.fromkeys([root, default, *recorded_folders(RECORDS_REGISTRY)])
            if p.is_dir()]


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------ the key
def code_fields(reference_code: dict[str, str]) -> dict[str, str]:
    """The entries of a :func:`dflash_audit.audit.sides.integrity.reference_code_digest`
    that determine the reference's outputs: the reference's tree (``ref/``, without
    ``__pycache__``, which its process never reads), the adapter's folder (``reference/``),
    the reference process's bytecode of both (``bytecode-*``) and the tool's code that
    resolves, starts and caches it (:data:`LAUNCH_SOURCES`); not the rest of dflash-audit
    (its checks read the outputs, they do not make them)."""
    return {k: v for k, v in reference_code.items()
            if k.startswith(("ref/", "reference/", "bytecode-", *LAUNCH_SOURCES))
            and "/__pycache__/" not in k}


def _gpu_models() -> list[str]:
    """The GPUs' model lines from the NVIDIA driver (no CUDA initialised here)."""
    models = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            text = info.read_text(errors="replace")
        except OSError:
            continue
        models += [line.split(":", 1)[1].strip() for line in text.splitlines()
                   if line.startswith("Model:")]
    return models


def environment_fields(device: str, threads: int) -> dict[str, Any]:
    """What of this machine may change the reference's numbers: the interpreter, the
    :data:`LIBRARIES` versions, the machine type, the device (and a GPU's model and
    ``CUDA_VISIBLE_DEVICES``) and, on the CPU, the intra-op thread count (reductions split
    differently)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    out: dict[str, Any] = {"python": sys.version, "implementation": sys.implementation.cache_tag,
                           "machine": platform.machine(), "libraries": versions,
                           "device": device}
    if device == "cpu":
        out["threads"] = threads
    else:
        out["gpus"] = _gpu_models()
        out["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return out


def _verifier_files(folder: Path) -> dict[str, str]:
    """sha256 of every file of a verifier folder the derivation may read (not its weights)."""
    out = {}
    if folder.is_dir():
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
                out[path.relative_to(folder).as_posix()] = _sha(path.read_bytes())
    return out


def case_fields(cases_dir: Path, name: str, digests: dict[str, str]) -> dict[str, Any]:
    """The case ``name``'s inputs by content: ``digests`` (:func:`dflash_audit.audit.sides.
    integrity.case_digests`, ``"<name>/<file>"`` keys) without the case's name, and its
    ``derive.json`` with the verifier folder it names replaced by that folder's files
    (:func:`_verifier_files`: a proxy's folder lies in this audit's temporary folder).

    Raises:
        OSError, ValueError: ``derive.json`` is unreadable (the case is then not cached).
    """
    prefix = f"{name}/"
    files = {k[len(prefix):]: v for k, v in digests.items()
             if k.startswith(prefix) and k[len(prefix):] not in OUTPUT_FILES}
    out: dict[str, Any] = {"files": files}
    request = cases_dir / name / "derive.json"
    if "derive.json" in files:
        derive = json.loads(request.read_text())
        if not isinstance(derive, dict):
            raise ValueError("derive.json is not an object")
        folder = Path(str(derive.pop("verifier_dir", "")))
        out["derive"] = derive
        out["verifier_files"] = _verifier_files(folder)
        files.pop("derive.json")
    return out


def record_key(code: dict[str, str], environment: dict[str, Any], case: dict[str, Any],
               source_dir: str) -> str:
    """sha256 (hex) of the canonical JSON of :func:`code_fields`, :func:`environment_fields`,
    :func:`case_fields` and the reference tree's folder ``source_dir``."""
    return _sha(_canonical({"format": RECORD_FORMAT, "code": code, "environment": environment,
                            "case": case, "source_dir": source_dir}))


# ------------------------------------------------------------------------------ records
def _records_key(report_key: bytes) -> bytes:
    return hmac.new(report_key, _DOMAIN, hashlib.sha256).digest()


def sign_record(body: dict[str, Any], report_key: bytes) -> str:
    """HMAC-SHA256 (hex) of a record's canonical body (without ``signature``) under the
    records' key derived from ``report_key``."""
    text = _canonical({k: v for k, v in body.items() if k != "signature"})
    return hmac.new(_records_key(report_key), text, hashlib.sha256).hexdigest()


def _read_regular(path: Path, limit: int | None = None) -> bytes:
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


@dataclass
class Record:
    """A verified record: its key, the output files' bytes and the reference's facts."""

    key: str
    files: dict[str, bytes]
    reference: dict[str, Any] = field(default_factory=dict)

    @property
    def digests(self) -> dict[str, str]:
        """``{file: sha256}`` of :attr:`files`."""
        return {name: _sha(data) for name, data in self.files.items()}


def read_record(folder: Path, key: str, report_key: bytes, derives: bool
                ) -> tuple[Record | None, str]:
    """The record in ``folder`` if it is trusted for the case whose key is ``key``, else
    ``(None, why)``; ``(None, "")`` when there is none. ``derives``: the case has a
    ``derive.json`` (its record must then hold ``derivation.json``, else must not)."""
    if not os.path.lexists(folder):
        return None, ""
    try:
        body = json.loads(_read_regular(folder / RECORD_FILE, limit=1 << 20))
        if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
            return None, "its record.json is not a record"
        signature = body.get("signature")
        if not isinstance(signature, str) or not hmac.compare_digest(
                signature, sign_record(body, report_key)):
            return None, "its signature does not match (changed, or signed with another key)"
        if body.get("key") != key or body.get("format") != RECORD_FORMAT:
            return None, "it is the record of another case or reference (its key differs)"
        want = {"outputs.safetensors", "outputs.json", *(["derivation.json"] if derives
                                                          else [])}
        if set(body["files"]) != want:
            return None, f"it holds {sorted(body['files'])}, not {sorted(want)}"
        files = {}
        for name, digest in sorted(body["files"].items()):
            data = _read_regular(folder / name)
            if _sha(data) != digest:
                return None, f"{name} is not the file it was stored as (its sha256 differs)"
            files[name] = data
    except (OSError, ValueError) as exc:
        return None, f"it is unreadable ({exc})"
    reference = body.get("reference") if isinstance(body.get("reference"), dict) else {}
    return Record(key=key, files=files, reference=reference), ""


def write_record(folder: Path, key: str, case_dir: Path, reference: dict[str, Any],
                 report_key: bytes) -> None:
    """Store the output files of ``case_dir`` as the record ``key`` in ``folder``
    (atomically, replacing what is there).

    Raises:
        OSError: it cannot be written (a full disk, a read-only cache)."""
    with atomic_folder(folder) as tmp:
        files = {}
        for name in OUTPUT_FILES:
            path = case_dir / name
            if path.is_file():
                data = _read_regular(path)
                (tmp / name).write_bytes(data)
                files[name] = _sha(data)
        body = {"format": RECORD_FORMAT, "key": key, "files": files, "reference": reference}
        body["signature"] = sign_record(body, report_key)
        (tmp / RECORD_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))


def prune(root: Path, max_bytes: int) -> list[str]:
    """Remove the least recently used records of ``root`` (by ``record.json``'s mtime, which
    a read refreshes: :func:`touch`) until the rest hold at most ``max_bytes``; returns the
    removed keys."""
    import shutil

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
