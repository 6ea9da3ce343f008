"""The run stage of an audit: resolve the reference, check in the background that it imports,
write the cases, run the reference on all of them in one subprocess (``reference/adapter.py``)
while the candidate runs them in this process, split the cores between the two.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_audit.audit.progress import Stages
from dflash_audit.audit.setup_error import CompareSetupError

if TYPE_CHECKING:
    from dflash_audit.audit.compare import CompareOptions

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


def import_ok_marker(identity: Any, cache_dir: Path | None) -> Path:
    """Marker file that records a passed import check for this reference source under this
    interpreter and these site-packages (their mtimes change when packages are installed or
    removed, which invalidates the marker)."""
    import hashlib
    import json
    import os

    from dflash_audit.data.verifier import cache_dir as user_cache_dir

    site = sorted(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))
                  and os.path.isdir(p))
    state = {"source": identity.short_id, "src": str(identity.src_dir),
             "python": sys.executable, "version": sys.version,
             "site": {p: os.stat(p).st_mtime_ns for p in site}}
    key = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir or user_cache_dir()) / "compare" / "import-ok" / key


class Background:
    """``fn(*args)`` in a daemon thread (its work is a subprocess, so it overlaps with the
    in-process steps; a daemon thread never delays the exit of a failed audit)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "dflash-audit"):
        import threading

        self._result: Any = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self._error = exc

        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def result(self) -> Any:
        """Wait for ``fn``; return its value or raise its exception."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class ImportCheck:
    """``check_reference_importable`` in the background; :meth:`wait` is called before
    expensive work. A check that passed before for the same source, interpreter and
    site-packages is not repeated (the reference run would still report a missing module
    clearly)."""

    def __init__(self, identity: Any, marker: Path | None = None):
        from dflash_audit.reference_source import check_reference_importable

        self._marker = marker
        self.cached = marker is not None and marker.is_file()
        self._job = None if self.cached else Background(
            check_reference_importable, identity, name="dflash-audit-import-check")

    def wait(self) -> None:
        """Block until the check is done.

        Raises:
            CompareSetupError: missing import-time dependencies (with the install command),
                speculators imported from elsewhere, or an API this adapter does not know.
        """
        from dflash_audit.reference_source import ReferenceSourceError

        if self._job is None:
            return
        try:
            self._job.result()
        except ReferenceSourceError as exc:
            raise CompareSetupError(str(exc)) from None
        self._job = None
        if self._marker is not None:
            self._marker.parent.mkdir(parents=True, exist_ok=True)
            self._marker.touch()


def split_cores() -> tuple[int, int]:
    """(reference threads, candidate threads): the two sides run at the same time, so each
    gets half of the usable cores (at least one). On a loaded 2-core machine one thread per
    side is also much faster than two each: small ops spin on oversubscribed cores."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 2)
    ref = max(1, cores // 2)
    return ref, max(1, cores - ref)


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


def start_reference(identity: Any, cases_dir: Path, timeout_s: float, threads: int
                    ) -> Background:
    """Start ``reference/adapter.py CASES_DIR`` (all cases, one process) in the background,
    with ``threads`` intra-op threads (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are set in
    this process's environment while it runs, which the subprocess inherits)."""
    from dflash_audit.reference_source import run_reference

    def job() -> Any:
        with _environment(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)):
            return run_reference(identity, [str(cases_dir)], cases_dir, timeout_s)

    return Background(job, name="dflash-audit-reference")


def failed_run(name: str, case: str, summary: str, detail: str, diagnosis: list[str]) -> Any:
    """A failing result ``name`` of one case: the candidate (or the comparison of its outputs)
    broke; ``detail`` (a traceback) goes into its details."""
    from dflash_audit.audit.result import FAIL, CheckResult

    return CheckResult(name=name, case=case, status=FAIL, summary=summary,
                       details={"traceback": detail}, diagnosis=diagnosis)


