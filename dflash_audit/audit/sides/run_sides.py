"""The run stage of an audit: resolve the reference, check in the background that it imports,
write the cases, run the candidate on them in its own process (:mod:`.candidate_process`, a
per-case timeout), then the reference on all of them in one subprocess
(``reference/adapter.py``), each side with all usable cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_audit.audit.progress import Stages
from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.audit.sides.code_changes import refuse_changes, refuse_code_changes
from dflash_audit.audit.sides.import_check import Background, ImportCheck
from dflash_audit.audit.sides.reference_cache import (
    SUBSET_DIR,
    finish_reference_cache,
    open_reference_cache,
)

if TYPE_CHECKING:
    from dflash_audit.audit.options import CompareOptions

#: Sub-folder of the cases folder that receives the candidate process's outputs (no
#: ``profile.json``: neither side takes it for a case).
CANDIDATE_OUTPUTS = ".candidate-outputs"
#: The candidate's own copy of the cases: what its process reads (and may damage) is never
#: what the reference reads.
CANDIDATE_CASES = ".candidate-cases"
#: Said (and noted in the report) when the candidate gave no outputs on any case.
REFERENCE_NOT_RUN = ("the reference was not run: the candidate gave no outputs on any case, so "
                     "there is nothing to compare (each case fails on the candidate's side)")
REF_ALTERNATIVES = ("--ref speculators==0.9.0 (the release from the package index), "
                    "--ref path:DIR (a local checkout of speculators), or --ref-url URL "
                    "(a reachable mirror or a local clone; file:// and plain paths work)")


def resolve_reference(spec: str | None, url: str | None, offline: bool) -> Any:
    """Resolve the reference spec to a verified source tree (cached under
    ``$DFLASH_AUDIT_CACHE``, see :mod:`dflash_audit.reference_source`).

    Raises:
        CompareSetupError: unknown or unreachable ref (naming the alternatives), a source
            without the DFlash modules, a failed download.
    """
    from dflash_audit import reference_source as rs

    try:
        return rs.resolve_reference(spec, url=url, offline=offline)
    except rs.ReferenceSourceError as exc:
        message = str(exc)
        if spec and spec.startswith("speculators@") and "speculators==" not in message:
            message += f"\nAlternatives: {REF_ALTERNATIVES}."
        raise CompareSetupError(message) from None


def usable_cores() -> int:
    """The intra-op threads each side gets (at least one): ``$DFLASH_AUDIT_THREADS`` when set
    (a machine shared with other jobs: more threads than free cores spin and slow every job),
    else every core this process may run on, as the sides run one after the other.

    Raises:
        CompareSetupError: ``$DFLASH_AUDIT_THREADS`` is not a positive integer.
    """
    import os

    value = os.environ.get("DFLASH_AUDIT_THREADS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise CompareSetupError(f"DFLASH_AUDIT_THREADS={value!r}: give a positive number "
                                    "of threads, or unset it to use every core")
        return int(value)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1))


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    import os

    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_reference(identity: Any, cases_dir: Path, timeout_s: float | None, threads: int
                    ) -> Background:
    """Start ``reference/adapter.py CASES_DIR`` (all cases, one process) in the background,
    with ``threads`` intra-op threads (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are set in
    this process's environment while it runs, which the subprocess inherits) and a limit of
    ``timeout_s`` seconds (None: ``$DFLASH_AUDIT_REFERENCE_TIMEOUT``, else 1800 scaled with
    the load: :func:`dflash_audit.limits.limit_s`)."""
    from dflash_audit.audit.options import REFERENCE_TIMEOUT_ENV, REFERENCE_TIMEOUT_S
    from dflash_audit.limits import limit_s
    from dflash_audit.reference_source import run_reference

    limit = limit_s(REFERENCE_TIMEOUT_S, REFERENCE_TIMEOUT_ENV) if timeout_s is None else timeout_s

    def job() -> Any:
        with _environment(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)):
            return run_reference(identity, [str(cases_dir)], cases_dir, limit,
                                 limit_env=REFERENCE_TIMEOUT_ENV if timeout_s is None else None)

    return Background(job, name="dflash-audit-reference")


def failed_run(name: str, case: str, summary: str, detail: str, diagnosis: list[str]) -> Any:
    """A failing result ``name`` of one case: the candidate (or the comparison of its outputs)
    broke; ``detail`` (a traceback) goes into its details."""
    from dflash_audit.audit.result import FAIL, CheckResult

    return CheckResult(name=name, case=case, status=FAIL, summary=summary,
                       details={"traceback": detail}, diagnosis=diagnosis)


def run_candidate(candidate: Any, case: Any) -> tuple[Any, Any]:
    """Run an already loaded candidate on one case IN THIS PROCESS (tests and examples; an
    audit runs it in its own process, :func:`run_both_sides`) exactly as the candidate
    process does (:func:`dflash_audit.audit.sides.candidate_runner.run_one`); returns
    ``(SideOutputs, None)`` or ``(None, failing CheckResult "run")``."""
    from dflash_audit.audit.sides.case_run import CandidateCaseRun
    from dflash_audit.audit.sides.candidate_runner import run_one

    status, out = run_one(candidate, case)
    if status["status"] == "ok":
        return out, None
    return None, CandidateCaseRun.from_status(case.name, status).to_check_result()


def write_cases(cases: list[Any], folder: Path, advance: Callable[[int], None] = lambda n: None
                ) -> None:
    """Write every case into ``folder/<name>`` (:meth:`Case.write`); cases that share one
    weights dict (the real cases) share one ``weights.safetensors`` through hard links."""
    import dataclasses
    import os

    written: dict[int, Path] = {}
    for case in cases:
        first = written.get(id(case.weights))
        if first is None:
            path = case.write(folder)
            written[id(case.weights)] = path / "weights.safetensors"
        else:
            path = dataclasses.replace(case, weights={}).write(folder)
            target = path / "weights.safetensors"
            target.unlink()
            try:
                os.link(first, target)
            except OSError:  # no hard links on this file system
                case.write(folder)
        advance(1)


def write_work_cases(cases: list[Any], cases_dir: Path,
                     advance: Callable[[int], None] = lambda n: None) -> Path:
    """:func:`write_cases` into ``cases_dir`` and the candidate's :func:`private_copy`
    (returned). Raises CompareSetupError naming the folder on a full disk or a read-only one."""
    from safetensors import SafetensorError

    try:
        write_cases(cases, cases_dir, advance)
        return private_copy(cases_dir, [c.name for c in cases], cases_dir / CANDIDATE_CASES)
    except (OSError, SafetensorError) as exc:
        raise CompareSetupError(f"cannot write the cases into {cases_dir} (a full disk? "
                                f"$TMPDIR chooses the folder): {exc}") from None


def private_copy(cases_dir: Path, names: list[str], dest: Path) -> Path:
    """Copy the case folders ``names`` of ``cases_dir`` into ``dest`` (made here): byte copies,
    never links to the originals; files hard-linked to each other in ``cases_dir`` (the real
    cases' shared weights) are linked to each other in the copy. Returns ``dest``."""
    import shutil

    first: dict[tuple[int, int], Path] = {}
    for name in names:
        for src in sorted((cases_dir / name).rglob("*")):
            target = dest / src.relative_to(cases_dir)
            if src.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            inode = (src.stat().st_dev, src.stat().st_ino)
            if inode in first:
                os.link(first[inode], target)
            else:
                shutil.copy2(src, target)
                first[inode] = target
    return dest


def run_both_sides(opts: CompareOptions, identity: Any, planned: list[Any], cases_dir: Path,
                   st: Stages, import_check: ImportCheck,
                   reference_code: dict[str, str] | None = None, launch: Any = None,
                   guard: Any = None, waiting: Any = None, watch: Any = None
                   ) -> dict[str, Any]:
    """Write the cases, run the candidate on each (in its own process, all cores,
    ``opts.candidate_timeout_s`` per case, None: scaled with the load), then -- once the
    candidate's process is gone -- the reference on all of them (not at all when the candidate
    gave outputs on no case: :data:`REFERENCE_NOT_RUN`); a candidate that raises, exits,
    crashes, is killed or times out on a case fails that case. The sides run one after the other
    so the candidate never sees the reference's outputs nor the reference process: before the
    reference starts, the case inputs and the reference's code (``reference_code``,
    :func:`.integrity.reference_code_digest` taken before the candidate was loaded) must be
    unchanged, and afterwards its outputs must be the files it reported writing. ``guard``
    (:class:`.install_guard.InstallGuard`, taken with ``reference_code``) verifies the
    installation at the same steps, the files the reference run listed included, which
    ``import_check`` then remembers for the next audit's baseline. Cases whose
    reference outputs are in the cache (:mod:`.reference_cache`, read before the candidate
    runs; ``opts.reference_cache`` False: none) are not run again: their verified records are
    restored and checked the same way; the others' outputs are stored. The cache's report
    entry is written into ``cases_dir/`` :data:`.reference_cache.CACHE_SUMMARY`.
    ``launch``: how the candidate process starts
    (:class:`dflash_audit.audit.sides.launch.CandidateLaunch`; None: ``opts.candidate`` under
    this interpreter). ``watch`` (:func:`.reference_cache.watch_records`, taken before any
    candidate code ran; None: now): without a sandbox, the records it trusts. ``waiting``:
    the audit's candidate process, started on
    ``cases_dir/`` :data:`CANDIDATE_CASES` (still empty) before the cases were planned
    (:class:`.candidate_load.WaitingCandidate`): it runs them once they are written and
    their digests taken (None: a process started here). Returns ``{case name: (SideOutputs | None, failing "run" result |
    None)}``.

    Raises:
        CompareSetupError: the reference does not import or its run failed; the candidate
            cannot be loaded in its process; the case files or the reference's code changed
            (another process wrote them: no verdict can be given).
    """
    from dflash_audit.audit.sides.integrity import (
        case_digests,
        changed_files,
        leftover_processes,
        reference_output_changes,
    )
    from dflash_audit.reference_source import ReferenceSourceError

    names = [p.case.name for p in planned]
    with st.stage("write_cases", "writing cases", total=len(planned)) as advance:
        cand_cases = write_work_cases([p.case for p in planned], cases_dir, advance)
        digests = case_digests(cases_dir, names)
    threads = usable_cores()
    cache = open_reference_cache(opts, identity, cases_dir, names, digests, threads,
                                 reference_code, st, watch)
    with st.stage("import_check", "checking that the reference imports"):
        import_check.wait()
    if guard is not None:  # a sandboxed audit's check may end after the baseline
        guard.add_reference(import_check.files)
    from dflash_audit.audit.sides.candidate_process import (
        CandidateLoadError,
        candidate_side,
        run_candidate_process,
    )
    out_dir = cases_dir / CANDIDATE_OUTPUTS
    try:
        with st.stage("candidate", f"candidate on {len(planned)} cases (own process)",
                      total=len(planned)) as advance:
            runs = run_candidate_process(launch or opts.candidate, cand_cases, names, out_dir,
                                         opts.candidate_timeout_s, threads=threads,
                                         on_case=lambda run: advance(1), waiting=waiting)
    except CandidateLoadError as exc:
        leftover_processes()
        raise CompareSetupError(f"candidate: {exc}") from None
    t_left = time.perf_counter()
    left = leftover_processes()  # a daemon that left the candidate's process group
    st.timing["leftover_scan"] = time.perf_counter() - t_left
    cache.discard_changed()  # what a candidate without a sandbox wrote there: never reused
    if left:
        message = (f"the candidate left {len(left)} process(es) running after its own process "
                   f"ended ({'; '.join(left[:2])}); they were killed and no verdict is given. A "
                   "candidate must not start daemons; in the sandbox (bubblewrap) they die "
                   "with it.")
        try:  # what they changed meanwhile is discarded, never reused
            refuse_code_changes(identity, reference_code, "meanwhile", guard=guard)
        except CompareSetupError as exc:
            message += f" Also: {exc}"
        raise CompareSetupError(message)
    outputs = candidate_side(runs, out_dir)
    refuse_changes(changed_files(digests, case_digests(cases_dir, names)))
    refuse_code_changes(identity, reference_code, "while the candidate ran", guard=guard)
    if not candidate_ran(outputs):
        st.say(REFERENCE_NOT_RUN)
        return outputs
    missed = [name for name in names if name not in cache.hits]
    start = time.perf_counter()
    stdout, imported = "", []
    if missed:
        label = (f"reference (speculators) on {len(missed)} of {len(names)} cases (the others "
                 "from the cache)" if len(missed) < len(names) else
                 "reference (speculators) on all cases")
        with st.stage("reference_wait", label):
            try:
                run = run_reference_on(identity, cases_dir, missed, len(missed) < len(names),
                                       opts.reference_timeout_s, threads)
                stdout, imported = run.stdout, run.imported or []
            except ReferenceSourceError as exc:
                raise CompareSetupError(f"the reference run failed: {exc}") from None
    st.timing["reference"] = time.perf_counter() - start
    refuse_code_changes(identity, reference_code, "while the reference ran",
                        whole_prefix=False, guard=guard, reference_files=imported)
    import_check.remember(imported)
    stdout += "\n" + cache.restore(cases_dir)
    after = case_digests(cases_dir, names)
    refuse_changes(sorted(k for k in digests if digests[k] != after.get(k))
                    + reference_output_changes(stdout, cases_dir, names))
    finish_reference_cache(cache, cases_dir, names, missed)
    return outputs


def run_reference_on(identity: Any, cases_dir: Path, names: list[str], subset: bool,
                     timeout_s: float | None, threads: int) -> Any:
    """Run the reference on the cases ``names`` of ``cases_dir`` (all of them, or with
    ``subset`` only those: through a folder of links to them,
    :data:`.reference_cache.SUBSET_DIR`, whose ``reference.json`` is moved into
    ``cases_dir``); returns its finished run (``stdout``, ``imported``).

    Raises:
        ReferenceSourceError: the run failed (see :func:`start_reference`).
    """
    folder = cases_dir
    if subset:
        folder = cases_dir / SUBSET_DIR
        folder.mkdir()
        for name in names:
            (folder / name).symlink_to(Path("..") / name, target_is_directory=True)
    run = start_reference(identity, folder, timeout_s, threads).result()
    if subset and (folder / "reference.json").is_file():
        os.replace(folder / "reference.json", cases_dir / "reference.json")
    return run


def candidate_ran(outputs: dict[str, Any]) -> bool:
    """Whether the candidate gave outputs on at least one case of ``outputs`` (what
    :func:`run_both_sides` returns); when not, the reference is not run."""
    return any(out is not None for out, _ in outputs.values())
