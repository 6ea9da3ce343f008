"""``report.md``: a summary that fits a pull-request comment or a job summary.

Verdict line first (``## dflash-audit compare: PASS|FAIL``), then what was compared, a
table of checks aggregated over cases with the worst differences, the diagnoses, the
failing cases (capped), the reference identity and timings. Long text is truncated so the
whole file stays well under GitHub's 65,536-character comment limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_audit.report.schema import Report

MAX_FAILING_ROWS = 25
MAX_DIAGNOSES = 15
MAX_CELL = 160
ICON = {"pass": "✅", "fail": "❌", "warn": "⚠️"}


def _cell(text: Any, limit: int = MAX_CELL) -> str:
    s = " ".join(str(text).split()).replace("|", "\\|")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def fmt_num(x: Any) -> str:
    """A diff value for a table: ``—`` for none, 3 significant digits otherwise."""
    if x is None:
        return "—"
    if isinstance(x, (int, float)):
        return f"{x:.3g}"
    return _cell(x, 24)


def verdict_line(report: Report) -> str:
    """``## dflash-audit compare: ✅ PASS`` (or ``❌ FAIL``)."""
    v = report.verdict
    return f"## dflash-audit compare: {ICON[v]} {v.upper()}"


def reference_rows(ref: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, value) rows that identify the reference: spec, url/ref/commit or sdist sha256,
    version, dates."""
    rows = [("spec", f"`{ref.get('spec')}`"), ("kind", str(ref.get("kind")))]
    for key, label in (("url", "url"), ("ref", "ref"), ("ref_kind", "ref kind"),
                       ("commit", "commit"), ("commit_date", "commit date"),
                       ("describe", "describe"), ("sdist_filename", "sdist"),
                       ("sdist_sha256", "sdist sha256"), ("version", "version"),
                       ("dirty", "uncommitted changes"), ("resolved_at", "resolved at"),
                       ("module_file", "imported from")):
        value = ref.get(key)
        if value not in (None, ""):
            rows.append((label, f"`{value}`" if key in ("commit", "sdist_sha256", "url")
                         else _cell(value, 200)))
    return rows


def _what(report: Report) -> list[str]:
    ref, cand, prof, inp = report.reference, report.candidate, report.profile, report.inputs
    real = sum(c.kind == "real" for c in report.cases)
    synth = len(report.cases) - real
    ref_id = ref.get("commit") or ref.get("sdist_sha256") or ref.get("short_id") or ""
    lines = [
        f"**Candidate** {_cell(cand.get('name'))} (`{cand.get('spec') or 'default'}`, "
        f"fingerprint `{str(cand.get('fingerprint', ''))[:12]}`) vs **reference** "
        f"`{ref.get('spec')}` (`{str(ref_id)[:12]}`, "
        f"version {ref.get('version') or 'unknown'}) under "
        f"profile **{prof.get('name')}** (fingerprint `{str(prof.get('fingerprint', ''))[:12]}`).",
        "",
        f"{len(report.cases)} cases: {real} real "
        + (f"({_cell((inp.get('verifier') or {}).get('name'), 60)} × "
           f"{_cell((inp.get('data') or {}).get('source'), 60)}, T={inp.get('seq_len')}, "
           f"rows={inp.get('rows')}) " if real else "")
        + f"and {synth} synthetic; layer layouts audited: "
        f"{', '.join(sorted({c.layout.get('layout', '?') for c in report.cases}))}.",
    ]
    fields = prof.get("fields") or {}
    if fields:
        gamma = f", gamma {fields['gamma']:g}" if isinstance(fields.get("gamma"), (int, float)) \
            else ""
        lines += ["", f"Recipe audited: loss `{fields.get('loss')}`, weighting "
                  f"`{fields.get('weighting')}`{gamma}, block_size {fields.get('block_size')}, "
                  f"layers {fields.get('layer_layout')}, sample_from_anchor "
                  f"{fields.get('sample_from_anchor')}"
                  + (f" ({_cell(fields['description'], 200)})" if fields.get("description")
                     else "") + "."]
        if fields.get("target_layers_origin"):  # a drafter config's ids: read, or computed
            lines += ["", f"Target layer ids {fields.get('target_layers')}: "
                      f"{_cell(fields['target_layers_origin'], 300)}."]
    if inp.get("weights"):
        lines += ["", f"Real cases ran on the checkpoint weights in `{inp['weights']}` "
                  "(`--weights`); synthetic cases on seeded random weights."]
    return lines


def sandbox_rows(report: Report) -> tuple[str, list[tuple[str, str, str]]]:
    """What ``candidate.sandbox`` says: a one-line summary and ``(property, holds, evidence)``
    rows of what the sandbox proved from inside (none when the candidate ran without one)."""
    box = report.candidate.get("sandbox")
    if not isinstance(box, dict):
        return "", []
    if not box.get("sandboxed"):
        return f"Sandbox: none ({box.get('note') or 'candidate ran without a sandbox'}).", []
    proof = box.get("proof") if isinstance(box.get("proof"), dict) else {}
    rows = [(str(name).replace("_", " "), "yes" if (e or {}).get("ok") else "no",
             str((e or {}).get("evidence", ""))) for name, e in proof.items()]
    held = [name for name, ok, _ in rows if ok == "yes"]
    return (f"Sandbox: bubblewrap {box.get('version') or '?'} ({box.get('bwrap')}), proven from "
            f"inside before the candidate ran: {', '.join(held) or 'nothing'}."), rows


def framework_lines(report: Report) -> list[str]:
    """What an audit of a framework's own code says about the framework: which outputs its
    adapter (not the framework) computed, and the cases it does not support (plain text)."""
    fw = report.candidate.get("framework")
    if not fw:
        return []
    adapter = sorted(k for k, v in (fw.get("provenance") or {}).items() if v == "adapter")
    by_adapter = sorted({r.name for r in report.results
                         if (r.details or {}).get("provenance")})
    lines = [f"Framework audited: {fw.get('label')} ({fw.get('spec')}; "
             f"{fw.get('install') or (fw.get('source') or {}).get('source_dir') or ''})."]
    lines.append("Outputs computed by the adapter, not the framework: "
                 + (", ".join(adapter) if adapter else "none")
                 + (f" (checks marked: {', '.join(by_adapter)})" if by_adapter else "") + ".")
    unsupported = sum(1 for c in report.cases if c.layout.get("unsupported"))
    if unsupported:
        lines.append(f"{unsupported} case(s) not supported by {fw.get('label')}: only the "
                     "anchors and derivation checks ran on them.")
    lines += [n for n in report.notes if n.startswith("not supported by")
              or "takes one document per row" in n]
    return lines


def latent_lines(report: Report) -> list[str]:
    """One line per latent difference of an audited framework (``report.latent``): what it
    would do on input it cannot express, where in its code, and which of the audit's cases
    had such input (plain text; warnings that never change the verdict)."""
    lines = []
    for d in report.latent:
        cases = d.get("cases") or []
        lines.append(str(d.get("text")) + (
            f" [input of {len(cases)} audit case(s), cut or left out: "
            f"{', '.join(cases[:4])}{' ...' if len(cases) > 4 else ''}]" if cases else ""))
    return lines


def checks_table(report: Report) -> list[str]:
    """The table of checks aggregated over cases."""
    lines = ["| check | status | results ✓ / ✗ / ⚠ | worst max abs diff | worst max rel diff "
             "| first failure |", "|---|---|---|---|---|---|"]
    for c in report.checks():
        ff = c["first_failure"]
        first = f"`{ff['case']}`: {_cell(ff['summary'], 120)}" if ff else ""
        lines.append(
            f"| {c['name']} | {ICON.get(c['status'], '')} {c['status']} | {c['passed']} / "
            f"{c['failed']} / {c['warned']} | {fmt_num(c['worst_max_abs_diff'])} | "
            f"{fmt_num(c['worst_max_rel_diff'])} | {first} |")
    return lines


def tolerance_table(report: Report) -> list[str]:
    """The measured-noise tolerances of a non-fp32 audit (empty in fp32)."""
    tol = report.tolerance
    if not tol.get("quantities"):
        return []
    lines = [f"### Tolerances ({tol['dtype']}, from measured noise)", "",
             f"Per case, atol = max({tol['k']:g} × measured relative noise × the case's "
             f"magnitude, fp32 atol); measured: {tol['source']}.", "",
             "| quantity | measured max abs | measured max rel | atol (cases) | rtol |",
             "|---|---|---|---|---|"]
    lines += [f"| {q} | {fmt_num(v['measured_max_abs'])} | {fmt_num(v['measured_max_rel'])} | "
              f"{fmt_num(v['atol_min'])} – {fmt_num(v['atol_max'])} | {fmt_num(v['rtol'])} |"
              for q, v in tol["quantities"].items()]
    return [*lines, ""]


def _bullet(d: dict[str, Any]) -> str:
    cases = ", ".join(f"`{c}`" for c in d["cases"][:4])
    more = f" (+{len(d['cases']) - 4} more)" if len(d["cases"]) > 4 else ""
    numbers = "; numbers per case in report.json" if d.get("per_case") else ""
    return (f"- {ICON.get(d['status'], '')} {_cell(d['cause'], 300)} — checks: "
            f"{', '.join(d['checks'])}; cases: {cases}{more}{numbers}")


def root_cause_lines(report: Report) -> list[str]:
    """A FAIL's named root causes, grouped across cases, before anything else (empty on a
    pass or when no cause was named)."""
    roots = report.root_causes() if report.verdict == "fail" else []
    if not roots:
        return []
    return ["### Root causes", "", *(_bullet(d) for d in roots[:MAX_DIAGNOSES]),
            *([f"- … {len(roots) - MAX_DIAGNOSES} more in report.json"]
              if len(roots) > MAX_DIAGNOSES else []), ""]


def render_markdown(report: Report) -> str:
    """The text of ``report.md``: verdict, what was compared, a FAIL's named root causes, the
    framework an adapter drove (if any) and its latent differences, the checks, then the other
    diagnoses (consequences, unexplained differences, warnings)."""
    roots = root_cause_lines(report)
    fw = framework_lines(report)
    latent = latent_lines(report)
    summary, proof = sandbox_rows(report)
    out = [verdict_line(report), "", *_what(report), "",
           *([summary, ""] if summary else []),
           *(["<details><summary>What the sandbox proved</summary>", "",
              "| property | holds | evidence |", "|---|---|---|",
              *[f"| {name} | {ok} | {_cell(ev, 300)} |" for name, ok, ev in proof],
              "", "</details>", ""] if proof else []), *roots,
           *(["### Framework", "", *[f"- {_cell(line, 400)}" for line in fw], ""] if fw
             else []),
           *([f"### Latent differences ({len(latent)} warning(s): what the framework would do "
              "on input it cannot express; the verdict does not count them)", "",
              *[f"- {ICON['warn']} {_cell(line, 600)}" for line in latent], ""] if latent
             else []), "### Checks", "",
           *checks_table(report), "",
           "One result per case (per case and layer type for mask). A check passes when "
           "|c - r| <= atol + rtol·|r| everywhere, so a large relative diff on values near "
           "zero can pass.", "", *tolerance_table(report)]
    shown = {d["cause"] for d in report.root_causes()} if roots else set()
    diagnoses = [d for d in report.diagnoses() if d["cause"] not in shown]
    if diagnoses:
        out += ["### Diagnoses" if not roots else "### Consequences and other diagnoses", ""]
        for d in diagnoses[:MAX_DIAGNOSES]:
            out.append(_bullet(d))
        if len(diagnoses) > MAX_DIAGNOSES:
            out.append(f"- … {len(diagnoses) - MAX_DIAGNOSES} more in report.json")
        out.append("")
    failing = [(c, r) for c in report.cases for r in c.results if r.status != "pass"]
    if failing:
        out += [f"<details><summary>Failing / warning results ({len(failing)})</summary>", "",
                "| case | check | status | summary | first diff |", "|---|---|---|---|---|"]
        for case, r in failing[:MAX_FAILING_ROWS]:
            out.append(f"| `{case.name}` | {r.name} | {r.status} | {_cell(r.summary)} | "
                       f"{_cell(r.first_diff or '', 100)} |")
        if len(failing) > MAX_FAILING_ROWS:
            out.append(f"| … | | | {len(failing) - MAX_FAILING_ROWS} more in report.json | |")
        out += ["", "</details>", ""]
    out += ["### Reference", "", "| field | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in reference_rows(report.reference)]
    timing = report.timing
    if timing:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in timing.items() if k != "total")
        out += ["", f"Timing: total {timing.get('total', sum(timing.values())):.1f} s ({parts})."]
    for note in report.notes:
        if note not in fw:
            out.append(f"\n> {_cell(note, 400)}")
    out += ["", (f"<sub>report fingerprint `{report.fingerprint}` · {report.created_at} · "
                 "dflash-audit</sub>"), ""]
    return "\n".join(out)


def write_markdown(report: Report, folder: Path) -> Path:
    """Write ``folder/report.md``; returns its path."""
    path = Path(folder) / "report.md"
    path.write_text(render_markdown(report))
    return path
