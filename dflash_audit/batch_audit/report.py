"""Write a :class:`BatchReport` as ``report.json``, ``report.md``, ``report.html`` and
``junit.xml`` (the four files ``compare`` writes; the shapes differ, so these are small
writers of their own: one row per check, findings first)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from xml.etree import ElementTree as ET

from dflash_audit.batch_audit.result import FAIL, WARN, BatchReport, Check


def _ordered(report: BatchReport) -> list[Check]:
    rank = {FAIL: 0, WARN: 1, "skip": 2, "pass": 3}
    return sorted(report.checks, key=lambda c: rank.get(c.status, 3))


def render_markdown(report: BatchReport) -> str:
    """The report as Markdown: verdict, findings, context, then a table of every check."""
    lines = [f"# check-batches: {report.verdict.upper()}", "",
             f"- folder: `{report.folder}` ({report.format})",
             f"- verifier: {report.verifier.get('name')} (`{report.verifier.get('path')}`)",
             f"- rows checked: {', '.join(report.rows_checked)}"]
    lines += [f"- {k}: {v}" for k, v in report.context.items()]
    lines += [f"- **note**: {n}" for n in report.notes]
    if report.failures or report.warnings:
        lines += ["", "## Findings", ""]
        lines += [f"- **{c.finding or c.name}** ({c.row or 'folder'}, {c.status}): {c.message}"
                  for c in report.failures + report.warnings]
    lines += ["", "## Checks", "", "| status | check | row | result |", "|---|---|---|---|"]
    for c in _ordered(report):
        msg = c.message.replace("|", "\\|")
        lines.append(f"| {c.status} | {c.name} | {c.row or 'folder'} | {msg} |")
    return "\n".join(lines) + "\n"


def render_html(report: BatchReport) -> str:
    """The report as one self-contained HTML page."""
    color = {FAIL: "#c62828", "pass": "#2e7d32", "skip": "#757575", WARN: "#ef6c00"}
    rows = "".join(
        f"<tr><td style='color:{color.get(c.status, '#000')}'><b>{c.status}</b></td>"
        f"<td>{html.escape(c.name)}</td><td>{html.escape(c.row or 'folder')}</td>"
        f"<td>{html.escape(c.finding)}</td><td>{html.escape(c.message)}</td></tr>"
        for c in _ordered(report))
    ctx = "".join(f"<li>{html.escape(str(k))}: {html.escape(str(v))}</li>"
                  for k, v in report.context.items())
    ctx += "".join(f"<li><b>note</b>: {html.escape(n)}</li>" for n in report.notes)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>check-batches "
            f"{report.verdict}</title></head><body style='font-family:sans-serif'>"
            f"<h1 style='color:{color[report.verdict]}'>check-batches: "
            f"{report.verdict.upper()}</h1><p>{html.escape(report.folder)} ({report.format}), "
            f"verifier {html.escape(str(report.verifier.get('name')))}, rows "
            f"{html.escape(', '.join(report.rows_checked))}</p><ul>{ctx}</ul>"
            "<table border='1' cellpadding='4' style='border-collapse:collapse'><tr><th>status"
            "</th><th>check</th><th>row</th><th>finding</th><th>result</th></tr>"
            f"{rows}</table></body></html>\n")


def render_junit(report: BatchReport) -> str:
    """The report as JUnit XML: one testcase per check (failure / skipped)."""
    suite = ET.Element("testsuite", name="dflash-audit check-batches",
                       tests=str(len(report.checks)), failures=str(len(report.failures)),
                       skipped=str(sum(c.status == "skip" for c in report.checks)))
    if report.notes:
        props = ET.SubElement(suite, "properties")
        for n in report.notes:
            ET.SubElement(props, "property", name="note", value=n)
    for c in report.checks:
        case = ET.SubElement(suite, "testcase", classname=f"check-batches.{c.row or 'folder'}",
                             name=c.name)
        if c.status == FAIL:
            ET.SubElement(case, "failure", message=c.finding or c.name).text = c.message
        elif c.status == "skip":
            ET.SubElement(case, "skipped", message=c.message)
        elif c.status == WARN:  # a passing testcase whose output says why it warns
            ET.SubElement(case, "system-out").text = f"WARN [{c.finding}]: {c.message}"
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode") + "\n"


def write_report(report: BatchReport, out_dir: str | Path) -> Path:
    """Write the four files into a new folder ``<out_dir>/<UTC time>-check-batches``.

    Returns:
        The folder. Raises ``OSError`` when it cannot be written.
    """
    from dflash_audit.report import write_report_texts

    return write_report_texts(out_dir, "check-batches", {
        "report.json": json.dumps(report.to_dict(), indent=2, default=str),
        "report.md": render_markdown(report), "report.html": render_html(report),
        "junit.xml": render_junit(report)})
