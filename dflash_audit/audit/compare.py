"""``dflash-audit compare``: run a candidate and the real reference on identical cases, check
every quantity that defines DFlash training, write the conformance report, return 0 / 1 / 2.

Order of work (cheap and likely-to-fail steps first, so a setup error costs seconds):

1. the profile (:class:`dflash_audit.profile.Profile`), the reference spec (default:
   ``reference/speculators.lock``) resolved to a source tree, the candidate
   (``module:attr`` / ``file.py:attr``; default: our drafter);
2. a check that the reference imports from its source tree, in the background, awaited
   before anything expensive (a verifier capture, the runs); skipped when it passed before
   for the same source, interpreter and site-packages;
3. real batches through the data pipeline (cached, :mod:`.real_inputs`) and the cases
   (:mod:`.plan`): real rows under both layouts + ``--cases N`` synthetic ones;
4. the reference runs ALL cases in one subprocess (``reference/adapter.py``) while the
   candidate runs them in this process; anchors and weights are the same on both sides;
5. checks + diagnosis (:mod:`dflash_audit.audit.checks`, :mod:`dflash_audit.audit.diagnose`)
   per case, the report (:mod:`dflash_audit.report`) and the exit code.

Exit codes: 0 every check passed (warnings allowed), 1 a conformance failure (a failing check
or a candidate that crashed on a case), 2 a usage or setup error (bad profile, unknown ref,
unreachable remote, missing reference dependencies, a candidate that cannot be loaded, bad
data or verifier) -- reported as one clear message, never a traceback.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

DEFAULT_PROFILE = "reference-model"
DEFAULT_VERIFIER = "smollm2-135m"
DEFAULT_DATA = "chitchat"
DEFAULT_SEQ_LEN = 256
DEFAULT_ROWS = 1
DEFAULT_CASES = 12
DEFAULT_ANCHORS = 16
#: Seeds data order, weights, anchors and synthetic cases. With 8 the first packed chitchat
#: row of 256 SmolLM2 tokens holds 3 conversations (126 supervised tokens), so the real case
#: crosses document boundaries.
DEFAULT_SEED = 8
REFERENCE_TIMEOUT_S = 1800.0
MAX_MASK_PICTURES = 8
EXIT_SETUP = 2  # 0 pass and 1 fail come from the report's verdict
REF_ALTERNATIVES = ("--ref speculators==0.9.0 (the release from the package index), "
                    "--ref path:DIR (a local checkout of speculators), or --ref-url URL "
                    "(a reachable mirror or a local clone; file:// and plain paths work)")


class CompareSetupError(Exception):
    """A usage or setup error: the message says what is wrong and what to do (exit 2)."""


@dataclass
class CompareOptions:
    """Arguments of one audit (the CLI's options; see :func:`compare_command`)."""

    ref: str | None = None
    ref_url: str | None = None
    candidate: str | None = None
    profile: str = DEFAULT_PROFILE
    cases: int = DEFAULT_CASES
    verifier: str = DEFAULT_VERIFIER
    data: str = DEFAULT_DATA
    seq_len: int = DEFAULT_SEQ_LEN
    rows: int = DEFAULT_ROWS
    anchors: int = DEFAULT_ANCHORS
    seed: int = DEFAULT_SEED
    out: Path = Path("reports")
    offline: bool = False
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    cache_dir: Path | None = None  # batch cache + import marker (default: the user cache)
    reference_timeout_s: float = REFERENCE_TIMEOUT_S


@dataclass
class CompareOutcome:
    """What :func:`run_compare` produced: the report, its folder, the exit code (0 / 1)."""

    report: Any  # dflash_audit.report.Report
    folder: Path
    exit_code: int


# --------------------------------------------------------------------------- progress
@dataclass
class Stages:
    """Times each stage; shows a rich progress bar on a terminal, else one line per stage
    on stderr."""

    enabled: bool
    timing: dict[str, float] = field(default_factory=dict)
    _progress: Any = None

    def __enter__(self) -> Stages:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                      BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def say(self, text: str) -> None:
        """A line of text above the bar (or on stderr)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(f"dflash-audit: {text}", file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, key: str, label: str, total: int | None = None
              ) -> Iterator[Callable[[int], None]]:
        """Time ``key``; yields ``advance(n)`` for stages with ``total`` steps."""
        start = time.perf_counter()
        task = self._progress.add_task(label, total=total) if self._progress else None

        def advance(n: int = 1) -> None:
            if task is not None:
                self._progress.advance(task, n)

        try:
            yield advance
        finally:
            self.timing[key] = self.timing.get(key, 0.0) + time.perf_counter() - start
            if task is not None:
                self._progress.update(task, completed=total or 1, total=total or 1)
            elif not self.enabled:
                print(f"dflash-audit: {label}: {self.timing[key]:.1f} s", file=sys.stderr,
                      flush=True)


# ---------------------------------------------------------------------- reference
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


# ----------------------------------------------------------------------- candidate
def _failed_run(name: str, case: str, summary: str, detail: str, diagnosis: list[str]) -> Any:
    from dflash_audit.audit.result import FAIL, CheckResult

    return CheckResult(name=name, case=case, status=FAIL, summary=summary,
                       details={"traceback": detail}, diagnosis=diagnosis)


def run_candidate(candidate: Any, case: Any) -> tuple[Any, Any]:
    """Run the candidate on one case; returns ``(SideOutputs, None)`` or ``(None, failing
    CheckResult "run")`` when it raised or broke the protocol."""
    import torch

    from dflash_audit.audit.checks.anchors import draw_anchors
    from dflash_audit.audit.case import SideOutputs

    inputs = {k: v.clone() for k, v in case.inputs.items()}
    torch.manual_seed(0)
    try:
        out = candidate.run_case(case.config, case.loss, case.weights, inputs)
    except Exception as exc:  # noqa: BLE001 - user code: a conformance failure, reported
        summary = f"the candidate raised {type(exc).__name__}: {str(exc).strip()[:600]}"
        hint = []
        if "state_dict" in str(exc) or "size mismatch" in str(exc):
            hint = ["the candidate's parameters do not match the reference's state dict "
                    "(names or shapes): compare fc in/out features, layer count and head "
                    "sizes with the reference"]
        return None, _failed_run("run", case.name, summary, traceback.format_exc(), hint)
    if not isinstance(out, SideOutputs):
        return None, _failed_run(
            "run", case.name, f"run_case returned {type(out).__name__}, not SideOutputs", "",
            ["the candidate does not follow the protocol of dflash_audit.candidate"])
    if callable(getattr(candidate, "select_anchors", None)):
        try:
            out.tensors.update(draw_anchors(candidate.select_anchors, case))
        except Exception as exc:  # noqa: BLE001 - user code
            return None, _failed_run(
                "run", case.name, f"the candidate's select_anchors raised {type(exc).__name__}: "
                f"{str(exc).strip()[:600]}", traceback.format_exc(),
                ["select_anchors(loss_mask [1,T], max_anchors, block_size[, generator]) must "
                 "return (anchor_positions [A], anchor_valid [A])"])
    return out, None


# ------------------------------------------------------------------------ helpers
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


def _mask_pictures(name: str, case: Any, cand: Any, ref: Any) -> list[Any]:
    """A MaskPicture per layer-type mask of a case (``differs`` set)."""
    import torch

    from dflash_audit.report import MaskPicture

    keys = sorted({k for side in (cand, ref) if side is not None for k in side.tensors
                   if k.startswith("mask.")})
    pictures = []
    for key in keys:
        a = cand.tensors.get(key) if cand is not None else None
        b = ref.tensors.get(key) if ref is not None else None
        differs = a is None or b is None or tuple(a.shape) != tuple(b.shape) or not bool(
            torch.equal(a.bool(), b.bool()))
        pictures.append(MaskPicture(case=name, layer_type=key[5:], candidate=a, reference=b,
                                    seq_len=int(case.inputs["input_ids"].shape[-1]),
                                    block_size=case.config.block_size, differs=differs))
    return pictures


def _check_case(case: Any, cand: Any, ref: Any) -> list[Any]:
    """run_checks + diagnose (in place) on one case; a crash of the engine on this case's
    outputs is a failing "checks" result (the outputs could not be compared)."""
    from dflash_audit.audit.checks import run_checks
    from dflash_audit.audit.diagnose import diagnose

    try:
        results = list(run_checks(case, cand, ref))
        diagnose(case, cand, ref, results)
    except Exception as exc:  # noqa: BLE001 - reported with the traceback in the report
        return [_failed_run("checks", case.name,
                            f"the outputs could not be compared: {type(exc).__name__}: {exc}",
                            traceback.format_exc(),
                            ["the candidate's outputs do not have the shapes / keys of the "
                             "reference's (see the protocol in dflash_audit.candidate)"])]
    return results


def _candidate_name(candidate: Any, spec: str | None) -> str:
    return str(getattr(candidate, "name", None) or spec or type(candidate).__name__)


def _notes(reference: dict[str, Any]) -> list[str]:
    notes = ["Synthetic cases use tiny dimensions (H=32, V=128); real cases use the verifier's "
             "dimensions and real frozen weights with a seeded random trainable part."]
    version = str(reference.get("version") or "")
    if version.startswith("0.9."):
        notes.append("Reference metric definitions are version dependent: in speculators 0.9.0 "
                     "EAL is 1 + the leading run of correct slots per block (main@c05b95b sums "
                     "cumulative products of per-slot accuracy).")
    return notes


# -------------------------------------------------------------------------- main
def _check_options(opts: CompareOptions) -> None:
    for name, value, low in (("--cases", opts.cases, 0), ("--rows", opts.rows, 0),
                             ("--anchors", opts.anchors, 1)):
        if value < low:
            raise CompareSetupError(f"{name} must be >= {low}, got {value}")
    if opts.rows == 0 and opts.cases == 0:
        raise CompareSetupError("nothing to audit: --rows 0 and --cases 0")


def plan_cases(opts: CompareOptions, profile: Any, st: Stages, import_check: ImportCheck
               ) -> tuple[list[Any], dict[str, Any]]:
    """The real cases (``--rows`` captured rows, cached) and the synthetic ones, plus the
    report's ``inputs`` section.

    Raises:
        CompareSetupError: bad verifier, data, layer ids, mask token, or a profile that does
            not fit the verifier.
    """
    from dflash_audit.audit.plan import plan_real_cases, plan_synthetic_cases
    from dflash_audit.audit.real_inputs import load_real_inputs
    from dflash_audit.data.errors import DataError
    from dflash_audit.model.config import ConfigError
    from dflash_audit.profile import ProfileError

    planned, info = [], {}
    try:
        if opts.rows:
            with st.stage("batches", "real batches (verifier + data)"):
                real = load_real_inputs(opts.verifier, opts.data, opts.seq_len, opts.rows,
                                        profile.target_layers, seed=opts.seed,
                                        cache_root=opts.cache_dir, progress=st.say,
                                        before_capture=import_check.wait)
            first = real.batches[0]
            info = {"verifier": real.verifier, "data": real.data, "seq_len": opts.seq_len,
                    "rows": len(real.batches), "rows_requested": opts.rows,
                    "target_layer_ids": first.target_layer_ids,
                    "mask_token_id": first.mask_token_id,
                    "mask_token_reason": first.metadata.get("mask_token_reason"),
                    "batch_cache": {"key": real.cache_key, "hit": real.cache_hit,
                                    "dir": str(real.cache_dir)},
                    "data_stats": real.stats}
        with st.stage("cases", "building cases"):
            if opts.rows:
                planned += plan_real_cases(profile, real, opts.anchors, seed=opts.seed)
            planned += plan_synthetic_cases(profile, opts.cases, seed=opts.seed)
    except (DataError, ProfileError, ConfigError, ValueError) as exc:
        raise CompareSetupError(f"building the audit cases failed: {exc}") from None
    info.update({"audited_anchors": min(opts.anchors, profile.max_anchors),
                 "synthetic_cases": opts.cases, "seed": opts.seed, "cases": len(planned)})
    return planned, info


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


def check_all(planned: list[Any], outputs: dict[str, Any], cases_dir: Path, st: Stages
              ) -> tuple[list[Any], list[Any]]:
    """Checks + diagnosis of every case; returns the case records and the mask pictures
    (differing masks first, else one example per layer type from a real case).

    Raises:
        CompareSetupError: the reference wrote no outputs for a case.
    """
    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.report import CaseRecord

    records, differing, examples = [], [], []
    with st.stage("checks", "checks + diagnosis", total=len(planned)) as advance:
        for p in planned:
            name = p.case.name
            try:
                ref = SideOutputs.read(cases_dir / name)
            except (OSError, KeyError, ValueError) as exc:
                raise CompareSetupError(f"the reference wrote no usable outputs for case "
                                        f"{name}: {exc}") from None
            cand, failure = outputs.pop(name)
            results = [failure] if failure is not None else _check_case(p.case, cand, ref)
            records.append(CaseRecord(name=name, kind=p.kind, description=p.case.description,
                                      layout=p.layout, results=results))
            for pic in _mask_pictures(name, p.case, cand, ref):
                if pic.differs and len(differing) < MAX_MASK_PICTURES:
                    differing.append(pic)
                elif (not pic.differs and p.kind == "real"
                      and all(e.layer_type != pic.layer_type for e in examples)):
                    examples.append(pic)
            advance(1)
    return records, differing or examples


def run_compare(opts: CompareOptions) -> CompareOutcome:
    """Run one audit and write its report (see the module docstring).

    Raises:
        CompareSetupError: any usage or setup error (exit code 2).
    """
    from dflash_audit.candidate import CandidateError, load_candidate
    from dflash_audit.profile import Profile, ProfileError
    from dflash_audit.report import write_report

    _check_options(opts)
    started = time.perf_counter()
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    enabled = opts.progress if opts.progress is not None else sys.stderr.isatty()
    with Stages(enabled) as st:
        try:
            profile = Profile.load(opts.profile)
        except ProfileError as exc:
            raise CompareSetupError(str(exc)) from None
        with st.stage("resolve_reference", "resolving the reference"):
            identity = resolve_reference(opts.ref, opts.ref_url, opts.offline)
        try:
            candidate = load_candidate(opts.candidate)
        except CandidateError as exc:
            raise CompareSetupError(f"candidate: {exc}") from None
        import_check = ImportCheck(identity, import_ok_marker(identity, opts.cache_dir))
        planned, inputs_info = plan_cases(opts, profile, st, import_check)
        with tempfile.TemporaryDirectory(prefix="dflash-audit-cases-") as tmp:
            outputs = run_both_sides(opts, identity, candidate, planned, Path(tmp), st,
                                     import_check)
            records, pictures = check_all(planned, outputs, Path(tmp), st)
            ref_info = _reference_info(identity, Path(tmp))
        st.timing["total"] = time.perf_counter() - started
        report = _build_report(opts, profile, ref_info, candidate, records, pictures,
                               inputs_info, created_at, st.timing)
        try:
            folder = write_report(report, opts.out)
        except OSError as exc:
            raise CompareSetupError(f"cannot write the report into {opts.out}: {exc}") from None
    return CompareOutcome(report=report, folder=folder, exit_code=report.exit_code)


def _reference_info(identity: Any, cases_dir: Path) -> dict[str, Any]:
    """The identity of the resolved reference plus where its process imported it from."""
    import json

    info = identity.to_dict()
    run = cases_dir / "reference.json"
    if run.is_file():
        data = json.loads(run.read_text())
        info["module_file"] = data.get("module_file")
        if data.get("version") and not info.get("version"):
            info["version"] = data["version"]
    return info


def _build_report(opts: CompareOptions, profile: Any, ref_info: dict[str, Any], candidate: Any,
                  records: list[Any], pictures: list[Any], inputs_info: dict[str, Any],
                  created_at: str, timing: dict[str, float]) -> Any:
    from dflash_audit.report import Report
    from dflash_audit.report.fingerprint import candidate_fingerprint

    profile_fp = profile.fingerprint()
    cand_fp = candidate_fingerprint(candidate, profile_fp)
    return Report(
        reference=ref_info,
        candidate={"name": _candidate_name(candidate, opts.candidate), "spec": opts.candidate,
                   "fingerprint": cand_fp["fingerprint"], "files": cand_fp["files"]},
        profile={"name": profile.name, "source": profile.source, "fingerprint": profile_fp,
                 "fields": profile.to_dict()},
        inputs=inputs_info, cases=records, created_at=created_at, timing=dict(timing),
        notes=_notes(ref_info), masks=pictures)


# ---------------------------------------------------------------------------- CLI
def compare_command(
    ref: Annotated[Optional[str], typer.Option(  # noqa: UP007 (typer needs Optional)
        help="Reference: speculators@<branch|tag|sha> (git clone), speculators==X.Y.Z "
             "(release from the package index) or path:DIR. Default: reference/speculators.lock."
    )] = None,
    ref_url: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="Git URL (or local path / file://) for speculators@<ref>; also "
             "$DFLASH_AUDIT_REF_URL. Default: https://github.com/vllm-project/speculators.")
    ] = None,
    candidate: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="module:attr or path/to/file.py:attr (an object with run_case, or a factory). "
             "Default: dflash-audit's own drafter.")] = None,
    profile: Annotated[str, typer.Option(
        help="Built-in profile (reference-model, reference-train-cli, zlab) or a TOML file.")
    ] = DEFAULT_PROFILE,
    cases: Annotated[int, typer.Option(help="Number of synthetic cases (seeded spread).")
                     ] = DEFAULT_CASES,
    verifier: Annotated[str, typer.Option(
        help="'smollm2-135m' or a local Hugging Face causal-LM folder.")] = DEFAULT_VERIFIER,
    data: Annotated[str, typer.Option(help="'chitchat' or a .jsonl conversation file.")
                    ] = DEFAULT_DATA,
    seq_len: Annotated[int, typer.Option(help="T, tokens per real packed row.")
                       ] = DEFAULT_SEQ_LEN,
    rows: Annotated[int, typer.Option(help="Real packed rows (0: synthetic cases only).")
                    ] = DEFAULT_ROWS,
    anchors: Annotated[int, typer.Option(
        help="Anchor slots A per real case (capped by the profile's max_anchors).")
    ] = DEFAULT_ANCHORS,
    seed: Annotated[int, typer.Option(help="Seeds data order, weights, anchors, cases.")
                    ] = DEFAULT_SEED,
    out: Annotated[Path, typer.Option(help="Folder that receives <UTC time>-<ref id>/.")
                   ] = Path("reports"),
    offline: Annotated[bool, typer.Option(
        help="Never contact a git remote or the package index (use caches).")] = False,
) -> None:
    """Audit a DFlash drafter against the real reference; write reports/<time>-<ref>/.

    Exit code 0: conformant; 1: a check failed; 2: a usage or setup error.
    """
    opts = CompareOptions(ref=ref, ref_url=ref_url, candidate=candidate, profile=profile,
                          cases=cases, verifier=verifier, data=data, seq_len=seq_len,
                          rows=rows, anchors=anchors, seed=seed, out=out, offline=offline)
    raise typer.Exit(main(opts))


def main(opts: CompareOptions) -> int:
    """Run :func:`run_compare`, print the verdict and the report folder; returns the exit
    code. Setup errors print one message (no traceback) and return 2; an internal error
    prints its traceback and returns 2 too (1 is reserved for conformance failures)."""
    try:
        outcome = run_compare(opts)
    except CompareSetupError as exc:
        print(f"dflash-audit compare: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print("dflash-audit compare: interrupted", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - a bug of dflash-audit, not of the candidate
        traceback.print_exc()
        print("dflash-audit compare: internal error (a bug in dflash-audit; please report the "
              "traceback above)", file=sys.stderr)
        return EXIT_SETUP
    report = outcome.report
    checks = report.checks()
    failed = [c["name"] for c in checks if c["status"] == "fail"]
    line = (f"verdict: {report.verdict.upper()} ({len(report.cases)} cases, {len(checks)} "
            f"checks{', failing: ' + ', '.join(failed) if failed else ''}) in "
            f"{report.timing.get('total', 0.0):.1f} s")
    print(line)
    print(f"report: {outcome.folder}")
    return outcome.exit_code
