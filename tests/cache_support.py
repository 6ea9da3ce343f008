"""Private copies of the suite's cache (``$DFLASH_AUDIT_CACHE``, set by conftest) for tests
that need a cache of their own, and a git repository of the cached reference release."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import git


#: The suite's lock between unsandboxed audits and the tests that count on cached records.
RECORDS_LOCK = Path(os.environ.get("DFLASH_AUDIT_TEST_CACHE", Path.home() / ".cache" /
                                   "dflash-audit-tests")).expanduser() / ".records.lock"
_held: list[int] = []  # this process's depth (a nested request is the outer one's)


@contextlib.contextmanager
def records_lock(exclusive: bool) -> Iterator[None]:
    """Between the suite's processes: an audit without a sandbox (its candidate could sign
    records) removes every record written anywhere while its candidate ran
    (:class:`dflash_audit.audit.sides.signed_records.RecordsWatch`, a product rule), so a test
    whose assertions need records kept (a warm audit's hits) holds this ``exclusive`` and the
    unsandboxed audits hold it shared: they never overlap, and unsandboxed audits still run
    side by side. Re-entrant in one process (a nested request is covered by the outer one)."""
    if _held:
        _held.append(0)
        try:
            yield
        finally:
            _held.pop()
        return
    RECORDS_LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(RECORDS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        _held.append(fd)
        try:
            yield
        finally:
            _held.pop()
    finally:
        os.close(fd)


def copy_of_cache(dest: Path, releases: bool = True, private_bytecode: bool = False) -> Path:
    """A cache at ``dest`` for a test that needs its own (a fresh git cache, one it damages):
    the reference releases when ``releases`` (without bytecode next to the sources or staging
    folders), the reference processes' warm bytecode (``pycache``; a cold one costs each
    reference process ~5 s of compiling torch and transformers) and a link to the converted
    verifiers (read only). The bytecode is linked to the suite's, or, when
    ``private_bytecode`` (a test whose candidate writes there, or whose audit discards it),
    this interpreter's part of it is copied (:func:`_copy_interpreter_bytecode`).
    The records of the passed import checks come too (``import-checks``, keyed by a tree's
    content, not its folder: a copy, a clone or a ``path:`` ref of the release imports as the
    original does), signed again with the copy's own report key. Never the reference cache's
    records, the case records nor the report key: an audit on the copy runs the reference.
    Returns ``dest``."""
    src = Path(os.environ["DFLASH_AUDIT_CACHE"])
    dest.mkdir(parents=True, exist_ok=True)
    if releases:
        shutil.copytree(src / "reference" / "sdist", dest / "reference" / "sdist",
                        ignore=shutil.ignore_patterns("__pycache__", "tmp"))
    _resign_import_checks(src, dest)
    (src / "pycache").mkdir(exist_ok=True)
    if private_bytecode:
        _copy_interpreter_bytecode(src / "pycache", dest / "pycache")
    else:
        (dest / "pycache").symlink_to(src / "pycache")
    if (src / "verifiers").is_dir():
        (dest / "verifiers").symlink_to(src / "verifiers")
    return dest


def _resign_import_checks(src: Path, dest: Path) -> None:
    """The trusted import-check records of the cache ``src``, signed with ``dest``'s report
    key (created) into ``dest``."""
    from dflash_audit.audit.sides import signed_records as sr
    from dflash_audit.audit.sides.import_check import IMPORTED_FILE, KIND
    from dflash_audit.audit.sides.reference_records import IMPORT_CHECKS_DIR
    from dflash_audit.report.fingerprint import report_key

    records = src / IMPORT_CHECKS_DIR
    if not records.is_dir():
        return
    old = report_key(create=False)
    os.environ["DFLASH_AUDIT_CACHE"] = str(dest)
    try:
        new = report_key(create=True)
    finally:
        os.environ["DFLASH_AUDIT_CACHE"] = str(src)
    for folder in records.iterdir() if old else []:
        found, _ = sr.read_signed(folder, folder.name, old, {IMPORTED_FILE}, KIND)
        if found is not None:
            sr.write_signed(dest / IMPORT_CHECKS_DIR / folder.name, folder.name, found[0], {},
                            new, KIND)


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
