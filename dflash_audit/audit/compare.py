"""``dflash-audit compare``: run a candidate and the real reference on identical cases, check
every quantity that defines DFlash training, write the conformance report, return 0 / 1 / 2.

Order of work (cheap and likely-to-fail steps first, so a setup error costs seconds):

1. the profile (:class:`dflash_audit.profile.Profile`), the reference spec (default:
   ``reference/speculators.lock``) resolved to a source tree, the candidate
   (``module:attr`` / ``file.py:attr``; default: our drafter);
2. a check that the reference imports from its source tree, in the background, awaited
   before anything expensive (a verifier capture, the runs); skipped when it passed before
   for the same source, interpreter and site-packages;
3. real batches through the data pipeline (cached, :mod:`.real_inputs`; ``--verifier
   family:NAME`` or ``path/to/config.json`` captures them through a proxy verifier) and the
   cases (:mod:`.plan`): real rows under both layouts (on ``--weights DIR``'s checkpoint when
   given) + ``--cases N`` synthetic ones over the verifier families;
4. the candidate runs every case in its own, sandboxed process (:mod:`.candidate_process`,
   :mod:`.sandbox`: its exit, crash, kill or a case over ``--candidate-timeout`` fails that
   case), then the reference runs ALL cases in one isolated subprocess
   (``reference/adapter.py``; not at all when the candidate gave outputs on no case: there is
   nothing to compare), with its own drafter-config derivation of each case's
   verifier; anchors and weights are the same on both sides. The verdict's modules are
   imported, the report key exists and the reference's tree and the tool's files are hashed
   before any candidate code runs (:mod:`.integrity`); any change, or a candidate process
   left alive, is exit 2;
5. checks + diagnosis (:mod:`dflash_audit.audit.checks`, :mod:`dflash_audit.audit.diagnose`)
   per case, the report (:mod:`dflash_audit.report`) and the exit code.

Exit codes: 0 every check passed (warnings allowed), 1 a conformance failure (a failing check
or a candidate that raised, exited, crashed, was killed or timed out on a case), 2 a usage or
setup error (bad profile, unknown ref, unreachable remote, missing reference dependencies, a
candidate that cannot be loaded, bad data or verifier) -- reported as one clear message,
never a traceback.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_audit.audit.cases.build import plan_cases
from dflash_audit.audit.cases.case_records import CaseCache
from dflash_audit.audit.frameworks.latent import latent_findings
from dflash_audit.audit.frameworks.registry import (
    SPECULATORS,
    candidate_launch,
    framework_facts,
    is_framework_spec,
    parse_framework_spec,
)
from dflash_audit.audit.judge import check_all
from dflash_audit.audit.options import CompareOptions, check_options
from dflash_audit.audit.progress import Stages
from dflash_audit.audit.replay.noise import measured_tolerances
from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.audit.sides.canary import publish_canary, stage_canary
from dflash_audit.audit.sides.code_changes import refuse_code_changes, with_code_changes
from dflash_audit.audit.sides.import_check import ImportCheck, import_ok_marker
from dflash_audit.audit.sides.integrity import reference_code_digest
from dflash_audit.audit.sides.reference_cache import CACHE_SUMMARY, watch_records
from dflash_audit.audit.sides.reference_records import record_dirs
from dflash_audit.audit.sides.sandbox import work_root
from dflash_audit.audit.sides.run_sides import (
    CANDIDATE_CASES,
    CANDIDATE_OUTPUTS,
    REFERENCE_NOT_RUN,
    candidate_ran,
    resolve_reference,
    run_both_sides,
    usable_cores,
)


@dataclass
class CompareOutcome:
    """What :func:`run_compare` produced: the report, its folder, the exit code (0 / 1)."""

    report: Any  # dflash_audit.report.Report
    folder: Path
    exit_code: int


def _notes(reference: dict[str, Any]) -> list[str]:
    notes = ["Synthetic cases use tiny dimensions (H=32, V=128); real cases use the verifier's "
             "dimensions and its frozen weights (a proxy verifier's are seeded random, at a "
             "shrunk width) with a seeded trainable part fitted briefly to the targets."]
    version = str(reference.get("version") or "")
    if version.startswith("0.9."):
        notes.append("Reference metric definitions are version dependent: in speculators 0.9.0 "
                     "EAL is 1 + the leading run of correct slots per block (main@c05b95b sums "
                     "cumulative products of per-slot accuracy).")
    return notes


def reference_url(opts: CompareOptions) -> str | None:
    """``--ref-url`` for the reference: not when it is meant for a ``framework:speculators@REF``
    candidate while the reference is a release or a path (it clones the candidate's ref)."""
    from dflash_audit.reference_source import parse_spec

    if opts.ref_url and is_framework_spec(opts.candidate):
        fs = parse_framework_spec(opts.candidate)
        ref_is_git = bool(opts.ref) and opts.ref.strip().startswith(f"{SPECULATORS}@")
        try:
            candidate_is_git = fs.key == SPECULATORS and bool(fs.ref) and parse_spec(
                fs.ref)[0] == "git"
        except ReferenceError:  # a bad ref: named when the candidate is resolved
            candidate_is_git = False
        if candidate_is_git and not ref_is_git:
            return None
    return opts.ref_url


#: Modules the verdict depends on, imported before any candidate code runs (so a candidate
#: that edits them or plants their bytecode changes nothing in this audit, and is caught by
#: the digests of the tool's files taken after these imports).
VERDICT_PACKAGES = ("dflash_audit.audit.checks", "dflash_audit.audit.replay",
                    "dflash_audit.audit.diagnose", "dflash_audit.report")
VERDICT_MODULES = ("dflash_audit.audit.judge", "dflash_audit.audit.result",
                   "dflash_audit.audit.protocol", "dflash_audit.audit.tolerance",
                   "dflash_audit.audit.case", "dflash_audit.audit.sides.canary",
                   "dflash_audit.audit.sides.candidate_process")


def import_verdict_modules() -> list[str]:
    """Import every module of :data:`VERDICT_PACKAGES` and :data:`VERDICT_MODULES`; returns
    their names. From then on this process writes no bytecode (``sys.dont_write_bytecode``),
    so a ``.pyc`` that appears in the tool's ``__pycache__`` during the run is not ours."""
    import importlib
    import pkgutil

    names = list(VERDICT_MODULES)
    for package in VERDICT_PACKAGES:
        module = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + "."):
            names.append(info.name)
    for name in names:
        importlib.import_module(name)
    sys.dont_write_bytecode = True
    return names


