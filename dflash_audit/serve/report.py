"""``serve-check``'s report: ``report.json``, ``report.md``, ``report.html`` (with the
served and trained attention of each layer as pictures) and ``junit.xml``, the four files
``compare`` writes, in a new folder ``<out>/<UTC time>-serve-check-<engine>``."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from dflash_audit.serve.differences import DIFFERS, NOT_RUN, SAME, LayerRule, Row

PASS, FAIL = "pass", "fail"


@dataclass
class ServeReport:
    """Everything one ``serve-check`` found: the checkpoint, the engine and the sides
    (``sides``: label -> record dict), the field ``rows``, the per-layer ``rules``, the
    served-vs-trained ``drafting`` comparison where the engine drafts here, and notes."""

    checkpoint: str
    checkpoint_format: str
    engine: dict[str, Any]
    rows: list[Row]
    rules: list[LayerRule]
    sides: dict[str, Any] = field(default_factory=dict)
    drafting: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    created_at: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def differences(self) -> list[Row]:
        """Rows that change what is drafted."""
        return [r for r in self.rows if r.status == DIFFERS]

    @property
    def rule_differences(self) -> list[LayerRule]:
        """Layers whose serving attention differs from the training one."""
        return [r for r in self.rules if r.differences]

    @property
    def drafting_differs(self) -> bool:
        """The served draft logits of one step differ from the training forward's."""
        return bool(self.drafting and self.drafting.get("differs"))

    @property
    def verdict(self) -> str:
        """``fail`` when any difference can change what is drafted, else ``pass``."""
        return FAIL if (self.differences or self.rule_differences or self.drafting_differs) \
            else PASS

    @property
    def exit_code(self) -> int:
        """0 pass, 1 train-serve differences."""
        return 1 if self.verdict == FAIL else 0

    def summary_lines(self) -> list[str]:
        """One line per finding (causes first, then attention rules), for the terminal."""
        out = [f"DIFFERS [{r.name}] {r.message}" + (f"\n  fix: {r.fix}" if r.fix else "")
               for r in self.differences]
        out += [f"DIFFERS [attention, layer {r.layer}] {'; '.join(r.differences[:3])}"
                + (f" (+{len(r.differences) - 3} more)" if len(r.differences) > 3 else "")
                for r in self.rule_differences]
        if self.drafting_differs:
            out.append(f"DIFFERS [draft logits] {self.drafting.get('message', '')}")
        d = self.drafting or {}
        if "acceptance_served" in d:
            out.append(f"acceptance length on {d['acceptance_prompts']} held-out prompts: "
                       f"served by {d['engine']} {d['acceptance_served']:.3f}, training-time "
                       f"teacher-forced estimate {d['acceptance_trained_teacher_forced']:.3f}")
        out += [f"warn [{r.name or r.key}] {r.message}" for r in self.rows if r.status == "warn"]
        out += [f"not run [{r.key}] {r.message}" for r in self.rows if r.status == NOT_RUN]
        return out

    def to_dict(self) -> dict[str, Any]:
        """``report.json``."""
        return {"kind": "dflash-audit serve-check", "schema_version": 1,
                "verdict": self.verdict, "created_at": self.created_at,
                "checkpoint": self.checkpoint, "checkpoint_format": self.checkpoint_format,
                "engine": self.engine,
                "findings": sorted({r.name for r in self.differences}
                                   | ({"attention"} if self.rule_differences else set())),
                "rows": [r.to_dict() for r in self.rows],
                "attention": [r.to_dict() for r in self.rules],
                "drafting": self.drafting, "notes": self.notes, "sides": self.sides}


