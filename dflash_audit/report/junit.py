"""``junit.xml``: one ``<testcase>`` per (check, case), for CI test reporters.

``classname`` is ``dflash_audit.<check>``, ``name`` is ``<check>[<case>]``. A failing result
carries ``<failure message="<summary>">`` whose text lists the values on both sides, the
diffs, the first differing coordinates and the diagnosis; a warning is a passing test case
with the same text in ``<system-out>`` (warnings never fail CI). An audited framework's
latent differences (``report.latent``) are passing test cases ``latent[<capability>:<n>]``
(classname ``dflash_audit.latent``) with ``WARN: <text>`` in ``<system-out>``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from dflash_audit.audit.result import FAIL, WARN, CheckResult
from dflash_audit.report.schema import Report


def _detail(r: CheckResult) -> str:
    lines = [r.summary]
    for label, value in (("candidate", r.candidate), ("reference", r.reference),
                         ("tolerance", r.tolerance), ("max abs diff", r.max_abs_diff),
                         ("max rel diff", r.max_rel_diff), ("first diff", r.first_diff)):
        if value not in (None, {}, []):
            lines.append(f"{label}: {value}")
    if r.diagnosis:
        lines.append("diagnosis:")
        lines += [f"  - {d}" for d in r.diagnosis]
    return "\n".join(lines)


def render_junit(report: Report) -> str:
    """The text of ``junit.xml``."""
    results = report.results
    failures = sum(r.status == FAIL for r in results)
    tests = len(results) + len(report.latent)
    suites = ET.Element("testsuites", name="dflash-audit", tests=str(tests),
                        failures=str(failures), errors="0",
                        time=f"{report.timing.get('total', 0.0):.3f}")
    suite = ET.SubElement(suites, "testsuite", name="dflash-audit compare",
                          tests=str(tests), failures=str(failures), errors="0",
                          skipped="0", timestamp=report.created_at,
                          time=f"{report.timing.get('total', 0.0):.3f}")
    props = ET.SubElement(suite, "properties")
    for name, value in (("verdict", report.verdict), ("fingerprint", report.fingerprint),
                        ("reference", report.reference.get("spec")),
                        ("reference_id", report.reference.get("commit")
                         or report.reference.get("sdist_sha256")),
                        ("candidate", report.candidate.get("name")),
                        ("candidate_fingerprint", report.candidate.get("fingerprint")),
                        ("profile", report.profile.get("name")),
                        ("profile_fingerprint", report.profile.get("fingerprint"))):
        ET.SubElement(props, "property", name=name, value=str(value))
    for case in report.cases:
        for r in case.results:
            tc = ET.SubElement(suite, "testcase", classname=f"dflash_audit.{r.name}",
                               name=f"{r.name}[{case.name}]", time="0")
            if r.status == FAIL:
                failure = ET.SubElement(tc, "failure", message=r.summary, type=r.name)
                failure.text = _detail(r)
            elif r.status == WARN:
                ET.SubElement(tc, "system-out").text = "WARN: " + _detail(r)
    seen: dict[str, int] = {}
    for d in report.latent:  # what the framework would do: a passing test case that warns
        key = str(d.get("capability"))
        seen[key] = seen.get(key, 0) + 1
        tc = ET.SubElement(suite, "testcase", classname="dflash_audit.latent",
                           name=f"latent[{key}:{seen[key]}]", time="0")
        cases = d.get("cases") or []
        ET.SubElement(tc, "system-out").text = "WARN: " + str(d.get("text")) + (
            f"\ncases with such input (cut or left out): {', '.join(cases)}" if cases else "")
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode")


def write_junit(report: Report, folder: Path) -> Path:
    """Write ``folder/junit.xml``; returns its path."""
    path = Path(folder) / "junit.xml"
    path.write_text(render_junit(report) + "\n")
    return path