def sandbox_note(opts: CompareOptions) -> dict[str, Any]:
    """The report's ``candidate.sandbox`` entry (what the sandbox proved from inside, its
    ``bwrap`` and version; :func:`dflash_audit.audit.sides.sandbox.sandbox_status`).

    Raises:
        CompareSetupError: the sandbox starts but fails its proof (always: a sandbox that does
            not isolate must not be reported as one), or ``--require-sandbox`` (or CI) and no
            sandbox can start here.
    """
    from dflash_audit.audit.sides.sandbox import (
        UNAVAILABLE,
        UNPROVEN,
        sandbox_status,
        unproven_message,
    )

    status = sandbox_status()
    if status.state == UNPROVEN:
        raise CompareSetupError(unproven_message(status))
    if not status.available and opts.sandbox_required:
        raise CompareSetupError(
            f"the candidate's sandbox cannot start ({status.reason}), and a sandbox is required "
            "(--require-sandbox, on by default when CI=true). Install bubblewrap (`sudo apt-get "
            "install -y bubblewrap`, or `bash scripts/setup.sh`), or pass --no-require-sandbox "
            f"to accept a report that says '{UNAVAILABLE}'.")
    if not status.available:
        print(f"dflash-audit compare: warning: {UNAVAILABLE} ({status.reason}); its process "
              "can write everything this user can", file=sys.stderr)
    return status.to_dict()