def _cell(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text.replace("|", "\\|")


def render_markdown(report: ServeReport) -> str:
    """A PR comment: verdict, findings, the attention rule per layer, then every field."""
    e = report.engine
    lines = [f"# serve-check ({e['label']}): {report.verdict.upper()}", "",
             f"- checkpoint: `{report.checkpoint}` ({report.checkpoint_format} format)",
             f"- engine: {e['label']} ({', '.join(e.get('requirements', []))}; adapter "
             f"`{e.get('adapter', '')}`)",
             "- trained as: " + ", ".join(s for s in report.sides if s != e["label"])]
    findings = report.summary_lines()
    if findings:
        lines += ["", "## Findings", ""] + [f"- {f}".replace("\n  fix:", "<br>fix:")
                                            for f in findings]
    lines += ["", "## Attention of one drafting step (offsets from the anchor a)", "",
              "| layer | slot | trained: context | served: context | trained: slots | "
              "served: slots |", "|---|---|---|---|---|---|"]
    for r in report.rules:
        if r.served is None:
            lines.append(f"| {r.layer} | - | - | {r.served_from} | - | - |")
            continue
        for s, (tc, sc) in enumerate(zip(r.trained["context"], r.served["context"],
                                         strict=True)):
            lines.append(f"| {r.layer} | {s} | {_cell(tc)} | {_cell(sc)} | "
                         f"{_cell(r.trained['slots'][s])} | {_cell(r.served['slots'][s])} |")
    if report.drafting:
        lines += ["", "## Drafting on this machine", ""]
        lines += [f"- {k}: {_cell(v)}" for k, v in report.drafting.items()]
    lines += ["", "## Fields", "", "| status | field | trained | served | engine's code |",
              "|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r.status} | {r.key} | {_cell(r.trained)} | {_cell(r.served)} | "
                     f"{_cell(r.served_source or r.message)} |")
    if report.notes:
        lines += ["", "## Notes (how each side was read)", ""]
        lines += [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def render_html(report: ServeReport) -> str:
    """One self-contained page; each layer's served and trained block masks as pictures."""
    from dflash_audit.report.html import mask_figures
    from dflash_audit.report.schema import MaskPicture

    color = {DIFFERS: "#c62828", SAME: "#2e7d32", "warn": "#ef6c00"}
    head = "".join(f"<li>{html.escape(line)}</li>" for line in report.summary_lines())
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in report.notes)
    rows = "".join(
        f"<tr><td style='color:{color.get(r.status, '#555')}'><b>{r.status}</b></td>"
        f"<td>{html.escape(r.key)}</td><td>{html.escape(_cell(r.trained))}</td>"
        f"<td>{html.escape(_cell(r.served))}</td><td>{html.escape(r.served_source)}</td>"
        f"<td>{html.escape(r.message)}</td></tr>" for r in report.rows)
    figures = "".join(
        mask_figures(MaskPicture(case=f"layer {r.layer}", layer_type="one block",
                                 candidate=r.served_rows, reference=r.trained_rows,
                                 seq_len=r.total_seq_len, block_size=len(r.trained["slots"]),
                                 differs=bool(r.differences)), labels=("served", "trained"))
        + f"<p>{html.escape(r.served_from)}</p>" for r in report.rules)
    title = f"serve-check ({report.engine['label']}): {report.verdict.upper()}"
    verdict_color = "#c62828" if report.verdict == FAIL else "#2e7d32"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            "</title></head><body style='font-family:sans-serif'>"
            f"<h1 style='color:{verdict_color}'>{html.escape(title)}</h1>"
            f"<p>{html.escape(report.checkpoint)} ({report.checkpoint_format})</p>"
            f"<ul>{head}</ul><h2>Attention of one drafting step</h2>{figures}"
            "<h2>Fields</h2><table border='1' cellpadding='4' style='border-collapse:collapse'>"
            "<tr><th>status</th><th>field</th><th>trained</th><th>served</th><th>engine's code"
            f"</th><th>why</th></tr>{rows}</table><h2>Notes (how each side was read)</h2>"
            f"<ul>{notes}</ul></body></html>\n")


def render_junit(report: ServeReport) -> str:
    """One testcase per field and per layer rule."""
    cases = [(f"serve-check.{report.engine['key']}", r.key, r.status == DIFFERS, r.message,
              r.status == NOT_RUN) for r in report.rows]
    cases += [(f"serve-check.{report.engine['key']}.attention", f"layer {r.layer}",
               bool(r.differences), "; ".join(r.differences), r.served is None)
              for r in report.rules]
    suite = ET.Element("testsuite", name="dflash-audit serve-check", tests=str(len(cases)),
                       failures=str(sum(c[2] for c in cases)),
                       skipped=str(sum(c[4] and not c[2] for c in cases)))
    for classname, name, failed, message, skipped in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        if failed:
            ET.SubElement(case, "failure", message=name).text = message
        elif skipped:
            ET.SubElement(case, "skipped", message=message or "not run here")
    return ET.tostring(suite, encoding="unicode") + "\n"


def write_report(report: ServeReport, out_dir: str | Path) -> Path:
    """Write the four files into a new folder; returns it (``OSError`` when unwritable)."""
    from dflash_audit.report import write_report_texts

    return write_report_texts(out_dir, f"serve-check-{report.engine['key']}", {
        "report.json": json.dumps(report.to_dict(), indent=2, default=str),
        "report.md": render_markdown(report), "report.html": render_html(report),
        "junit.xml": render_junit(report)})
