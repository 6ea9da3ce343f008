"""The conformance report: what one ``dflash-audit compare`` run found, in one object.

``report.json`` is :meth:`Report.to_dict`; its fields (``schema_version`` 1):

- ``schema_version``: 1; ``tool``: ``{"name": "dflash-audit", "version"}``.
- ``verdict``: ``"pass"`` (no check failed on any case; warnings allowed) or ``"fail"``;
  ``exit_code``: 0 pass, 1 fail.
- ``fingerprint``: sha256 of verdict + reference key + candidate fingerprint + profile
  fingerprint + covered verifiers + the canary entry (:mod:`dflash_audit.report.fingerprint`);
  ``created_at``: UTC ISO time; ``signature`` (added by the JSON writer): HMAC-SHA256 of the
  whole report under this machine's report key.
- ``reference``: the resolved identity (kind, spec, url, ref, ref_kind, commit, commit_date,
  describe, sdist_sha256, sdist_filename, version, short_id, resolved_at, source_dir) plus
  ``module_file`` (where the reference process imported speculators from) and ``cache``
  (the reference cache, :mod:`dflash_audit.audit.sides.reference_cache`: ``read``,
  ``key_id`` of the key its records were checked against, ``from_cache`` (a count),
  ``cases``: {case: {"outputs": "cache" | "run", "record": key}}, ``ignored``: {case: why})
  and ``import_check`` (``from_cache``: the passed import check came from its signed record,
  ``record``: its key, ``ignored``: why a record found was not trusted).
- ``candidate``: ``{"name", "spec", "fingerprint", "files": {name: sha256}, "sandbox":
  {"sandboxed", "tool", "bwrap" (its path), "version", "proof": {property: {"ok",
  "evidence"}} (what the sandbox proved from inside before the candidate ran:
  :mod:`dflash_audit.audit.sides.sandbox_proof`), "note"}, "framework": {...} (an audited
  framework), "canary": {...} (after a PASS), "processes": the candidate processes the audit
  started (1: loaded once, its cases run in the same process; more after a crash, a timeout,
  without a sandbox, or when a case's verifier folder had to be bound)}``.
- ``profile``: ``{"name", "source", "fingerprint", "fields": {every profile field}}``.
- ``verifiers``: ``{verifier fingerprint: {"name", "architecture"}}``, every verifier the audit
  covered (the real one and each synthetic family proxy); the gate refuses to train with
  a verifier not listed.
- ``inputs``: verifier identity, data identity, seq_len, rows, target_layer_ids,
  mask_token_id (+ reason), audited anchors, batch cache key / hit, synthetic case count,
  seed, number of cases, ``case_cache`` (:mod:`dflash_audit.audit.cases.case_records`:
  ``read``, ``from_cache``, ``record``, ``ignored``, ``note``; absent with ``--weights``).
- ``checks``: one entry per check name aggregated over cases: ``name``, ``status``,
  ``cases``, ``passed``, ``failed``, ``warned``, ``worst_max_abs_diff`` / ``worst_abs_case``,
  ``worst_max_rel_diff`` / ``worst_rel_case``, ``tolerance``, ``summary``,
  ``first_failure`` (``case``, ``status``, ``summary``, ``first_diff``, ``candidate``,
  ``reference``) and ``diagnosis`` (distinct causes over its failing results).
- ``cases``: ``name``, ``kind`` (real | synthetic), ``description``, ``layout`` (layer
  types, window, B, T, A, documents...), ``status``, ``results`` (every
  :class:`~dflash_audit.audit.result.CheckResult` as a dict).
- ``diagnoses``: distinct likely causes over all non-passing results, failures first, root
  causes before consequences ("follows from ..."), then by frequency: ``cause``, ``status``,
  ``checks``, ``cases``, and ``per_case`` (case -> the cause with that case's numbers) where a
  cause carries per-case numbers (the same unexplained difference is one entry).
- ``timing``: seconds per stage (resolve_reference, batches, cases, write_cases,
  reference_cache, import_check, candidate, reference_wait, reference, checks) and ``total``.
- ``notes``: remarks (e.g. version-dependent metric definitions).
- ``latent``: an audited framework's latent differences (warnings that never change the
  verdict; :mod:`dflash_audit.audit.frameworks.latent`): what it would do on input it cannot
  express, one entry each: ``capability``, ``text`` (the one line every format shows),
  ``would``, ``source`` (``path:line`` in the framework's installed code), ``shows`` (what
  those lines contain), ``declared`` (False: its adapter did not say) and ``cases`` (the
  audit's cases that had such input and were cut or left out). Empty for other candidates.

Status order: ``fail`` > ``warn`` > ``pass``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dflash_audit import __version__
from dflash_audit.audit.result import (
    FAIL,
    PASS,
    WARN,
    CheckResult,
    cause_key,
    is_downstream,
    is_note,
)
from dflash_audit.report.fingerprint import report_fingerprint

SCHEMA_VERSION = 1
_RANK = {PASS: 0, WARN: 1, FAIL: 2}


def worst_status(statuses: list[str]) -> str:
    """``fail`` if any failed, else ``warn`` if any warned, else ``pass``."""
    return max(statuses, key=lambda s: _RANK.get(s, 2), default=PASS)


@dataclass
class CaseRecord:
    """One audited case and the check results on it."""

    name: str
    kind: str  # "real" | "synthetic"
    description: str
    layout: dict[str, Any]  # block_size, layer_types, sliding_window, T, A, documents, ...
    results: list[CheckResult] = field(default_factory=list)

    @property
    def status(self) -> str:
        return worst_status([r.status for r in self.results])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "description": self.description,
                "layout": self.layout, "status": self.status,
                "results": [r.to_dict() for r in self.results]}


@dataclass
class MaskPicture:
    """Masks of one layer type on one case, for ``report.html`` (not written to JSON).

    ``candidate`` / ``reference``: ``[Q, T+Q]`` bool (True = may attend), or None when that
    side produced none. ``seq_len`` is T (where the block part of the columns starts).
    """

    case: str
    layer_type: str
    candidate: Any
    reference: Any
    seq_len: int
    block_size: int
    differs: bool


@dataclass
class Report:
    """Everything a report writer needs; see the module docstring for the JSON form."""

    reference: dict[str, Any]
    candidate: dict[str, Any]
    profile: dict[str, Any]
    inputs: dict[str, Any]
    cases: list[CaseRecord]
    created_at: str
    timing: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    masks: list[MaskPicture] = field(default_factory=list)
    #: verifier fingerprint -> {"name", "architecture"}: the verifiers the audit covered.
    verifiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: dtype, measured noise and derived tolerances (dflash_audit.audit.precision); {} in fp32
    tolerance: dict[str, Any] = field(default_factory=dict)
    #: a framework's latent differences (see the module docstring); warnings only
    latent: list[dict[str, Any]] = field(default_factory=list)

    # ----------------------------------------------------------------- verdict
    @property
    def results(self) -> list[CheckResult]:
        return [r for c in self.cases for r in c.results]

    @property
    def verdict(self) -> str:
        """``fail`` when any check failed on any case, no check ran, or every case was outside
        an audited framework's capabilities (no training step ran: warnings only), else
        ``pass``."""
        results = self.results
        if not results or any(r.status not in (PASS, WARN) for r in results):
            return "fail"
        if all(c.layout.get("unsupported") for c in self.cases):
            return "fail"
        return "pass"

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "pass" else 1

    @property
    def fingerprint(self) -> str:
        return report_fingerprint(self.verdict, self.reference,
                                  self.candidate.get("fingerprint", ""),
                                  self.profile.get("fingerprint", ""),
                                  sorted(self.verifiers) if self.verifiers else None,
                                  self.candidate.get("canary"))

    # ------------------------------------------------------------- aggregation
    def checks(self) -> list[dict[str, Any]]:
        """One aggregated entry per check name, in the order the checks first ran."""
        by_name: dict[str, list[CheckResult]] = {}
        for r in self.results:
            by_name.setdefault(r.name, []).append(r)
        return [aggregate(name, rs) for name, rs in by_name.items()]

    def diagnoses(self) -> list[dict[str, Any]]:
        """Distinct causes named on failing (then warning) results: root causes before the
        consequences they explain ("follows from ..."), then most frequent first."""
        seen: dict[str, dict[str, Any]] = {}
        counts: Counter[str] = Counter()
        for r in self.results:
            if r.status == PASS:
                continue
            for full in r.diagnosis:
                cause = cause_key(full)  # one cause, one entry, whatever its per-case numbers
                entry = seen.setdefault(cause, {"cause": cause, "checks": [], "cases": [],
                                                "status": r.status})
                if r.name not in entry["checks"]:
                    entry["checks"].append(r.name)
                if r.case not in entry["cases"]:
                    entry["cases"].append(r.case)
                if full != cause:
                    entry.setdefault("per_case", {}).setdefault(r.case, full)
                if r.status == FAIL:
                    entry["status"] = FAIL
                counts[cause] += 1
        return sorted(seen.values(), key=lambda e: (e["status"] != FAIL,
                                                    is_downstream(e["cause"]),
                                                    is_note(e["cause"]),
                                                    -counts[e["cause"]]))

    def root_causes(self) -> list[dict[str, Any]]:
        """The named root causes of failing results (:meth:`diagnoses` without consequences,
        unexplained differences and their notes), grouped across cases, most frequent first."""
        return [d for d in self.diagnoses() if d["status"] == FAIL
                and not is_downstream(d["cause"]) and not is_note(d["cause"])]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "dflash-audit", "version": __version__},
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "fingerprint": self.fingerprint,
            "created_at": self.created_at,
            "reference": self.reference,
            "candidate": self.candidate,
            "profile": self.profile,
            "verifiers": self.verifiers,
            "inputs": self.inputs,
            "checks": self.checks(),
            "diagnoses": self.diagnoses(),
            "cases": [c.to_dict() for c in self.cases],
            "timing": {k: round(v, 3) for k, v in self.timing.items()},
            "notes": self.notes,
            "latent": self.latent,
            "tolerance": self.tolerance,
        }


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _worst(results: list[CheckResult], attr: str) -> tuple[float | None, str | None]:
    best: tuple[float | None, str | None] = (None, None)
    for r in results:
        value = getattr(r, attr)
        if isinstance(value, float) and math.isinf(value):
            return value, r.case
        v = _finite(value)
        if v is not None and (best[0] is None or v > best[0]):
            best = (v, r.case)
    return best


def aggregate(name: str, results: list[CheckResult]) -> dict[str, Any]:
    """Aggregate one check over cases (see the ``checks`` row of the module table)."""
    status = worst_status([r.status for r in results])
    counts = Counter(r.status for r in results)
    abs_diff, abs_case = _worst(results, "max_abs_diff")
    rel_diff, rel_case = _worst(results, "max_rel_diff")
    failing = next((r for r in results if r.status == FAIL), None) or next(
        (r for r in results if r.status == WARN), None)
    diagnosis: list[str] = []
    for r in results:
        if r.status != PASS:
            diagnosis.extend(d for d in r.diagnosis if d not in diagnosis)
    entry = {
        "name": name, "status": status, "cases": len(results), "passed": counts[PASS],
        "failed": counts[FAIL], "warned": counts[WARN],
        "worst_max_abs_diff": abs_diff, "worst_abs_case": abs_case,
        "worst_max_rel_diff": rel_diff, "worst_rel_case": rel_case,
        "tolerance": next((r.tolerance for r in results if r.tolerance), None),
        "summary": (failing or results[0]).summary,
        "first_failure": None, "diagnosis": diagnosis,
    }
    if failing is not None:
        entry["first_failure"] = {"case": failing.case, "status": failing.status,
                                  "summary": failing.summary, "first_diff": failing.first_diff,
                                  "candidate": failing.candidate, "reference": failing.reference}
    return entry
