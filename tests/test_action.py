"""The reusable GitHub Action (action.yml) and its script (scripts/audit-gate.sh).

No Actions runner is available here, so the script runs as the action runs it: in a throwaway
user repository that holds only a drafter file, with $GITHUB_STEP_SUMMARY and $GITHUB_OUTPUT
pointed at files. A conformant drafter passes (exit 0), a drafter with the ``kv <= anchor``
context rule fails (exit 1) with a one-line reason, a missing drafter file is a usage error
(exit 2). The static tests check that action.yml parses, that every input it declares reaches
the script or a step, and that the README's workflow uses only declared inputs."""

from __future__ import annotations

import re

import pytest
import yaml
from gate_support import GATE, ROOT, USER_REPO, gate_run, run_gate, user_repo

ACTION = ROOT / "action.yml"


def _action() -> dict:
    return yaml.safe_load(ACTION.read_text())


def _readme_workflow() -> dict:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Gate your own repository", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the README's gate section has one yaml workflow"
    return yaml.safe_load(blocks[0])


# ---------------------------------------------------------------------------- static
def test_action_yml_is_a_composite_action_with_the_declared_inputs():
    action = _action()
    assert action["runs"]["using"] == "composite"
    assert set(action["inputs"]) >= {"candidate", "profile", "ref", "compare-args",
                                     "python-version", "source"}
    uses = [s.get("uses", "").split("@")[0] for s in action["runs"]["steps"]]
    assert uses.count("actions/setup-python") == 1
    assert {"actions/cache/restore", "actions/cache/save", "actions/upload-artifact"} <= set(uses)
    for step in action["runs"]["steps"]:  # every run step is the plain script
        if "run" in step:
            assert step["shell"] == "bash"
            assert "scripts/audit-gate.sh" in step["run"], step["name"]


def test_every_declared_input_is_used():
    """Each input is read by a step; an input given to a run step through ``env`` is read by
    the script under that variable's name."""
    action, script = _action(), GATE.read_text()
    steps = action["runs"]["steps"]
    for name in action["inputs"]:
        pattern = re.compile(r"\$\{\{[^}]*\binputs\." + re.escape(name) + r"\b")
        users = [s for s in steps if pattern.search(yaml.safe_dump(s))]
        assert users, f"input {name!r} is declared but no step uses it"
        for step in users:
            for var, value in step.get("env", {}).items():
                if pattern.search(str(value)):
                    assert re.search(r"\$\{?" + var + r"\b", script), \
                        f"input {name!r} reaches ${var}, which scripts/audit-gate.sh never reads"
    env_vars = {v for s in steps for v in s.get("env", {})}
    read = set(re.findall(r"\$\{?(DFLASH_AUDIT_[A-Z_]+)", script))
    assert env_vars - {"DFLASH_AUDIT_CACHE"} <= read


def test_the_readme_workflow_uses_only_declared_inputs():
    workflow, declared = _readme_workflow(), set(_action()["inputs"])
    steps = [s for job in workflow["jobs"].values() for s in job["steps"]]
    gate = [s for s in steps if "dflash-audit" in s.get("uses", "")]
    assert len(gate) == 1
    assert set(gate[0]["with"]) <= declared
    assert "candidate" in gate[0]["with"]
    assert steps[0]["uses"].startswith("actions/checkout@")  # the drafter file must be there
    example = USER_REPO / ".github" / "workflows" / "dflash-audit.yml"
    assert yaml.safe_load(example.read_text()) == workflow, \
        "examples/user-repo's workflow is the README's"
    assert len(example.read_text().splitlines()) <= 16  # about a dozen lines


# ------------------------------------------------------------------- the script runs
@pytest.mark.reference
def test_gate_passes_a_conformant_drafter(tmp_path_factory):
    run = gate_run("pass", tmp_path_factory.getbasetemp())
    assert run.rc == 0, run.stdout + run.stderr
    reason = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"dflash-audit: PASS: my drafter conforms to speculators==0\.9\.0 "
                        r"\(\d+ checks, 2 cases\)", reason), reason
    assert "::error" not in run.stdout
    assert run.summary.startswith("## dflash-audit compare: ✅ PASS")
    assert "`drafter.py:candidate`" in run.summary and "| anchors | ✅ pass |" in run.summary
    assert run.outputs["exit-code"] == "0" and run.outputs["reason"] == reason
    assert run.report_dir is not None and run.report_dir.parent == run.repo / "dflash-audit-report"
    # a PASS also keeps the canary case that `train` reruns before step 1
    assert sorted(p.name for p in run.report_dir.iterdir()) == [
        "canary", "junit.xml", "report.html", "report.json", "report.md"]


