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

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.audit.sides.signed_records import (  # noqa: F401 - this module's API too
    RECORD_FILE,
    RECORD_FORMAT,
    RecordsWatch,
    canonical,
    prune,
    read_regular,
    read_signed,
    sha,
    sign_record,
    stat_signature,
    touch,
    write_signed,
)

#: The cache's folder of records, under ``$DFLASH_AUDIT_CACHE``.
RECORDS_DIR = "reference-outputs"
#: The other kinds of signed records (:mod:`.signed_records`), in folders beside
#: :data:`RECORDS_DIR` in every cache: the built cases
#: (:mod:`dflash_audit.audit.cases.case_records`), the import checks (:mod:`.import_check`)
#: and serve-check's readings of checkpoints by the reference
#: (:mod:`dflash_audit.serve.reference_record`).
CASES_DIR = "case-records"
IMPORT_CHECKS_DIR = "import-checks"
SERVE_PROBES_DIR = "serve-probes"
RECORD_KINDS = (RECORDS_DIR, CASES_DIR, IMPORT_CHECKS_DIR, SERVE_PROBES_DIR)
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
#: The most the records may hold; the least recently used are removed past it (:func:`prune`).
MAX_BYTES = 2 << 30


def _cache_base() -> Path:
    from dflash_audit.reference_source.identity import cache_root

    return cache_root().parent.expanduser().absolute()


def records_root(kind: str = RECORDS_DIR) -> Path:
    """``<cache>/reference-outputs`` (or another of :data:`RECORD_KINDS`): this run's
    folder of records."""
    return _cache_base() / kind


#: The registry (:mod:`dflash_audit.folder_registry`) of every records folder an audit used.
RECORDS_REGISTRY = "reference-record-folders"


def record_dirs() -> list[Path]:
    """The folders of records a candidate must not read (the reference's outputs of cases it
    may be given, the cases, the import checks: :data:`RECORD_KINDS`), wherever the cache
    is: this run's (created here, mode 0700, so the sandbox covers them even before the
    first record), the default cache's, and every one an audit of this user used with
    another ``$DFLASH_AUDIT_CACHE`` (:data:`RECORDS_REGISTRY` names their
    ``reference-outputs`` folders; the other kinds are beside them). Best effort: a folder
    that cannot be created is skipped."""
    from dflash_audit.folder_registry import record_folder, recorded_folders

    root = records_root()
    try:
        for kind in RECORD_KINDS:
            records_root(kind).mkdir(parents=True, exist_ok=True, mode=0o700)
        record_folder(RECORDS_REGISTRY, root.resolve())
    except OSError:
        pass
    default = (Path.home() / ".cache" / "dflash-audit" / RECORDS_DIR).absolute()
    bases = [p.parent for p in dict.fromkeys([root, default,
                                              *recorded_folders(RECORDS_REGISTRY)])]
    return [p for p in dict.fromkeys(base / kind for base in bases for kind in RECORD_KINDS)
            if p.is_dir()]


_canonical, _sha = canonical, sha  # the names this module's tests use


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


def case_fields(cases_dir: Path, name: str, digests: dict[str, str]) -> dict[str, Any]:
    """The case ``name``'s inputs by content: ``digests`` (:func:`dflash_audit.audit.sides.
    integrity.case_digests`, ``"<name>/<file>"`` keys) without the case's name, and its
    ``derive.json`` with the verifier folder it names replaced by that folder's files
    (:func:`dflash_audit.data.verifier.config_files`, not its weights: a proxy's folder lies
    in this audit's temporary folder).

    Raises:
        OSError, ValueError: ``derive.json`` is unreadable (the case is then not cached).
    """
    from dflash_audit.data.verifier import config_files

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
        out["verifier_files"] = config_files(folder)
        files.pop("derive.json")
    return out


def record_key(code: dict[str, str], environment: dict[str, Any], case: dict[str, Any],
               source_dir: str) -> str:
    """sha256 (hex) of the canonical JSON of :func:`code_fields`, :func:`environment_fields`,
    :func:`case_fields` and the reference tree's folder ``source_dir``."""
    return _sha(_canonical({"format": RECORD_FORMAT, "code": code, "environment": environment,
                            "case": case, "source_dir": source_dir}))


# ------------------------------------------------------------------------------ records
_read_regular = read_regular


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


def read_record(folder: Path, key: str, report_key: bytes, derives: bool,
                watch: RecordsWatch | None = None) -> tuple[Record | None, str]:
    """The record in ``folder`` if it is trusted for the case whose key is ``key``, else
    ``(None, why)``; ``(None, "")`` when there is none. ``derives``: the case has a
    ``derive.json`` (its record must then hold ``derivation.json``, else must not).
    ``watch``: an audit without a sandbox trusts only a record unchanged since it was taken
    (:class:`.signed_records.RecordsWatch`)."""
    want = {"outputs.safetensors", "outputs.json", *(["derivation.json"] if derives else [])}
    found, why = read_signed(folder, key, report_key, want, watch=watch)
    if found is None:
        return None, why
    files, body = found
    reference = body.get("reference") if isinstance(body.get("reference"), dict) else {}
    return Record(key=key, files=files, reference=reference), ""


def write_record(folder: Path, key: str, case_dir: Path, reference: dict[str, Any],
                 report_key: bytes) -> None:
    """Store the output files of ``case_dir`` as the record ``key`` in ``folder``
    (atomically, replacing what is there).

    Raises:
        OSError: it cannot be written (a full disk, a read-only cache)."""
    files = {name: read_regular(case_dir / name) for name in OUTPUT_FILES
             if (case_dir / name).is_file()}
    write_signed(folder, key, files, {"reference": reference}, report_key)
