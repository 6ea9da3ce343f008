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
4. the reference runs ALL cases in one subprocess (``reference/adapter.py``), with its own
   drafter-config derivation of each case's verifier, while the candidate runs them in its
   own process (:mod:`.candidate_process`: its exit, crash, kill or a case over
   ``--candidate-timeout`` fails that case); anchors and weights are the same on both sides;
5. checks + diagnosis (:mod:`dflash_audit.audit.checks`, :mod:`dflash_audit.audit.diagnose`)
   per case, the report (:mod:`dflash_audit.report`) and the exit code.

Exit codes: 0 every check passed (warnings allowed), 1 a conformance failure (a failing check
or a candidate that raised, exited, crashed, was killed or timed out on a case), 2 a usage or
setup error (bad profile, unknown ref, unreachable remote, missing reference dependencies, a
candidate that cannot be loaded, bad data or verifier) -- reported as one clear message,
never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_audit.audit.canary import publish_canary, stage_canary
from dflash_audit.audit.candidate_process import DEFAULT_CANDIDATE_TIMEOUT_S
from dflash_audit.audit.precision import measured_tolerances
from dflash_audit.audit.progress import Stages
from dflash_audit.audit.run_sides import (
    CANDIDATE_OUTPUTS,
    ImportCheck,
    failed_run,
    import_ok_marker,
    reference_code_digest,
    resolve_reference,
    run_both_sides,
)
from dflash_audit.audit.setup_error import CompareSetupError

DEFAULT_PROFILE = "reference-model"
DEFAULT_VERIFIER = "smollm2-135m"
DEFAULT_DATA = "chitchat"
DEFAULT_SEQ_LEN = 256
DEFAULT_ROWS = 1
DEFAULT_CASES = 12
DEFAULT_ANCHORS = 16
#: Largest block_size audited: synthetic cases have up to ~4 B^2 draft queries (DFlash
#: drafters use 4-16).
MAX_BLOCK_SIZE = 64
#: Seeds data order, weights, anchors and synthetic cases. With 8 the first packed chitchat
#: row of 256 SmolLM2 tokens holds 3 conversations (126 supervised tokens), so the real case
#: crosses document boundaries.
DEFAULT_SEED = 8
REFERENCE_TIMEOUT_S = 1800.0
MAX_MASK_PICTURES = 8


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
    weights: Path | None = None  # a user's drafter checkpoint folder for the real cases
    dtype: str | None = None  # fp32 | bf16; None: the profile's dtype
    device: str = "cpu"  # cpu | cuda (both sides on the GPU, their flex-attention paths)
    candidate_timeout_s: float = DEFAULT_CANDIDATE_TIMEOUT_S  # per case, candidate process


@dataclass
class CompareOutcome:
    """What :func:`run_compare` produced: the report, its folder, the exit code (0 / 1)."""

    report: Any  # dflash_audit.report.Report
    folder: Path
    exit_code: int


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


def _check_case(case: Any, cand: Any, ref: Any, memo: Any = None) -> list[Any]:
    """run_checks + diagnose (in place) on one case (``memo``: the audit's SearchMemo); a
    crash of the engine on this case's outputs is a failing "checks" result (the outputs
    could not be compared)."""
    from dflash_audit.audit.checks import run_checks
    from dflash_audit.audit.diagnose import diagnose

    try:
        results = list(run_checks(case, cand, ref))
        diagnose(case, cand, ref, results, memo)
    except Exception as exc:  # noqa: BLE001 - reported with the traceback in the report
        return [failed_run("checks", case.name,
                           f"the outputs could not be compared: {type(exc).__name__}: {exc}",
                           traceback.format_exc(),
                           ["the candidate's outputs do not have the shapes / keys of the "
                            "reference's (see the protocol in dflash_audit.candidate)"])]
    return results


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


def _check_options(opts: CompareOptions) -> None:
    for name, value, low in (("--cases", opts.cases, 0), ("--rows", opts.rows, 0),
                             ("--anchors", opts.anchors, 1)):
        if value < low:
            raise CompareSetupError(f"{name} must be >= {low}, got {value}")
    if opts.rows == 0 and opts.cases == 0:
        raise CompareSetupError("nothing to audit: --rows 0 and --cases 0")
    if opts.rows and opts.seq_len < 16:
        raise CompareSetupError(f"--seq-len must be an integer >= 16, got {opts.seq_len}")
    existing = Path(opts.out).expanduser().absolute()
    while not existing.exists():  # nothing is created before the run: only checked
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise CompareSetupError(f"--out {opts.out}: cannot write reports there ({existing} is "
                                f"{'a file' if not existing.is_dir() else 'not writable'}); "
                                "choose a writable folder")
    from dflash_audit.data.errors import VerifierError
    from dflash_audit.data.proxy_folder import check_proxy_spec

    try:  # a family name or a config.json: checked before seconds of batch work
        check_proxy_spec(opts.verifier)
    except VerifierError as exc:
        raise CompareSetupError(str(exc)) from None
    from dflash_audit.audit.precision import check_device_and_dtype

    try:
        check_device_and_dtype(opts.device, opts.dtype)
    except ValueError as exc:
        raise CompareSetupError(str(exc)) from None


