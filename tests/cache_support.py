"""Private copies of the suite's cache (``$DFLASH_AUDIT_CACHE``, set by conftest) for tests
that damage one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def copy_of_cache(dest: Path) -> Path:
    """A private copy of the suite's cache at ``dest`` for a test that damages it: the
    reference releases (without bytecode next to the sources or staging folders), the
    reference processes' warm bytecode (``pycache``: copied, a test may write into it; a cold
    one costs each reference process ~5 s of compiling torch and transformers) and a link
    to the converted verifiers (read only). Returns ``dest``."""
    src = Path(os.environ["DFLASH_AUDIT_CACHE"])
    shutil.copytree(src / "reference" / "sdist", dest / "reference" / "sdist",
                    ignore=shutil.ignore_patterns("__pycache__", "tmp"))
    if (src / "pycache").is_dir():
        shutil.copytree(src / "pycache", dest / "pycache")
    if (src / "verifiers").is_dir():
        (dest / "verifiers").symlink_to(src / "verifiers")
    return dest
