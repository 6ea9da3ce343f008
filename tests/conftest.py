"""Shared fixtures: the test session's own cache, the real reference (speculators 0.9.0
source from the package index, resolved and cached by dflash_audit.reference_source) and a
runner for audit cases.

The suite never reads or writes the user's cache (``~/.cache/dflash-audit``): before any test
module is imported, ``DFLASH_AUDIT_CACHE`` points at the suite's own persistent cache
(``$DFLASH_AUDIT_TEST_CACHE``, default ``~/.cache/dflash-audit-tests``), shared by the xdist
workers and built for that purpose: the expensive entries (the reference release, the converted
verifier) are copied in once from the user's cache when it has them, under a file lock. A test
that damages a cache entry works on a copy in its own ``tmp_path``.

The reference's outputs are shared the same way (the reference cache's signed records,
``reference-outputs/``): an audit of cases that another test, or an earlier run of the suite,
audited with the same reference code and adapter skips the reference. A test about the
reference's run, or one that tampers with it, audits on a cache of its own
(:func:`cache_support.copy_of_cache`: no records, its own report key and tree, so the reference
runs) or passes ``--no-reference-cache``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from filelock import FileLock

#: Cache entries worth copying from the user's cache (else they are downloaded / converted).
_SEEDED = (Path("reference") / "sdist", Path("verifiers") / "smollm2-135m")


def _test_cache() -> Path:
    """The suite's cache folder, seeded from the user's cache once (see the module docstring)."""
    cache = Path(os.environ.get("DFLASH_AUDIT_TEST_CACHE",
                                Path.home() / ".cache" / "dflash-audit-tests")).expanduser()
    user = Path(os.environ.get("DFLASH_AUDIT_CACHE", Path.home() / ".cache" / "dflash-audit")
                ).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / ".seed.lock")):
        for entry in _SEEDED:
            if (user / entry).is_dir() and not (cache / entry).exists() and user != cache:
                staging = cache / f".seeding-{entry.name}-{os.getpid()}"
                shutil.copytree(user / entry, staging, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
                (cache / entry).parent.mkdir(parents=True, exist_ok=True)
                staging.rename(cache / entry)
    return cache


os.environ["DFLASH_AUDIT_CACHE"] = str(_test_cache())
# CI=true turns --require-sandbox on by default; the tests that are about that set it themselves,
# the others must give the same answer in CI as on a laptop (two failed only in CI before).
# What the caller said stays readable for the tests that must run in CI (the browser test).
if os.environ.pop("CI", None) == "true":
    os.environ["DFLASH_AUDIT_TESTS_IN_CI"] = "1"
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # the workers share the cores: one intra-op thread per process (the compares' sides
    # included, through DFLASH_AUDIT_THREADS), so no process spins on a core another needs
    os.environ.setdefault("DFLASH_AUDIT_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from dflash_audit.audit.case import Case, SideOutputs


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    """A progress line every 30 s for a person watching the run (tests/suite_progress.py)."""
    from suite_progress import register

    register(config)


@pytest.fixture(scope="session")
def reference_identity():
    """The pinned reference release, resolved once per session (downloads on first use), its
    import check passed and recorded in the suite's cache (what a warm audit finds there)."""
    from dflash_audit.audit.sides.import_check import ImportCheck, import_ok_marker
    from dflash_audit.reference_source import resolve_reference

    identity = resolve_reference("speculators==0.9.0")
    ImportCheck(identity, import_ok_marker(identity, None)).wait()
    return identity


@pytest.fixture(scope="session")
def reference_zygote(reference_identity):
    """This test process's forking reference interpreter (:mod:`reference_zygote`): scripts in
    the reference's process without importing it again."""
    from reference_zygote import ReferenceZygote

    zygote = ReferenceZygote(reference_identity)
    yield zygote
    zygote.close()


@pytest.fixture(scope="session")
def run_reference_cases(reference_zygote, tmp_path_factory):
    """``run(cases) -> {name: SideOutputs}``: the real reference (``reference/adapter.py``) on
    each case, one forked reference process."""
    from dflash_audit.reference_source.runner import adapter_path

    def run(cases: list[Case]) -> dict[str, SideOutputs]:
        folder = tmp_path_factory.mktemp("reference-cases")
        for case in cases:
            case.write(folder)
        done = reference_zygote.run(adapter_path(), [folder], folder)
        assert done.returncode == 0, done.stdout[-4000:]
        return {case.name: SideOutputs.read(Path(folder) / case.name) for case in cases}

    return run


@pytest.fixture
def records_kept():
    """The records a test writes and reads are not removed under it by another worker's
    unsandboxed audit, which removes every record written while its candidate ran
    (:func:`cache_support.records_lock`, held exclusively for the test: per test, not per
    module, so those audits wait for one test at a time)."""
    from cache_support import records_lock

    with records_lock(exclusive=True):
        yield


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny training run's files (:func:`train_tiny.setup_run`: verifier, conversations,
    batches, profile, ``reports/`` with a passing report and canary for our drafter), made
    once per session and shared: tests read them and write elsewhere."""
    import train_tiny as tt

    return tt.setup_run(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for tiny tensors: fastest, and immune to oversubscription on a busy
    2-core machine (here and in reference subprocesses, through OMP_NUM_THREADS). Use with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads, patch = torch.get_num_threads(), pytest.MonkeyPatch()
    torch.set_num_threads(1)
    patch.setenv("OMP_NUM_THREADS", "1")
    yield
    patch.undo()
    torch.set_num_threads(threads)
