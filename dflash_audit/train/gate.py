"""The training gate: ``dflash-audit train`` starts only after a passing audit of the same
candidate, profile and reference.

A report (``reports/<time>-<ref>/report.json``, written by ``dflash-audit compare``) admits a
training run when all of these hold:

* ``verdict == "pass"``;
* ``candidate.fingerprint`` equals the fingerprint of the candidate about to be trained (its
  source files as its own sandboxed process reports them, the files its spec names, the
  profile: :func:`dflash_audit.audit.sides.launch.identity_fingerprint`, as compare records it);
* ``profile.fingerprint`` equals :meth:`dflash_audit.profile.Profile.fingerprint` of the
  training profile; ``reference_key(reference)`` equals the key of the reference that
  ``--ref`` resolves to now (the lock's reference by default);
* the training verifier's architecture fingerprint is among the report's ``verifiers``
  (:func:`dflash_audit.report.fingerprint.verifier_fingerprint`; a proxy audited with
  ``--verifier path/to/config.json`` covers the real model of that config);
* ``fingerprint`` equals :func:`dflash_audit.report.fingerprint.report_fingerprint` of the
  above and of the canary entry (a hand-edited verdict or fingerprint is refused);
* ``signature`` is this machine's HMAC of the whole report
  (:func:`dflash_audit.report.fingerprint.signature_problem`): a report written by hand or by
  another tool is refused, however right its fingerprint;
* it records a canary (``candidate.canary``): a report without one is refused.

Nothing here imports the candidate: ``train`` decides before any candidate code runs in its
process (:mod:`dflash_audit.train.sealed`). Then the report's canary case runs through train's
step on the model the candidate builds, first in a sandboxed process of the candidate's own and
then, after the import, on the very model train is about to train; either refuses when the
loss, metrics or gradients differ from the audited ones (:mod:`dflash_audit.train.canary`:
the gate checks behaviour, not only source).

Exit codes of a refusal (:class:`GateError.exit_code`): **2** when no report matches (none
found, or the closest differs in candidate / profile / reference, is unreadable or tampered
with, or the canary's outputs differ from the audited ones): run the printed compare command;
**1** when the matching report's verdict is ``fail`` (a conformance failure: fix the candidate).

The accepted report's ``fingerprint`` is written into every checkpoint (its metadata).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.user_input import loads_json, not_a_file, path_kind, read_regular_text, shorten

REPORT_FILE = "report.json"
DEFAULT_REPORTS_DIR = Path("reports")
EXIT_NO_MATCHING_REPORT = 2
EXIT_AUDIT_FAILED = 1


class GateError(Exception):
    """Training may not start. ``exit_code``: 2 no matching report, 1 the audit failed."""

    def __init__(self, message: str, exit_code: int = EXIT_NO_MATCHING_REPORT):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Expected:
    """What the run about to start is: fingerprints and the reference key it needs."""

    candidate_fingerprint: str
    profile_fingerprint: str
    reference_key: dict[str, Any]
    compare_command: str
    verifier_fingerprint: str | None = None  # None: the verifier is not checked
    verifier_name: str = ""
    candidate_files: dict[str, str] | None = None  # {name: sha256}: what changed is named


@dataclass(frozen=True)
class ReportFields:
    """The fields of ``report.json`` the gate reads (one place to align with the report)."""

    path: Path
    verdict: str
    fingerprint: str
    candidate_fingerprint: str
    profile_fingerprint: str
    reference: dict[str, Any]
    candidate_name: str = ""
    profile_name: str = ""
    created_at: str = ""
    verifiers: dict[str, Any] | None = None  # None: a report from before verifier coverage
    canary: dict[str, Any] | None = None  # candidate.canary
    signature_problem: str | None = None  # None: signed by this machine's report key
    candidate_files: dict[str, str] | None = None  # candidate.files


@dataclass(frozen=True)
class GateResult:
    """An accepted report."""

    report_path: Path
    report_fingerprint: str
    candidate_fingerprint: str
    profile_fingerprint: str
    reference: dict[str, Any] = field(default_factory=dict)
    canary: dict[str, Any] | None = None

    def checkpoint_metadata(self) -> dict[str, str]:
        """safetensors metadata (str -> str) recorded in every checkpoint."""
        return {"dflash_audit_report_fingerprint": self.report_fingerprint,
                "dflash_audit_report": str(self.report_path),
                "dflash_audit_candidate_fingerprint": self.candidate_fingerprint,
                "dflash_audit_profile_fingerprint": self.profile_fingerprint}


#: A report.json larger than this is not read (a compare report is some hundred KiB).
MAX_REPORT_BYTES = 64 * 2**20


def read_report(path: Path) -> ReportFields:
    """Read the gate's fields from a ``report.json`` (schema_version 1,
    :mod:`dflash_audit.report.schema`).

    Raises:
        GateError: not a regular file (a folder, a device, a FIFO: named), unreadable, not
            JSON (or nested too deeply), another schema_version than this version writes, or
            a required field missing (exit code 2).
    """
    from dflash_audit.report.schema import SCHEMA_VERSION

    what = "pass the report.json a `dflash-audit compare` wrote"
    if path_kind(path) != "a regular file":
        raise GateError(f"audit report {path} {not_a_file(path)}: {what}")
    try:
        size = Path(path).stat().st_size
        if size > MAX_REPORT_BYTES:
            raise GateError(f"{path} is {size / 2**20:.0f} MiB: not a `dflash-audit compare` "
                            f"report (they are far under {MAX_REPORT_BYTES // 2**20} MiB)")
        from dflash_audit.report.fingerprint import signature_problem

        d = loads_json(read_regular_text(path, MAX_REPORT_BYTES))
        if not isinstance(d, dict):
            raise GateError(f"audit report {path} holds a JSON {type(d).__name__}, not a report "
                            f"object: {what}")
        if "kind" in d and "schema_version" not in d:
            raise GateError(f"{path} is a {shorten(repr(d['kind']))} report, not a "
                            "`dflash-audit compare` report; pass the compare report's path to "
                            "--report")
        version = d.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:  # noqa: E721 (True == 1)
            raise GateError(f"audit report {path} has schema_version "
                            f"{shorten(repr(version))}; this dflash-audit reads schema_version "
                            f"{SCHEMA_VERSION} only: rerun the audit with this version "
                            "(`dflash-audit compare`)")
        canary = d["candidate"].get("canary")
        return ReportFields(
            path=Path(path), verdict=str(d["verdict"]), fingerprint=str(d["fingerprint"]),
            candidate_fingerprint=str(d["candidate"]["fingerprint"]),
            profile_fingerprint=str(d["profile"]["fingerprint"]),
            reference=dict(d["reference"]),
            candidate_name=str(d["candidate"].get("name") or d["candidate"].get("spec") or ""),
            profile_name=str(d["profile"].get("name") or ""),
            created_at=str(d.get("created_at") or ""), verifiers=d.get("verifiers"),
            canary=canary if isinstance(canary, dict) else None,
            signature_problem=signature_problem(d), candidate_files=d["candidate"].get("files"))
    except OSError as exc:
        raise GateError(f"cannot read audit report {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise GateError(f"cannot read audit report {path}: {type(exc).__name__}: {exc}") from None


def compare_command(ref: str | None, profile: str, candidate: str | None,
                    reports_dir: Path | None = None, verifier: str | None = None) -> str:
    """The ``dflash-audit compare`` command that audits this candidate/profile/reference
    (and ``--verifier`` unless it is the default; ``--out`` only when the reports folder is
    not the default ``reports``)."""
    parts = ["dflash-audit", "compare"]
    if ref:
        parts += ["--ref", ref]
    parts += ["--profile", profile]
    if candidate:
        parts += ["--candidate", candidate]
    if verifier and verifier != "smollm2-135m":
        parts += ["--verifier", verifier]
    if reports_dir is not None and Path(reports_dir) != DEFAULT_REPORTS_DIR:
        parts += ["--out", str(reports_dir)]
    return shlex.join(parts)


def expected_for(identity: dict[str, Any] | None, candidate_spec: str | None, profile: Any,
                 ref: str | None, reference_identity: dict[str, Any] | None = None,
                 reports_dir: Path | None = None, verifier: Any = None) -> Expected:
    """Fingerprints of the run about to start, computed without importing the candidate.

    Args:
        identity: the candidate's identity as its own process reported it
            (:func:`~dflash_audit.audit.sides.candidate_load.load_candidate_identity`:
            its ``source_files``); None for our drafter (``candidate_spec`` None), whose
            files are read here.
        candidate_spec: ``--candidate`` as given (None = our drafter); its own files are
            hashed too, located without running code
            (:func:`~dflash_audit.audit.sides.launch.identity_fingerprint`, the
            function compare records the fingerprint with).
        profile: a :class:`dflash_audit.profile.Profile`.
        ref: ``--ref`` as given (None = the lock's reference).
        reference_identity: an already resolved identity dict; else ``ref`` is resolved
            offline from the cache (a reference never resolved means no audit ran on it).
        reports_dir: where reports are looked up (named in the compare command).
        verifier: the training run's verifier, as the
            :class:`~dflash_audit.data.verifier.ResolvedVerifier` train resolved it to, or its
            ``--verifier`` spec (a folder, ``smollm2-135m``, ``family:NAME`` or a
            config.json); None leaves the verifier unchecked.

    Raises:
        GateError: the reference cannot be resolved offline, or the verifier's config
            cannot be read (exit code 2).
        ValueError: no ``identity`` for a candidate other than ours (a caller's mistake).
    """
    from dflash_audit.audit.sides.launch import identity_fingerprint
    from dflash_audit.candidate import DrafterCandidate, is_our_drafter
    from dflash_audit.report.fingerprint import candidate_source_files, reference_key

    if identity is None:
        if not is_our_drafter(candidate_spec):
            raise ValueError(f"expected_for: candidate {candidate_spec!r} needs its identity "
                             "from its own process (load_candidate_identity)")
        identity = {"source_files": [str(f) for f in
                                     candidate_source_files(DrafterCandidate())]}
    spec = getattr(verifier, "spec", verifier)
    command = compare_command(ref, profile.source or profile.name, candidate_spec, reports_dir,
                              spec)
    if reference_identity is None:
        from dflash_audit.reference_source import (
            ReferenceSourceError,
            resolve_reference,
        )

        try:
            reference_identity = resolve_reference(ref, offline=True).to_dict()
        except ReferenceSourceError as exc:
            raise GateError(
                f"the reference {ref or '(lock default)'} is not available locally, so it was "
                f"never audited here ({exc}).\nRun the audit first:\n  {command}") from None
    profile_fp = profile.fingerprint()
    verifier_fp = _verifier_fingerprint(verifier, profile) if verifier else None
    audited = identity_fingerprint(identity, candidate_spec, profile_fp)
    return Expected(candidate_fingerprint=audited["fingerprint"], profile_fingerprint=profile_fp,
                    reference_key=reference_key(reference_identity), compare_command=command,
                    verifier_fingerprint=verifier_fp, verifier_name=spec or "",
                    candidate_files=audited["files"])


def _verifier_fingerprint(spec: Any, profile: Any = None) -> str:
    """Architecture fingerprint of a verifier's config (no weights loaded): a
    ``ResolvedVerifier`` (not resolved again) or a ``--verifier`` spec; with
    ``profile``, its target layers are checked against the verifier's depth first, with the
    message compare gives (no compare command: compare would refuse the same profile).

    Raises:
        GateError: the config cannot be read, or the profile names layers it does not have.
    """
    from dflash_audit.data.errors import VerifierError
    from dflash_audit.data.verifier import ResolvedVerifier, resolve_verifier_path
    from dflash_audit.profile import ProfileError
    from dflash_audit.report.fingerprint import verifier_fingerprint

    try:
        from transformers import AutoConfig

        folder = spec.folder if isinstance(spec, ResolvedVerifier) else \
            resolve_verifier_path(spec, progress=None)[1]
        config = AutoConfig.from_pretrained(folder)
        spec = getattr(spec, "spec", spec)
    except (VerifierError, OSError, ValueError) as exc:
        raise GateError(f"cannot read the config of verifier {spec!r}: {exc}") from None
    if profile is not None:
        layers = getattr(getattr(config, "text_config", None) or config, "num_hidden_layers", 0)
        try:
            profile.resolve_target_layer_ids(int(layers))
        except ProfileError as exc:
            raise GateError(f"profile {profile.name}: {exc} (verifier {spec}); fix the "
                            "profile's target_layers: neither compare nor train can run it "
                            "with this verifier") from None
    return verifier_fingerprint(config)


def differences(report: ReportFields, expected: Expected) -> list[str]:
    """Which of candidate / profile / reference differ, each as one explanatory line."""
    from dflash_audit.report.fingerprint import reference_key

    out = []
    one, two = report.candidate_files, expected.candidate_files  # equal files: the profile
    changed = [] if one is None or two is None else sorted(k for k in one.keys() | two.keys()
                                                           if one.get(k) != two.get(k))
    if report.candidate_fingerprint != expected.candidate_fingerprint and (changed or not one or (
            report.profile_fingerprint == expected.profile_fingerprint)):
        code = (f"its files differ: {', '.join(changed[:4])}" if changed else
                "its code or the profile changed since the audit")
        out.append(f"candidate differs: the report audited {report.candidate_name or 'a candidate'}"
                   f" with fingerprint {report.candidate_fingerprint[:12]}, this run trains "
                   f"{expected.candidate_fingerprint[:12]} ({code})")
    if report.profile_fingerprint != expected.profile_fingerprint:
        out.append(f"profile differs: the report used profile {report.profile_name or '?'} "
                   f"({report.profile_fingerprint[:12]}), this run uses "
                   f"{expected.profile_fingerprint[:12]}")
    got = reference_key(report.reference)
    if got != expected.reference_key:
        changed = {k: (got.get(k), v) for k, v in expected.reference_key.items()
                   if got.get(k) != v}
        detail = ", ".join(f"{k}: report {a!r} vs now {b!r}" for k, (a, b) in changed.items())
        out.append(f"reference differs: {detail}")
    if expected.verifier_fingerprint and expected.verifier_fingerprint not in (
            report.verifiers or {}):
        names = sorted({str(v.get("name")) for v in (report.verifiers or {}).values()})
        out.append(f"verifier not covered: this run trains with verifier "
                   f"{expected.verifier_name} (architecture {expected.verifier_fingerprint[:12]})"
                   f", the report audited {', '.join(names) if names else 'no recorded verifier'}")
    return out


def _integrity_ok(report: ReportFields) -> bool:
    from dflash_audit.report.fingerprint import report_fingerprint

    return report.fingerprint == report_fingerprint(
        report.verdict, report.reference, report.candidate_fingerprint,
        report.profile_fingerprint, sorted(report.verifiers) if report.verifiers else None,
        report.canary)


def find_reports(reports_dir: Path) -> list[Path]:
    """``reports_dir/*/report.json``, newest first (by modification time)."""
    if not reports_dir.is_dir():
        return []
    found = [p for p in reports_dir.glob(f"*/{REPORT_FILE}") if p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def check_gate(expected: Expected, report: Path | None = None,
               reports_dir: Path = DEFAULT_REPORTS_DIR) -> GateResult:
    """Find a passing report for ``expected`` (``report`` if given, else the newest
    matching one in ``reports_dir``).

    Raises:
        GateError: see the module docstring for the message and exit code.
    """
    how = f"Produce the report with:\n  {expected.compare_command}"
    paths = [Path(report)] if report is not None else find_reports(Path(reports_dir))
    if report is not None and Path(report).is_dir():
        paths = [Path(report) / REPORT_FILE]
    if not paths:
        raise GateError(f"no audit report found in {reports_dir}/: training starts only after "
                        f"the candidate passed the audit (a report written with `compare --out "
                        f"DIR` is found with `train --reports-dir DIR` or `--report "
                        f"DIR/<run>/report.json`).\n{how}")
    first_mismatch: tuple[ReportFields, list[str]] | None = None
    skipped: list[str] = []  # while searching a folder: other tools' or unreadable reports
    for path in paths:
        if not path.is_file():
            raise GateError(f"audit report {path} {not_a_file(path)}.\n{how}")
        try:
            fields = read_report(path)
        except GateError as exc:
            if report is not None:
                raise
            skipped.append(str(exc))
            continue
        diffs = differences(fields, expected)
        if diffs:  # explain against the closest: fewest differences, a PASS, the newest
            if first_mismatch is None or (len(diffs), fields.verdict != "pass") < (
                    len(first_mismatch[1]), first_mismatch[0].verdict != "pass"):
                first_mismatch = (fields, diffs)
            continue
        if fields.signature_problem is not None:
            raise GateError(f"audit report {path} is not one this machine's `dflash-audit "
                            f"compare` wrote: {fields.signature_problem}; refusing it.\n{how}")
        if not _integrity_ok(fields):
            raise GateError(f"audit report {path} does not carry a valid fingerprint (edited by "
                            f"hand or written by another tool); refusing it.\n{how}")
        if fields.verdict == "pass" and fields.canary is None:
            raise GateError(f"audit report {path} records no canary case, so train cannot check "
                            "that the model it trains behaves as audited; refusing it. Rerun "
                            f"the audit with at least one real row (--rows 1):\n  "
                            f"{expected.compare_command}")
        if fields.verdict != "pass":
            raise GateError(
                f"the audit of this candidate, profile and reference FAILED ({path}, verdict "
                f"{fields.verdict!r}); fix the candidate (see {path.with_name('report.md')}) "
                f"and rerun:\n  {expected.compare_command}", exit_code=EXIT_AUDIT_FAILED)
        return GateResult(report_path=path, report_fingerprint=fields.fingerprint,
                          candidate_fingerprint=fields.candidate_fingerprint,
                          profile_fingerprint=fields.profile_fingerprint,
                          reference=fields.reference, canary=fields.canary)
    if first_mismatch is None:
        shown = "\n".join(f"  - {m}" for m in skipped[:3])
        raise GateError(f"no `dflash-audit compare` report in {reports_dir}/ ({len(skipped)} "
                        f"other or unreadable report(s) skipped):\n{shown}\n{how}")
    fields, diffs = first_mismatch
    which = "the given report" if report is not None else (
        f"the closest of its {len(paths) - len(skipped)} report(s) ({fields.path}, verdict "
        f"{fields.verdict.upper()}; the newest of those with the fewest differences)")
    listing = "\n".join(f"  - {d}" for d in diffs)
    raise GateError(f"no audit report matches this training run; {which} differs:\n{listing}\n"
                    f"{how}")
