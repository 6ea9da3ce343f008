#!/usr/bin/env python
"""The conformance matrix: every built-in framework adapter audited against the pinned
reference, as one markdown table (framework and version x check -> status and named cause).

Usage::

    python scripts/conformance_matrix.py [--cases N] [--rows R] [--profile P] [--seed S]
        [--offline] [--framework KEY ...] [--out matrix.md] [--reports DIR]
        [--readme README.md [--check]]

Each framework is one ``dflash-audit compare --candidate framework:KEY==VERSION`` (the
speculators adapter: ``framework:speculators==<the lock's version>``, its self-test) with the
given case counts and profile; each framework's latent differences (what it would do on input
it cannot express, :mod:`dflash_audit.audit.frameworks.latent`) are a row of warnings and one
line each under the table; adapters that land in ``dflash_audit/audit/frameworks/`` are
picked up
(:func:`dflash_audit.audit.frameworks.registry.available_adapters`), and known frameworks whose
adapter is not in this build get a row saying so. A framework that cannot be set up (exit 2)
gets a row with the setup error. ``--readme`` puts the table between the README's
``<!-- conformance-matrix:begin/end -->`` markers; ``--readme --check`` (CI) writes nothing and
fails when a verdict or status differs from the committed one. Exit code 0 when every row was
produced (whatever the verdicts), 1 on a stale README matrix under ``--check``, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ICON = {"pass": "✅", "fail": "❌", "warn": "⚠️"}
CELL = 90


def _cell(text: Any, limit: int = CELL) -> str:
    s = " ".join(str(text).split()).replace("|", "\\|")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def framework_specs(only: list[str] | None) -> list[tuple[str, str | None]]:
    """``(key, candidate spec | None)`` of every framework: None where its adapter is not in
    this build."""
    from dflash_audit.audit.frameworks.registry import KNOWN, SPECULATORS, available_adapters
    from dflash_audit.reference_source import load_lock

    found = available_adapters()
    rows: list[tuple[str, str | None]] = []
    for key, c in found.items():
        spec = (f"framework:{load_lock().spec}" if key == SPECULATORS
                else f"framework:{key}=={c['VERSION']}")
        rows.append((key, spec))
    rows += [(key, None) for key in KNOWN if key not in found]
    return [r for r in rows if not only or r[0] in only]


def audit(spec: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One compare of ``spec``: ``{"label", "verdict", "checks": {name: (status, cause)},
    "error", "latent"}`` (``latent``: the report's latent differences)."""
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.audit.options import CompareOptions
    from dflash_audit.audit.setup_error import CompareSetupError

    opts = CompareOptions(candidate=spec, cases=args.cases, rows=args.rows, offline=args.offline,
                          profile=args.profile, seed=args.seed, out=out, progress=False)
    try:
        outcome = run_compare(opts)
    except CompareSetupError as exc:
        return {"label": spec, "verdict": "setup error", "checks": {}, "error": str(exc)}
    report = outcome.report
    fw = report.candidate.get("framework") or {}
    checks, diagnoses = {}, report.diagnoses()  # root causes before their consequences
    for c in report.checks():
        named = [d["cause"] for d in diagnoses
                 if c["name"] in d["checks"] and d["status"] == c["status"]]
        cause = (named[0] if named else c["diagnosis"][0] if c["diagnosis"] else
                 (c["first_failure"] or {}).get("summary", "")) if c["status"] != "pass" else ""
        checks[c["name"]] = (c["status"], cause)
    return {"label": fw.get("label") or spec, "verdict": report.verdict, "checks": checks,
            "error": None, "folder": str(outcome.folder), "latent": list(report.latent)}