def plan_cases(opts: CompareOptions, profile: Any, st: Stages, import_check: ImportCheck
               ) -> tuple[list[Any], dict[str, Any]]:
    """The real cases (``--rows`` captured rows, cached) and the synthetic ones, plus the
    report's ``inputs`` section.

    Raises:
        CompareSetupError: bad verifier, data, layer ids, mask token, or a profile that does
            not fit the verifier.
    """
    from dflash_audit.audit.plan import (
        plan_flex_padding_case,
        plan_real_cases,
        plan_synthetic_cases,
    )
    from dflash_audit.audit.precision import in_dtype
    from dflash_audit.audit.real_inputs import load_real_inputs
    from dflash_audit.audit.user_weights import UserWeightsError, load_user_weights
    from dflash_audit.data.errors import DataError
    from dflash_audit.model.config import ConfigError
    from dflash_audit.profile import ProfileError

    planned, info = [], {}
    if profile.block_size > MAX_BLOCK_SIZE or (opts.rows and profile.block_size >= opts.seq_len):
        raise CompareSetupError(
            f"block_size {profile.block_size}: the audit takes block sizes up to "
            f"{MAX_BLOCK_SIZE} and below --seq-len ({opts.seq_len}; a block that does not fit "
            "a row leaves no anchor, and synthetic cases grow as block_size squared)")
    if opts.weights is not None and not opts.rows:
        raise CompareSetupError("--weights needs real cases (--rows >= 1): the synthetic cases "
                                "have tiny dimensions a checkpoint cannot fit")
    try:
        user = load_user_weights(opts.weights) if opts.weights is not None else None
        with st.stage("verifier_config", "checking the profile against the verifier"):
            try:  # before any capture, with or without --rows (issue 9)
                profile_fits_verifier(profile, opts.verifier, st.say)
            except ProfileError as exc:
                raise CompareSetupError(
                    f"{exc}; {verifier_hint(profile, opts.verifier)}") from None
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
                planned += plan_real_cases(profile, real, opts.anchors, seed=opts.seed,
                                           user_weights=user, weights_source=str(opts.weights))
            planned += plan_synthetic_cases(profile, opts.cases, seed=opts.seed)
            if opts.device == "cuda":  # Q and T+Q past and off the flex block size
                planned.append(plan_flex_padding_case(profile, seed=opts.seed))
            planned = [dataclasses.replace(p, case=in_dtype(p.case, opts.dtype or profile.dtype,
                                                            opts.device)) for p in planned]
    except UserWeightsError as exc:
        raise CompareSetupError(str(exc)) from None
    except (DataError, ProfileError, ConfigError, ValueError) as exc:
        raise CompareSetupError(f"building the audit cases failed: {exc}") from None
    if opts.weights is not None:
        info["weights"] = str(Path(opts.weights).expanduser().resolve())
    info.update({"audited_anchors": min(opts.anchors, profile.max_anchors),
                 "synthetic_cases": opts.cases, "seed": opts.seed, "cases": len(planned)})
    return planned, info


def verifier_hint(profile: Any, verifier: str) -> str:
    """What to do when the profile's target layers do not exist in ``verifier``: name the
    verifier depth a drafter config.json was made for (its ``num_target_layers``)."""
    made_for = ""
    source = Path(str(profile.source or ""))
    if source.suffix == ".json" and source.is_file():
        try:
            depth = json.loads(source.read_text()).get("num_target_layers")
        except (OSError, ValueError, AttributeError):
            depth = None
        if isinstance(depth, int):
            made_for = f" ({source.name} was made for a {depth}-layer verifier)"
    return (f"audit the drafter with the verifier it was made for{made_for}: --verifier "
            f"path/to/that/verifier/config.json (a proxy at its depth) or its folder, instead of "
            f"{verifier}")


