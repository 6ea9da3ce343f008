"""Private copies of the suite's cache (``$DFLASH_AUDIT_CACHE``, set by conftest) for tests
that need a cache of their own, and a git repository of the cached reference release."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import git


def copy_of_cache(dest: Path, releases: bool = True, private_bytecode: bool = False) -> Path:
    """A cache at ``dest`` for a test that needs its own (a fresh git cache, one it damages):
    the reference releases when ``releases`` (without bytecode next to the sources or staging
    folders), the reference processes' warm bytecode (``pycache``; a cold one costs each
    reference process ~5 s of compiling torch and transformers) and a link to the converted
    verifiers (read only). The bytecode is linked to the suite's, or copied when
    ``private_bytecode`` (a test whose candidate writes there, or whose audit discards it).
    With the releases come the records of their passed import checks (``compare/import-ok``,
    keyed by the release's digest, not its folder: a copy imports as the original does).
    Never the reference cache's records nor the report key: an audit on the copy runs the
    reference. Returns ``dest``."""
    src = Path(os.environ["DFLASH_AUDIT_CACHE"])
    dest.mkdir(parents=True, exist_ok=True)
    if releases:
        shutil.copytree(src / "reference" / "sdist", dest / "reference" / "sdist",
                        ignore=shutil.ignore_patterns("__pycache__", "tmp"))
        if (src / "compare" / "import-ok").is_dir():
            shutil.copytree(src / "compare" / "import-ok", dest / "compare" / "import-ok")
    (src / "pycache").mkdir(exist_ok=True)
    if private_bytecode:
        shutil.copytree(src / "pycache", dest / "pycache")
    else:
        (dest / "pycache").symlink_to(src / "pycache")
    if (src / "verifiers").is_dir():
        (dest / "verifiers").symlink_to(src / "verifiers")
    return dest


def release_repo(source_dir: Path, path: Path) -> git.Repo:
    """A git repository at ``path`` of the release source ``source_dir`` (branch main), its
    one commit tagged ``v0.9.0``: a remote for ``--ref speculators@v0.9.0``."""
    shutil.copytree(source_dir, path)
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "dflash-audit tests")
        cfg.set_value("user", "email", "tests@example.invalid")
    repo.git.add(A=True)
    repo.index.commit("speculators 0.9.0 release source")
    repo.create_tag("v0.9.0", message="release 0.9.0")
    return repo