def run_compare(opts: CompareOptions) -> CompareOutcome:
    """Run one audit and write its report (see the module docstring).

    Raises:
        CompareSetupError: any usage or setup error (exit code 2).
    """
    from dflash_audit.audit.sides.candidate_load import WaitingCandidate
    from dflash_audit.audit.sides.candidate_process import CandidateLoadError, processes_started
    from dflash_audit.audit.sides.install_guard import InstallGuard
    from dflash_audit.audit.sides.integrity import enable_subreaper, tool_roots
    from dflash_audit.audit.sides.tamper_record import refuse_recorded_tampering
    from dflash_audit.data.verifier import local_verifier_folder
    from dflash_audit.profile import Profile, ProfileError
    from dflash_audit.reference_source.runner import compile_reference_bytecode, pycache_prefix
    from dflash_audit.report import write_report
    from dflash_audit.report.fingerprint import report_key

    check_options(opts)
    refuse_recorded_tampering(tool_roots().values())  # before any work, any candidate code
    try:  # before any candidate code and before the sandbox's proof, which checks it hidden
        report_key(create=True)
    except OSError as exc:
        raise CompareSetupError(f"cannot create the report key: {exc}") from None
    sandbox = sandbox_note(opts)
    import_verdict_modules()
    enable_subreaper()  # a candidate's orphaned daemons become ours, to be found and killed
    started = time.perf_counter()
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    enabled = opts.progress if opts.progress is not None else sys.stderr.isatty()
    with Stages(enabled) as st:
        try:
            profile = Profile.load(opts.profile)
        except ProfileError as exc:
            raise CompareSetupError(str(exc)) from None
        with st.stage("resolve_reference", "resolving the reference"):
            identity = resolve_reference(opts.ref, reference_url(opts), opts.offline)
            compile_reference_bytecode(identity)  # then no reference process writes any
        with st.stage("resolve_candidate", "resolving the candidate"):
            launch = candidate_launch(opts.candidate, python=opts.candidate_python,
                                      offline=opts.offline, url=opts.ref_url)
        marker = import_ok_marker(identity, opts.cache_dir)
        import_check = ImportCheck(identity, marker, read=opts.reference_cache)
        if not sandbox["sandboxed"]:  # its bytecode is written before the candidate's window
            import_check.wait()
        reference_code = reference_code_digest(  # before any candidate code runs
            identity, whole_prefix=not sandbox["sandboxed"])
        guard = InstallGuard([identity.source_dir, *tool_roots().values(), pycache_prefix()],
                             import_check.files)
        # without a sandbox only records unchanged since now are trusted (before any candidate)
        watch = watch_records(sandbox["sandboxed"], [marker.parent])
        case_cache = CaseCache.open(opts.reference_cache, reference_code, watch)
        st.timing["install_baseline"] = guard.seconds
        try:  # every refusal after candidate code ran also names (and records) changes
            with tempfile.TemporaryDirectory(prefix="dflash-audit-cases-",
                                             dir=work_root()) as tmp, ExitStack() as live:
                with st.stage("load_candidate", "loading the candidate (own process)"):
                    # the folders its sandbox hides exist before it starts (a cold run's
                    # records folder too): the same sandbox then runs the cases, one process
                    record_dirs()
                    try:  # never imported here: its import may exit, crash or print
                        waiting = live.enter_context(WaitingCandidate(
                            launch, Path(tmp) / CANDIDATE_CASES, Path(tmp) / CANDIDATE_OUTPUTS,
                            threads=usable_cores(), readable=[
                                p for p in [local_verifier_folder(opts.verifier)] if p]))
                    except CandidateLoadError as exc:
                        raise CompareSetupError(f"candidate: {exc}") from None
                candidate = waiting.identity
                framework = framework_facts(launch, candidate)
                planned, inputs_info = plan_cases(
                    opts, profile, st, import_check.wait,
                    capabilities=framework["capabilities"] if framework else None,
                    framework_label=framework["label"] if framework else "",
                    case_cache=case_cache)
                outputs = run_both_sides(opts, identity, planned, Path(tmp), st, import_check,
                                         reference_code, launch=launch, guard=guard,
                                         waiting=waiting, watch=watch)
                reference_ran = candidate_ran(outputs)
                tolerance = measured_tolerances(planned, Path(tmp))
                records, pictures = check_all(planned, outputs, Path(tmp), st, framework)
                ref_info = _reference_info(identity, Path(tmp))
                ref_info["import_check"] = import_check.summary()
                staging = Path(tmp) / ".canary"
                t_canary = time.perf_counter()
                canary = stage_canary(planned, Path(tmp), Path(tmp) / CANDIDATE_OUTPUTS,
                                      staging)
                st.timing["canary"] = time.perf_counter() - t_canary
                st.timing["total"] = time.perf_counter() - started
                exercised = inputs_info.pop("latent_exercised", {})
                report = _build_report(opts, profile, ref_info, candidate, records, pictures,
                                       inputs_info, created_at, st.timing,
                                       covered_verifiers(planned), launch)
                if framework is not None:
                    report.candidate["framework"] = {
                        **{k: v for k, v in framework.items()
                           if k not in ("capabilities", "latent")},
                        "capabilities": framework["capabilities"].to_dict()}
                    report.notes += inputs_info.get("unsupported", [])
                    report.latent = latent_findings(framework["label"],
                                                     framework["capabilities"],
                                                     framework["latent"], exercised)
                report.tolerance = tolerance
                if not reference_ran:
                    report.notes.append(REFERENCE_NOT_RUN)
                elif ref_info.get("cache", {}).get("from_cache"):
                    report.notes.append(cache_note(ref_info["cache"]))
                report.candidate["sandbox"] = sandbox
                report.candidate["processes"] = processes_started(Path(tmp) / CANDIDATE_OUTPUTS)
                if not sandbox["sandboxed"]:
                    report.notes.append(sandbox["note"])
                if canary is not None and report.verdict == "pass":  # what train reruns
                    report.candidate["canary"] = canary
                else:
                    canary = None
                refuse_code_changes(identity, None, "before the verdict", guard=guard)
                refuse_recorded_tampering(tool_roots().values())  # another audit's record
                try:
                    folder = write_report(report, opts.out)
                    if canary is not None:
                        publish_canary(staging, folder)
                except OSError as exc:
                    raise CompareSetupError(f"cannot write the report into {opts.out}: {exc}"
                                            ) from None
        except CompareSetupError as exc:
            raise with_code_changes(exc, identity, reference_code, guard) from None
    return CompareOutcome(report=report, folder=folder, exit_code=report.exit_code)


