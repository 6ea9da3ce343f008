"""The reference's reading of a checkpoint kept in the tool's cache, so that a second
serve-check of the same checkpoint (another engine, a rerun after a fix on the serving side)
does not start the reference's process again (~10 s on 2 cores).

A signed record (:mod:`dflash_audit.audit.sides.signed_records`, kind :data:`KIND`: the
``probe.json`` that ``reference/serve_probe.py`` wrote) keyed by everything that determines
it: the checkpoint's ``config.json`` bytes (the only file the probe reads: speculators'
``DFlashSpeculatorConfig.from_pretrained`` -> ``get_config_dict``; the probe builds the model
from the config, never loads weights; a config naming ``configuration_files``, from which
transformers reads another ``config.*.json``, is not cached), the reference's code, the probe
and the tool's code that starts it
(:func:`~dflash_audit.audit.sides.reference_records.code_fields`, after the reference's
bytecode is compiled) and the interpreter and libraries
(:func:`~dflash_audit.audit.sides.reference_records.environment_fields`). Its folder lies
beside the audit's records and is hidden from every candidate's sandbox like them
(:data:`~dflash_audit.audit.sides.reference_records.RECORD_KINDS`); a record that is not
trusted (a changed byte, another checkpoint's record moved into place, signed without the
report key) is removed and the probe runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_audit.audit.sides.reference_records import (
    SERVE_PROBES_DIR,
    code_fields,
    environment_fields,
    records_root,
)
from dflash_audit.audit.sides.signed_records import (
    canonical,
    prune,
    read_or_drop,
    read_regular,
    sha,
    write_signed,
)

KIND = SERVE_PROBES_DIR
PROBE_FILE = "probe.json"
#: The largest config.json the key reads (a larger one is not cached).
MAX_CONFIG_BYTES = 16 << 20
#: The records kept: past this, the least recently used are removed (a record is ~16 KiB; a
#: wide sliding window's mask rows make it larger).
MAX_BYTES = 256 << 20


def probe_key(identity: Any, checkpoint: Path) -> str | None:
    """sha256 (hex) of what determines the reference's reading of ``checkpoint``; None (nothing
    is then cached) when its ``config.json`` (or the file a link there names, as in a Hugging
    Face snapshot) is no regular JSON object, or names ``configuration_files``.

    ``identity``: the resolved reference (its bytecode is compiled here first, so the key is
    the same before and after the probe's process runs)."""
    from dflash_audit.audit.sides.integrity import reference_code_digest
    from dflash_audit.reference_source.runner import compile_reference_bytecode

    try:
        config = read_regular((Path(checkpoint) / "config.json").resolve(), MAX_CONFIG_BYTES)
        fields = json.loads(config)
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or "configuration_files" in fields:
        return None
    compile_reference_bytecode(identity)
    return sha(canonical({"kind": KIND, "config": sha(config),
                          "code": code_fields(reference_code_digest(identity)),
                          "environment": environment_fields("cpu", 1)}))


def read_probe(key: str, report_key: bytes) -> tuple[dict[str, Any] | None, str]:
    """``(probe.json's record, "")`` when the record ``key`` is trusted; ``(None, why)`` when
    one was found and not trusted (it is removed), ``(None, "")`` when there is none."""
    files, why = read_or_drop(records_root(KIND) / key, key, report_key, {PROBE_FILE}, KIND)
    if files is None:
        return None, why
    try:
        record = json.loads(files[PROBE_FILE])
    except ValueError as exc:  # signed, so ours: a record of an older format
        return None, f"its {PROBE_FILE} is not JSON ({exc})"
    return (record, "") if isinstance(record, dict) else (None, f"{PROBE_FILE} is no object")


def store_probe(key: str, record: dict[str, Any], report_key: bytes) -> None:
    """Keep the probe's ``record`` as the record ``key`` (best effort: a cache that cannot be
    written keeps nothing), then the records within :data:`MAX_BYTES`."""
    try:
        write_signed(records_root(KIND) / key, key, {PROBE_FILE: json.dumps(record).encode()},
                     {}, report_key, kind=KIND)
    except OSError:
        return
    prune(records_root(KIND), MAX_BYTES)
