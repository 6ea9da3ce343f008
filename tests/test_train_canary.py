"""The gate on a tiny verifier: the canary runs through train's own step on the very model
train trains; a build() that detects the audit, a report written by hand, stripped of its
signature, forged after an edit or without a canary are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import train_tiny as tt

from dflash_audit.train.gate import GateError
from dflash_audit.train.loop import train

ROOT = Path(__file__).resolve().parents[1]

#: run_case is our drafter's; build() returns the `<=` drafter unless the canary is on the
#: stack -- the old canary (a second build() in a rerun) was fooled by it -- or, with
#: SEALED = True, in the sealed canary's own process too (then train's process catches it).
STACK_DETECTOR = f'''
import inspect, sys
from dflash_audit.candidate import DrafterCandidate, load_candidate
le = load_candidate("{ROOT}/examples/candidates/context_rule_le.py:candidate")
SEALED = {{sealed}}
class C(DrafterCandidate):
    def run_case(self, *args):
        return DrafterCandidate().run_case(*args)
    def build(self, config):
        audited = any(f.function in ("verify_canary", "run_canary", "write_canary")
                      for f in inspect.stack()) or (SEALED and getattr(getattr(
            sys.modules["__main__"], "__spec__", None), "name", "").endswith("canary_runner"))
        return DrafterCandidate.build(self, config) if audited else le.build(config)
candidate = C
'''


@pytest.fixture(scope="module")
def paths(tiny_run):
    return tiny_run


def _train(paths, out: Path, **changes):
    return train(tt.tiny_config(paths, out, steps=2, **changes), reference_identity=tt.REFERENCE)


def test_the_canary_runs_on_the_trained_model(paths, tmp_path, capsys):
    summary = _train(paths, tmp_path / "ok")
    assert summary.step == 2
    assert "gives the audited loss and gradients" in capsys.readouterr().out


@pytest.mark.parametrize("sealed, where", [
    (False, "in a sandboxed process of the candidate"),  # before the import
    (True, "train's own step gives"),  # on the very model, after the import
])
def test_a_build_that_detects_the_canary_is_refused(paths, tmp_path, sealed, where):
    spec = tmp_path / "detector.py"
    spec.write_text(STACK_DETECTOR.format(sealed=sealed))
    reports = tmp_path / "reports"
    tt.write_report(reports, paths["profile"], f"{spec}:candidate",
                    canary_from=(paths["verifier"], paths["batches"]))
    with pytest.raises(GateError, match="does not behave as audited") as err:
        _train(paths, tmp_path / "run", candidate=f"{spec}:candidate",
               reports_dir=str(reports))
    assert err.value.exit_code == 2 and "grad." in str(err.value) and where in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def _report(paths, tmp_path: Path, **kw) -> Path:
    return tt.write_report(tmp_path / "reports", paths["profile"],
                           canary_from=(paths["verifier"], paths["batches"]), **kw)


@pytest.mark.parametrize("tamper, message", [
    ("strip", "carries no signature"),
    ("forge", "signature does not match its content"),
    ("no_canary", "records no canary case"),
    ("unsigned", "carries no signature"),
])
def test_train_refuses_forged_stripped_and_canaryless_reports(paths, tmp_path, tamper, message):
    from dflash_audit.report.fingerprint import report_fingerprint, sign_report

    path = _report(paths, tmp_path, verdict="fail" if tamper == "forge" else "pass",
                   sign=tamper != "unsigned")
    report = json.loads(path.read_text())
    if tamper == "strip":
        report.pop("signature")
    elif tamper == "forge":  # a FAIL turned into a PASS, its public fingerprint recomputed
        report["verdict"], report["exit_code"] = "pass", 0
        report["fingerprint"] = report_fingerprint(
            "pass", report["reference"], report["candidate"]["fingerprint"],
            report["profile"]["fingerprint"], list(report["verifiers"]),
            report["candidate"]["canary"])
    elif tamper == "no_canary":  # signed by the tool, but without a canary
        del report["candidate"]["canary"]
        report["fingerprint"] = report_fingerprint(
            "pass", report["reference"], report["candidate"]["fingerprint"],
            report["profile"]["fingerprint"], list(report["verifiers"]), None)
        report = sign_report({k: v for k, v in report.items() if k != "signature"})
    path.write_text(json.dumps(report))
    with pytest.raises(GateError, match=message) as err:
        _train(paths, tmp_path / "run", reports_dir=str(tmp_path / "reports"))
    assert err.value.exit_code == 2
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_swapped_canary_file_is_refused(paths, tmp_path):
    path = _report(paths, tmp_path)
    grads = path.parent / "canary" / "outputs" / "outputs.safetensors"
    grads.write_bytes(grads.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(GateError, match="does not match its sha256"):
        _train(paths, tmp_path / "run", reports_dir=str(tmp_path / "reports"))


def test_a_profile_layer_the_verifier_lacks_is_named_as_compare_names_it(paths, tmp_path):
    """Layer 99 of a 4-layer verifier: train names the layer (as compare does) instead of
    sending the user to a compare that exits 2."""
    profile = tt.write_profile(tmp_path / "deep.toml", target_layers=[1, 2, 99])
    with pytest.raises(GateError, match=r"ids \[99\] do not exist in a verifier with 4 layers"
                       ) as err:
        _train(paths, tmp_path / "run", profile=str(profile))
    assert "dflash-audit compare" not in str(err.value)
