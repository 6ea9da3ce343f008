"""Private copies of the suite's cache (``$DFLASH_AUDIT_CACHE``, set by conftest) for tests
that need a cache of their own, and a git repository of the cached reference release."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import git


def copy_of_cache(dest: Path, releases: bool = True, private_bytecode: bool = False) -> Path:
    """A cache at ``dest`` for a test that needs its own (a fresh git cache, one it damages):
    the reference releases when ``releases`` (without bytecode next to the sources or staging
    folders), the reference processes' warm bytecode (``pycache``; a cold one costs each
    reference process ~5 s of compiling torch and transformers) and a link to the converted
    verifiers (read only). The bytecode is linked to the suite's, or, when
    ``private_bytecode`` (a test whose candidate writes there, or whose audit discards it),
    this interpreter's part of it is copied (:func:`_copy_interpreter_bytecode`).
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
        _copy_interpreter_bytecode(src / "pycache", dest / "pycache")
    else:
        (dest / "pycache").symlink_to(src / "pycache")
    if (src / "verifiers").is_dir():
        (dest / "verifiers").symlink_to(src / "verifiers")
    return dest


def _interpreter_roots() -> list[str]:
    """This interpreter's installation folders (its prefix and base prefix, as given and
    resolved), outermost first and none inside another."""
    roots = sorted({os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                 sys.base_exec_prefix)}
                   | {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)})
    return [r for r in roots if not any(r != o and r.startswith(o.rstrip(os.sep) + os.sep)
                                        for o in roots)]


def _copy_interpreter_bytecode(src: Path, dest: Path) -> None:
    """Copy the bytecode of the suite's interpreter (stdlib and site-packages: what a reference
    process imports besides the reference tree and the adapter, whose copies lie elsewhere and
    are compiled by the audit) from the bytecode prefix ``src`` to ``dest``; not that of other
    interpreters, venvs or earlier test folders that share the suite's cache (hundreds of MB
    that no audit on the copy reads)."""
    dest.mkdir(parents=True)
    for tag in (p for p in src.iterdir() if p.is_dir()):
        for root in _interpreter_roots():
            mirrored = tag / root.lstrip(os.sep)
            if mirrored.is_dir():
                shutil.copytree(mirrored, dest / tag.name / root.lstrip(os.sep))


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