def _reference_info(identity: Any, cases_dir: Path) -> dict[str, Any]:
    """The identity of the resolved reference plus where its process imported it from and,
    as ``cache``, which of its outputs came from the reference cache.

    Raises:
        CompareSetupError: the reference's ``reference.json`` is not a JSON object (another
            process changed it: no verdict can be given)."""
    info = identity.to_dict()
    run = cases_dir / "reference.json"
    if run.is_file():
        try:
            data = json.loads(run.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise CompareSetupError(f"{run}, written by the reference process, is unreadable "
                                    f"({exc}): another process changed the audit's files, so no "
                                    "verdict can be given; rerun the audit") from None
        info["module_file"] = data.get("module_file")
        if data.get("version") and not info.get("version"):
            info["version"] = data["version"]
    cache = cases_dir / CACHE_SUMMARY
    if cache.is_file():  # which outputs came from the cache (written by run_both_sides)
        info["cache"] = json.loads(cache.read_text())
    return info


def cache_note(cache: dict[str, Any]) -> str:
    """The report's note on reference outputs taken from the cache (``reference.cache``)."""
    return (f"The reference's outputs of {cache['from_cache']} of {len(cache['cases'])} cases "
            "came from the reference cache: records of identical cases on the same reference "
            f"code and libraries, verified against this machine's key {cache['key_id']} "
            "(--no-reference-cache recomputes them).")


def covered_verifiers(planned: list[Any]) -> dict[str, dict[str, Any]]:
    """{verifier fingerprint: {"name", "architecture"}} of every verifier the cases derive
    from (the real one, each synthetic family proxy): what the training gate accepts."""
    from dflash_audit.report.fingerprint import (
        verifier_architecture,
        verifier_fingerprint,
    )

    out: dict[str, dict[str, Any]] = {}
    for p in planned:
        v = p.case.verifier
        if v is not None:
            out.setdefault(verifier_fingerprint(v.config), {
                "name": v.name, "architecture": verifier_architecture(v.config)})
    return out


def _build_report(opts: CompareOptions, profile: Any, ref_info: dict[str, Any],
                  candidate: dict[str, Any],
                  records: list[Any], pictures: list[Any], inputs_info: dict[str, Any],
                  created_at: str, timing: dict[str, float],
                  verifiers: dict[str, dict[str, Any]], launch: Any = None) -> Any:
    from dflash_audit.audit.sides.launch import identity_fingerprint
    from dflash_audit.report import Report

    profile_fp = profile.fingerprint()
    cand_fp = identity_fingerprint(candidate, launch or opts.candidate, profile_fp)
    return Report(
        reference=ref_info,
        candidate={"name": candidate.get("name") or opts.candidate, "spec": opts.candidate,
                   "fingerprint": cand_fp["fingerprint"], "files": cand_fp["files"]},
        profile={"name": profile.name, "source": profile.source, "fingerprint": profile_fp,
                 "fields": profile.to_dict()},
        inputs=inputs_info, cases=records, created_at=created_at, timing=dict(timing),
        notes=_notes(ref_info), masks=pictures, verifiers=verifiers)
