"""Shared I/O of the broken-batch scripts: read a good ``dflash-audit data`` folder as plain
tensors + metadata, write a (deliberately broken) copy in the same format.

The writer bypasses :meth:`Batch.save`'s validation on purpose: a broken pipeline writes files
that our own writer would refuse (positions that do not restart, for one)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from dflash_audit.data.batch import TENSOR_KEYS
from dflash_audit.data.pipeline import BATCH_GLOB


def read_folder(src: str | Path) -> list[tuple[str, dict, dict]]:
    """``(file name, tensors, raw metadata)`` for every batch file of ``src``."""
    out = []
    for path in sorted(Path(src).glob(BATCH_GLOB)):
        with safe_open(str(path), framework="pt") as f:
            out.append((path.name, {k: f.get_tensor(k) for k in TENSOR_KEYS},
                        dict(f.metadata())))
    if not out:
        sys.exit(f"error: {src} holds no {BATCH_GLOB} (make one with `dflash-audit data`)")
    return out


def write_folder(rows: list[tuple[str, dict, dict]], out: str | Path) -> Path:
    """Write ``rows`` (as :func:`read_folder` returns them) into a fresh folder ``out``."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, tensors, meta in rows:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name),
                  metadata=meta)
    return out


def set_meta(meta: dict, key: str, value) -> None:
    """Set one metadata entry (stored as a JSON string, as :meth:`Batch.save` does)."""
    meta[key] = json.dumps(value, sort_keys=True)


def main(make, usage: str) -> None:
    """``python script.py SRC OUT [VERIFIER]`` -> ``make(src, out, verifier)``."""
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: python {Path(sys.argv[0]).name} SRC_DIR OUT_DIR [VERIFIER]\n{usage}")
    out = make(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else "smollm2-135m")
    print(f"wrote {out}")