def render(rows: list[dict[str, Any]], check_names: list[str]) -> str:
    """The markdown table: one row per check (the verdict first, then how many latent
    differences each framework has), one column per framework; a cell is the status and,
    where it is not a pass, the first named cause. After it, one line per latent difference
    (in full: what the framework would do, where in its code) and per setup error."""

    def latent_cell(r: dict[str, Any]) -> str:
        if "latent" not in r:  # no report (not available, setup error)
            return "—"
        n = len(r["latent"])
        return f"{ICON['warn']} {n} (warnings)" if n else "none"

    lines = ["| check | " + " | ".join(_cell(r["label"], 60) for r in rows) + " |",
             "|---|" + "---|" * len(rows),
             "| **verdict** | " + " | ".join(f"**{r['verdict']}**" for r in rows) + " |",
             "| **latent differences** | " + " | ".join(latent_cell(r) for r in rows) + " |"]
    for name in check_names:
        cells = []
        for r in rows:
            status, cause = r["checks"].get(name, ("", ""))
            cells.append((f"{ICON.get(status, '')} {status}" + (f": {_cell(cause)}" if cause
                                                               else "")) if status else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    latent = [f"- {ICON['warn']} {' '.join(str(d['text']).split())}"
              for r in rows for d in r.get("latent") or []]
    notes = [f"- {r['label']}: {_cell(r['error'], 400)}" for r in rows if r.get("error")]
    if latent:
        latent = ["", "Latent differences: what each framework would do on input it cannot "
                  "express (warnings, not counted in the verdict):", "", *latent]
    return "\n".join(lines + latent + ([""] + notes if notes else [])) + "\n"


BEGIN, END = "<!-- conformance-matrix:begin -->", "<!-- conformance-matrix:end -->"


def _statuses(table: str) -> list[list[str]]:
    """Each row's label and cell statuses (the words before a cell's ':'), causes left out."""
    rows = []
    for line in table.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append([cells[0]] + [c.split(":")[0] for c in cells[1:]])
    return rows


def update_readme(readme: Path, table: str, check: bool) -> int:
    """Put ``table`` between the README's matrix markers. ``check``: write nothing; 1 when a
    verdict, a status or a framework differs from the README's (the causes' wording may
    change without failing: it is printed), 0 otherwise. 2 when the markers are missing."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"{readme}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    if not check:
        readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")
        return 0
    if old.strip() == table.strip():
        print(f"conformance_matrix: {readme}'s matrix is current", file=sys.stderr)
        return 0
    import difflib

    sys.stderr.writelines(difflib.unified_diff(old.strip().splitlines(True),
                                               table.strip().splitlines(True),
                                               f"{readme} (committed)", "regenerated"))
    if _statuses(old) != _statuses(table):
        print(f"\nconformance_matrix: {readme}'s matrix is stale (a verdict, status or "
              "framework differs): run python scripts/conformance_matrix.py --readme "
              f"{readme} and commit it", file=sys.stderr)
        return 1
    print(f"\nconformance_matrix: only the causes' wording differs from {readme}'s matrix",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conformance_matrix.py", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--cases", type=int, default=4, help="synthetic cases per framework")
    parser.add_argument("--rows", type=int, default=0, help="real rows per framework")
    parser.add_argument("--profile", default="reference-model", help="the audit profile")
    parser.add_argument("--seed", type=int, default=0, help="the cases' seed")
    parser.add_argument("--offline", action="store_true", help="use only the caches")
    parser.add_argument("--framework", action="append", default=None,
                        help="only this framework key (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--readme", type=Path, default=None,
                        help="replace the table between the matrix markers of this file")
    parser.add_argument("--check", action="store_true",
                        help="with --readme: write nothing, exit 1 when its matrix is stale")
    parser.add_argument("--reports", type=Path, default=None,
                        help="keep each framework's report folder here (default: discarded)")
    args = parser.parse_args(argv)
    from dflash_audit.audit.checks import REGISTRY

    specs = framework_specs(args.framework)
    if not specs:
        print(f"no framework matches {args.framework}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="dflash-audit-matrix-") as tmp:
        for key, spec in specs:
            if spec is None:
                rows.append({"label": key, "verdict": "not available in this build",
                             "checks": {}, "error": None})
                continue
            print(f"conformance_matrix: auditing {spec}", file=sys.stderr)
            rows.append(audit(spec, args, args.reports or Path(tmp)))
    names = [c.name for c in REGISTRY]
    names += sorted({n for r in rows for n in r["checks"] if n not in names})
    text = render(rows, names)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return update_readme(args.readme, text, args.check) if args.readme else 0


if __name__ == "__main__":
    sys.exit(main())
