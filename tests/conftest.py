"""Shared fixtures: the real reference (speculators 0.9.0 source from the package index,
resolved and cached by dflash_audit.reference_source) and a runner for audit cases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_audit.audit.case import Case, SideOutputs


@pytest.fixture(scope="session")
def reference_identity():
    """The pinned reference release, resolved once per session (downloads on first use)."""
    from dflash_audit.reference_source import resolve_reference

    return resolve_reference("speculators==0.9.0")


@pytest.fixture(scope="session")
def run_reference_cases(reference_identity, tmp_path_factory):
    """``run(cases) -> {name: SideOutputs}``: the real reference on each case, one process."""
    from dflash_audit.reference_source import run_reference

    def run(cases: list[Case]) -> dict[str, SideOutputs]:
        folder = tmp_path_factory.mktemp("reference-cases")
        for case in cases:
            case.write(folder)
        run_reference(reference_identity, [str(folder)], folder, timeout_s=900)
        return {case.name: SideOutputs.read(Path(folder) / case.name) for case in cases}

    return run


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