def run_candidate(candidate: Any, case: Any) -> tuple[Any, Any]:
    """Run the candidate on one case; returns ``(SideOutputs, None)`` or ``(None, failing
    CheckResult "run")`` when it raised or broke the protocol."""
    import torch

    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.audit.checks.anchors import draw_anchors
    from dflash_audit.audit.precision import autocast, outputs_on_cpu
    from dflash_audit.audit.raised import name_raise

    inputs = {k: v.clone().to(case.device) for k, v in case.inputs.items()}
    weights = case.weights if case.device == "cpu" else {
        k: v.to(case.device) for k, v in case.weights.items()}
    torch.manual_seed(0)
    try:
        with autocast(case):  # bf16: fp32 master weights under bf16 autocast, as in training
            out = candidate.run_case(case.config, case.loss, weights, inputs)
    except Exception as exc:  # noqa: BLE001 - user code: a conformance failure, reported
        summary = f"the candidate raised {type(exc).__name__}: {str(exc).strip()[:600]}"
        hint = []
        if "state_dict" in str(exc) or "size mismatch" in str(exc):
            hint = ["the candidate's parameters do not match the reference's state dict "
                    "(names or shapes): compare fc in/out features, layer count and head "
                    "sizes with the reference"]
        hint += name_raise(f"{type(exc).__name__}: {exc}", case.config)
        return None, failed_run("run", case.name, summary, traceback.format_exc(), hint)
    if not isinstance(out, SideOutputs):
        return None, failed_run(
            "run", case.name, f"run_case returned {type(out).__name__}, not SideOutputs", "",
            ["the candidate does not follow the protocol of dflash_audit.candidate"])
    out.tensors = outputs_on_cpu(out.tensors)
    if callable(getattr(candidate, "select_anchors", None)):
        try:
            out.tensors.update(draw_anchors(candidate.select_anchors, case))
        except Exception as exc:  # noqa: BLE001 - user code
            return None, failed_run(
                "run", case.name, f"the candidate's select_anchors raised {type(exc).__name__}: "
                f"{str(exc).strip()[:600]}", traceback.format_exc(),
                ["select_anchors(loss_mask [1,T], max_anchors, block_size[, generator]"
                 "[, document_ids]) must return (anchor_positions [A], anchor_valid [A])"])
    out.derivation = candidate_derivation(candidate, case)
    return out, None


def candidate_derivation(candidate: Any, case: Any) -> dict[str, Any] | None:
    """The candidate's ``derive_config(verifier_config, config)`` for the case's verifier;
    None when the case has no verifier or the candidate no ``derive_config``;
    ``{"error": ...}`` when it raised or returned no dict (the ``derivation`` check fails)."""
    derive = getattr(candidate, "derive_config", None)
    if case.verifier is None or not callable(derive):
        return None
    try:
        fields = derive(case.verifier.config, case.config)
    except Exception as exc:  # noqa: BLE001 - user code: reported by the check
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:600]}"}
    if not isinstance(fields, dict):
        return {"error": f"derive_config returned {type(fields).__name__}, not a dict"}
    return fields


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


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_both_sides(opts: CompareOptions, identity: Any, candidate: Any, planned: list[Any],
                   cases_dir: Path, st: Stages, import_check: ImportCheck) -> dict[str, Any]:
    """Write the cases, start the reference on all of them, run the candidate on each while
    it runs; returns ``{case name: (SideOutputs | None, failing "run" result | None)}``.

    Raises:
        CompareSetupError: the reference does not import or its run failed.
    """
    from dflash_audit.reference_source import ReferenceSourceError

    with st.stage("write_cases", "writing cases", total=len(planned)) as advance:
        write_cases([p.case for p in planned], cases_dir, advance)
    with st.stage("import_check", "checking that the reference imports"):
        import_check.wait()
    start = time.perf_counter()
    ref_threads, cand_threads = split_cores()
    reference_job = start_reference(identity, cases_dir, opts.reference_timeout_s, ref_threads)
    outputs = {}
    with st.stage("candidate", f"candidate on {len(planned)} cases",
                  total=len(planned)) as advance, _torch_threads(cand_threads):
        for p in planned:
            outputs[p.case.name] = run_candidate(candidate, p.case)
            advance(1)
    with st.stage("reference_wait", "reference (speculators) on all cases"):
        try:
            reference_job.result()
        except ReferenceSourceError as exc:
            raise CompareSetupError(f"the reference run failed: {exc}") from None
    st.timing["reference"] = time.perf_counter() - start
    return outputs