@pytest.mark.reference
def test_gate_fails_a_drafter_with_a_bug_with_a_one_line_reason(tmp_path_factory):
    run = gate_run("fail", tmp_path_factory.getbasetemp())
    assert run.rc == 1, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    reason = lines[-2]  # then the same line as an Actions error annotation
    assert reason.startswith("dflash-audit: FAIL (exit 1): bug: context rule kv <= anchor vs "
                             "speculators==0.9.0: checks failed: mask, logits, loss, gradients")
    assert "; cause: context rule kv <= anchor" in reason
    assert lines[-1] == f"::error title=dflash-audit::{reason}"
    assert run.outputs["exit-code"] == "1" and run.outputs["reason"] == reason
    assert run.summary.startswith("## dflash-audit compare: ❌ FAIL")
    assert "context rule kv <= anchor" in run.summary
    assert (run.report_dir / "report.html").stat().st_size > 0
    assert (run.report_dir / "report.md").read_text() == run.summary


def test_gate_missing_drafter_is_a_usage_error(tmp_path):
    repo = user_repo(tmp_path / "user-repo", "")
    (repo / "drafter.py").unlink()
    run = run_gate(repo, "drafter.py:candidate", timeout_s=300)
    assert run.rc == 2, run.stdout + run.stderr
    reason = run.stdout.strip().splitlines()[-2]
    assert reason.startswith(f"dflash-audit: ERROR (exit 2): candidate file "
                             f"{repo.resolve() / 'drafter.py'} does not exist (")
    assert run.summary == f"## dflash-audit compare: no report\n\n{reason}\n"
    assert run.outputs["exit-code"] == "2" and run.outputs["report-dir"] == ""
    assert "Traceback" not in run.stdout + run.stderr


def test_gate_rejects_unbalanced_extra_arguments(tmp_path):
    repo = user_repo(tmp_path / "user-repo", "")
    run = run_gate(repo, "drafter.py:candidate", compare_args="--cases '2", timeout_s=60)
    assert run.rc == 2
    assert run.outputs["reason"] == ("dflash-audit: ERROR (exit 2): the extra compare arguments "
                                     "have unbalanced quotes: --cases '2")
    assert "Traceback" not in run.stdout + run.stderr


def test_gate_cache_key_follows_the_reference_lock(tmp_path):
    import subprocess

    def key(env: dict) -> str:
        out = subprocess.run(["bash", str(GATE), "cache-key"], env={"PATH": "/usr/bin:/bin",
                             "HOME": str(tmp_path), **env}, text=True, capture_output=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    base = key({"RUNNER_OS": "Linux"})
    assert re.fullmatch(r"dflash-audit-Linux-[0-9a-f]{16}", base)
    assert key({"RUNNER_OS": "Linux"}) == base
    assert key({"RUNNER_OS": "Linux", "DFLASH_AUDIT_REF": "speculators@main"}) != base
    src = tmp_path / "src"
    (src / "reference").mkdir(parents=True)
    (src / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (src / "reference" / "speculators.lock").write_text("[reference]\nversion = '9.9.9'\n")
    assert key({"RUNNER_OS": "Linux", "DFLASH_AUDIT_SOURCE": str(src)}) != base


def test_gate_usage(tmp_path):
    import subprocess

    out = subprocess.run(["bash", str(GATE)], text=True, capture_output=True)
    assert out.returncode == 2 and "usage: scripts/audit-gate.sh install|sandbox|cache-key|audit" in out.stderr



def test_this_projects_ci_runs_the_action_itself():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "audit.yml").read_text())
    steps = workflow["jobs"]["compare"]["steps"]
    gate = [s for s in steps if s.get("uses") == "./"]
    assert len(gate) == 1 and set(gate[0].get("with", {})) <= set(_action()["inputs"])


def test_install_refuses_a_folder_that_is_not_the_tool(tmp_path):
    import subprocess

    out = subprocess.run(["bash", str(GATE), "install"], env={
        "PATH": "/usr/bin:/bin", "DFLASH_AUDIT_SOURCE": str(tmp_path)}, text=True,
        capture_output=True)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"dflash-audit gate: {tmp_path} is not a dflash-audit source tree (no pyproject.toml or "
        "reference/speculators.lock); set DFLASH_AUDIT_SOURCE (action input 'source') to one.")
