"""Atomic folder writes: build in a temporary sibling, then rename into place.

A reader never sees a half-written checkpoint, cache entry or converted verifier; a crash
or a kill leaves at most a hidden ``.<name>.tmp-*`` folder behind, never a broken target.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(target: str | Path, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``target``; when the block ends without an
    exception it becomes ``target`` (mode 0755), otherwise it is removed.

    Args:
        target: the folder to publish.
        keep_existing: when ``target`` already exists (another process finished first),
            keep it and discard the new one; otherwise replace it.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.chmod(0o755)  # mkdtemp creates 0700
    if not target.exists():
        os.replace(tmp, target)
    elif keep_existing:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
