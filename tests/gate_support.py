"""Runs of ``scripts/audit-gate.sh audit`` in a throwaway user repository (a git repository that
holds only a drafter file), as the GitHub Action runs it. Each run happens once per test
session and is shared by tests/test_action.py and tests/test_report_browser.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import git

from dflash_audit.limits import limit_s

ROOT = Path(__file__).resolve().parents[1]
GATE = ROOT / "scripts" / "audit-gate.sh"
# the smallest audit that still runs every check on both layer layouts: 2 synthetic cases
FAST_ARGS = "--cases 2 --rows 0"

# examples/user-repo/: a user's repository (a drafter file and the README's workflow); its
# drafter subclasses the shipped one and passes.
USER_REPO = ROOT / "examples" / "user-repo"
PASSING_DRAFTER = USER_REPO / "drafter.py"
# A drafter with a known bug (context rule kv <= anchor): mask, logits, loss, gradients fail.
FAILING_DRAFTER = ROOT / "examples" / "candidates" / "context_rule_le.py"

_RUNS: dict[str, GateRun] = {}


@dataclass
class GateRun:
    """One gate run: its exit code, output, job summary, step outputs and report folder."""

    rc: int
    stdout: str
    stderr: str
    summary: str
    outputs: dict[str, str]
    repo: Path
    report_dir: Path | None


def user_repo(path: Path, drafter_text: str) -> Path:
    """A git repository at ``path`` with one committed file, ``drafter.py``."""
    path.mkdir(parents=True)
    (path / "drafter.py").write_text(drafter_text)
    repo = git.Repo.init(path)
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "a dflash-audit user")
        cfg.set_value("user", "email", "user@example.invalid")
    repo.index.add(["drafter.py"])
    repo.index.commit("my drafter")
    return path


def _sandboxed() -> bool:
    from dflash_audit.audit.sides.sandbox import sandbox_status

    return sandbox_status().available


def run_gate(repo: Path, candidate: str, compare_args: str = FAST_ARGS,
             timeout_s: int = 900) -> GateRun:
    """``scripts/audit-gate.sh audit`` in ``repo`` with the Action's environment (GITHUB_*
    files in ``repo/../<name>-github``); the tool is this checkout (PYTHONPATH)."""
    github = repo.parent / f"{repo.name}-github"
    github.mkdir()
    summary, outputs = github / "step_summary.md", github / "output.txt"
    summary.touch()
    outputs.touch()
    env = {**os.environ, "GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary),
           "GITHUB_OUTPUT": str(outputs), "DFLASH_AUDIT_SOURCE": str(ROOT),
           "DFLASH_AUDIT_CANDIDATE": candidate, "DFLASH_AUDIT_PROFILE": "reference-model",
           "DFLASH_AUDIT_REF": "", "DFLASH_AUDIT_COMPARE_ARGS": compare_args,
           "DFLASH_AUDIT_OUT": "dflash-audit-report", "OMP_NUM_THREADS": "1",
           "DFLASH_AUDIT_REQUIRE_SANDBOX": "1" if _sandboxed() else "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.run(["bash", str(GATE), "audit"], cwd=repo, env=env, text=True,
                          capture_output=True, timeout=limit_s(timeout_s))
    out = dict(line.split("=", 1) for line in outputs.read_text().splitlines() if "=" in line)
    report_dir = out.get("report-dir") or None
    return GateRun(proc.returncode, proc.stdout, proc.stderr, summary.read_text(), out, repo,
                   (repo / report_dir) if report_dir else None)


def gate_run(kind: str, base: Path) -> GateRun:
    """The session's ``"pass"`` or ``"fail"`` run, made once per test session even when xdist
    spreads test_action.py and test_report_browser.py over several workers (a file lock in
    the session's shared base folder, above ``base``, a worker's; the others read its
    record)."""
    if kind not in _RUNS:
        from filelock import FileLock

        shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / (
            f"gate-run-{kind}")
        shared.mkdir(parents=True, exist_ok=True)
        record = shared / "run.json"
        with FileLock(str(shared) + ".lock"):
            if not record.is_file():
                text = (PASSING_DRAFTER if kind == "pass" else FAILING_DRAFTER).read_text()
                run = run_gate(user_repo(shared / "user-repo", text), "drafter.py:candidate")
                record.write_text(json.dumps({**dataclasses.asdict(run), "repo": str(run.repo),
                                              "report_dir": str(run.report_dir or "")}))
        data = json.loads(record.read_text())
        _RUNS[kind] = GateRun(**{**data, "repo": Path(data["repo"]),
                                 "report_dir": Path(data["report_dir"]) if data["report_dir"]
                                 else None})
    return _RUNS[kind]


def chromium() -> str | None:
    """The Chromium executable (Debian's ``chromium`` package), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None