def profile_fits_verifier(profile: Any, verifier: str, say: Any = None) -> list[int]:
    """The profile's target layer ids for the verifier, from its ``config.json`` only (no
    weights loaded): what a real capture would refuse is refused without real rows too.

    Raises:
        ProfileError: an id the verifier does not have; VerifierError / DataError: no
            such verifier; ValueError: its config.json is unreadable.
    """
    import json

    from dflash_audit.data.verifier import resolve_verifier_path

    _, folder = resolve_verifier_path(verifier, progress=say)
    config = json.loads((folder / "config.json").read_text())
    layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get(
        "num_hidden_layers")
    if not isinstance(layers, int):
        raise ValueError(f"{folder / 'config.json'} has no num_hidden_layers")
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int):
        profile.check_mask_token(vocab, verifier)
    return profile.resolve_target_layer_ids(layers)


def check_all(planned: list[Any], outputs: dict[str, Any], cases_dir: Path, st: Stages
              ) -> tuple[list[Any], list[Any]]:
    """Checks + diagnosis of every case; returns the case records and the mask pictures
    (differing masks first, else one example per layer type from a real case).

    Raises:
        CompareSetupError: the reference wrote no outputs for a case.
    """
    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.audit.evidence import SearchMemo
    from dflash_audit.report import CaseRecord

    records, differing, examples, memo = [], [], [], SearchMemo()
    with st.stage("checks", "checks + diagnosis", total=len(planned)) as advance:
        for p in planned:
            name = p.case.name
            try:
                ref = SideOutputs.read(cases_dir / name)
            except (OSError, KeyError, ValueError) as exc:
                raise CompareSetupError(f"the reference wrote no usable outputs for case "
                                        f"{name}: {exc}") from None
            cand, failure = outputs.pop(name)
            results = [failure] if failure is not None else _check_case(p.case, cand, ref,
                                                                           memo)
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
    from dflash_audit.audit.candidate_process import (
        CandidateLoadError,
        load_candidate_identity,
    )
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
            reference_code = reference_code_digest(identity)  # before any candidate code runs
        import_check = ImportCheck(identity, import_ok_marker(identity, opts.cache_dir))
        with tempfile.TemporaryDirectory(prefix="dflash-audit-cases-") as tmp:
            with st.stage("load_candidate", "loading the candidate (own process)"):
                try:  # never imported here: its import may exit, crash or print
                    candidate = load_candidate_identity(opts.candidate, Path(tmp) / ".load")
                except CandidateLoadError as exc:
                    raise CompareSetupError(f"candidate: {exc}") from None
            planned, inputs_info = plan_cases(opts, profile, st, import_check)
            outputs = run_both_sides(opts, identity, planned, Path(tmp), st, import_check,
                                     reference_code)
            tolerance = measured_tolerances(planned, Path(tmp))
            records, pictures = check_all(planned, outputs, Path(tmp), st)
            ref_info = _reference_info(identity, Path(tmp))
            staging = Path(tmp) / ".canary"
            canary = stage_canary(planned, Path(tmp), Path(tmp) / CANDIDATE_OUTPUTS, staging)
            st.timing["total"] = time.perf_counter() - started
            report = _build_report(opts, profile, ref_info, candidate, records, pictures,
                                   inputs_info, created_at, st.timing,
                                   covered_verifiers(planned))
            report.tolerance = tolerance
            if canary is not None and report.verdict == "pass":  # what train reruns
                report.candidate["canary"] = canary
            else:
                canary = None
            try:
                folder = write_report(report, opts.out)
                if canary is not None:
                    publish_canary(staging, folder)
            except OSError as exc:
                raise CompareSetupError(f"cannot write the report into {opts.out}: {exc}"
                                        ) from None
    return CompareOutcome(report=report, folder=folder, exit_code=report.exit_code)


def _reference_info(identity: Any, cases_dir: Path) -> dict[str, Any]:
    """The identity of the resolved reference plus where its process imported it from.

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
    return info


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
                  verifiers: dict[str, dict[str, Any]]) -> Any:
    from dflash_audit.report import Report
    from dflash_audit.report.fingerprint import files_fingerprint

    profile_fp = profile.fingerprint()
    cand_fp = files_fingerprint(candidate.get("source_files", []), profile_fp)
    return Report(
        reference=ref_info,
        candidate={"name": candidate.get("name") or opts.candidate, "spec": opts.candidate,
                   "fingerprint": cand_fp["fingerprint"], "files": cand_fp["files"]},
        profile={"name": profile.name, "source": profile.source, "fingerprint": profile_fp,
                 "fields": profile.to_dict()},
        inputs=inputs_info, cases=records, created_at=created_at, timing=dict(timing),
        notes=_notes(ref_info), masks=pictures, verifiers=verifiers)
