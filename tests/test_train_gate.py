"""The training gate: a passing report for the same candidate, profile and reference."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import train_tiny as tt

from dflash_audit.profile import Profile
from dflash_audit.train.gate import (
    EXIT_AUDIT_FAILED,
    EXIT_NO_MATCHING_REPORT,
    GateError,
    check_gate,
    compare_command,
    expected_for,
)


@pytest.fixture
def setup(tmp_path):
    profile_path = tt.write_profile(tmp_path / "tiny.toml")
    profile = Profile.load(str(profile_path))
    expected = expected_for(None, None, profile, "speculators==0.9.0",
                            reference_identity=tt.REFERENCE)
    return tmp_path, profile_path, expected


def test_passing_report_admits_and_names_its_fingerprint(setup):
    tmp, profile_path, expected = setup
    report = tt.write_report(tmp / "reports", profile_path)
    result = check_gate(expected, reports_dir=tmp / "reports")
    assert result.report_path == report
    assert result.report_fingerprint == json.loads(report.read_text())["fingerprint"]
    assert len(result.report_fingerprint) == 64
    meta = result.checkpoint_metadata()
    assert meta["dflash_audit_report_fingerprint"] == result.report_fingerprint
    # an explicit --report path (file or folder) works too
    assert check_gate(expected, report=report).report_path == report
    assert check_gate(expected, report=report.parent).report_path == report


def test_no_report_exit_2_with_compare_command(setup):
    tmp, profile_path, expected = setup
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    assert err.value.exit_code == EXIT_NO_MATCHING_REPORT == 2
    command = f"dflash-audit compare --ref speculators==0.9.0 --profile {profile_path}"
    assert command in str(err.value)
    assert expected.compare_command == command


def test_profile_difference_is_named(setup):
    tmp, profile_path, expected = setup
    other = tt.write_profile(tmp / "other.toml", gamma=7.0)
    tt.write_report(tmp / "reports", other)
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert "profile differs" in msg
    # the candidate fingerprint includes the profile's, but its files are the audited ones: only
    # the profile is named (a newcomer looked for a code change that did not happen)
    assert "candidate differs" not in msg
    assert "reference differs" not in msg
    assert expected.compare_command in msg


def test_a_refusal_explains_against_the_closest_report_not_the_newest(setup):
    """A newer FAIL of another candidate and profile must not be the report the refusal is
    explained against (a newcomer read "its code changed"): the closest one, a PASS that
    differs only by the profile, is."""
    tmp, profile_path, expected = setup
    other = tt.write_profile(tmp / "other.toml", gamma=7.0)
    close = tt.write_report(tmp / "reports", other, name="20260101T000000Z-ad5e21eedc89")
    far = tt.write_report(tmp / "reports", tt.write_profile(tmp / "far.toml", block_size=5),
                          "tests/test_compare.py:FcNMinusOne", verdict="fail",
                          name="20260102T000000Z-ad5e21eedc89")
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    msg = str(err.value)
    assert f"the closest of its 2 report(s) ({close}, verdict PASS" in msg, msg
    assert str(far) not in msg and "profile differs" in msg


def test_candidate_difference_is_named(setup):
    tmp, profile_path, expected = setup
    path = tt.write_report(tmp / "reports", profile_path)
    report = json.loads(path.read_text())
    report["candidate"]["fingerprint"] = "0" * 64
    path.write_text(json.dumps(report))
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    msg = str(err.value)
    assert "candidate differs" in msg and "000000000000" in msg
    assert "profile differs" not in msg and "reference differs" not in msg


def test_a_changed_candidate_file_is_named(setup):
    tmp, profile_path, expected = setup
    path = tt.write_report(tmp / "reports", profile_path)
    report = json.loads(path.read_text())
    name = sorted(report["candidate"]["files"])[0]
    report["candidate"]["files"][name] = "0" * 64
    report["candidate"]["fingerprint"] = "1" * 64
    path.write_text(json.dumps(report))
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    assert f"its files differ: {name}" in str(err.value), str(err.value)


def test_reference_difference_is_named(setup):
    tmp, profile_path, expected = setup
    other = {**tt.REFERENCE, "kind": "git", "ref": "main", "commit": "c05b95b" + "0" * 33,
             "sdist_sha256": None, "version": None}
    tt.write_report(tmp / "reports", profile_path, reference=other)
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    msg = str(err.value)
    assert "reference differs" in msg
    assert "kind: report 'git' vs now 'sdist'" in msg
    assert "candidate differs" not in msg and "profile differs" not in msg


def test_failed_audit_exit_1(setup):
    tmp, profile_path, expected = setup
    tt.write_report(tmp / "reports", profile_path, verdict="fail")
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    assert err.value.exit_code == EXIT_AUDIT_FAILED == 1
    assert "FAILED" in str(err.value) and expected.compare_command in str(err.value)


def test_hand_edited_verdict_is_refused(setup):
    tmp, profile_path, expected = setup
    path = tt.write_report(tmp / "reports", profile_path, verdict="fail")
    report = json.loads(path.read_text())
    report["verdict"] = "pass"  # fingerprint and signature still say "fail"
    path.write_text(json.dumps(report))
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    assert err.value.exit_code == 2 and "signature does not match" in str(err.value)
    # re-signed with this machine's key (same-user code can): the fingerprint still refuses
    from dflash_audit.report.fingerprint import sign_report

    path.write_text(json.dumps(sign_report({k: v for k, v in report.items()
                                            if k != "signature"})))
    with pytest.raises(GateError, match="valid fingerprint"):
        check_gate(expected, reports_dir=tmp / "reports")


def test_newest_matching_report_wins_over_newer_mismatch(setup):
    tmp, profile_path, expected = setup
    good = tt.write_report(tmp / "reports", profile_path, name="a-good")
    old = time.time() - 100
    os.utime(good, (old, old))
    tt.write_report(tmp / "reports", tt.write_profile(tmp / "b.toml", gamma=2.0), name="b-new")
    assert check_gate(expected, reports_dir=tmp / "reports").report_path == good


def test_unreadable_report(setup):
    tmp, _, expected = setup
    bad = tmp / "reports" / "x" / "report.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(GateError) as err:
        check_gate(expected, reports_dir=tmp / "reports")
    assert "cannot read audit report" in str(err.value) and err.value.exit_code == 2


def test_check_batches_and_broken_reports_in_the_folder_are_skipped(setup):
    """A check-batches report (or a truncated report.json) beside the compare reports does not
    block training; given explicitly, it is refused and named."""
    tmp, profile_path, expected = setup
    other = tmp / "reports" / "z-check-batches" / "report.json"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({"kind": "dflash-audit check-batches", "verdict": "pass"}))
    with pytest.raises(GateError) as err:  # only other tools' reports: none to admit
        check_gate(expected, reports_dir=tmp / "reports")
    assert err.value.exit_code == 2
    assert "no `dflash-audit compare` report in" in str(err.value)
    assert "'dflash-audit check-batches' report" in str(err.value)
    good = tt.write_report(tmp / "reports", profile_path, name="a-good")
    old = time.time() - 100
    os.utime(good, (old, old))  # the newer check-batches report is skipped
    assert check_gate(expected, reports_dir=tmp / "reports").report_path == good
    with pytest.raises(GateError) as err:
        check_gate(expected, report=other)
    assert "not a `dflash-audit compare` report" in str(err.value)
    huge = tmp / "reports" / "huge" / "report.json"
    huge.parent.mkdir()
    with huge.open("wb") as f:  # sparse: 65 MiB of nothing is not read into memory
        f.truncate(65 * 2**20)
    assert check_gate(expected, reports_dir=tmp / "reports").report_path == good
    with pytest.raises(GateError, match="huge/report.json is 65 MiB: not a `dflash-audit"):
        check_gate(expected, report=huge)


def test_compare_command_quotes_and_defaults():
    assert compare_command(None, "reference-model", None) == \
        "dflash-audit compare --profile reference-model"
    assert compare_command("speculators@main", "my profile.toml", "pkg.mod:Cand") == \
        "dflash-audit compare --ref speculators@main --profile 'my profile.toml' " \
        "--candidate pkg.mod:Cand"
    assert compare_command(None, "p.toml", None, Path("other")) == \
        "dflash-audit compare --profile p.toml --out other"


def test_verifier_the_report_did_not_cover_is_refused_with_its_compare_command(tmp_path):
    """The gate covers the verifier: a report lists the architectures it audited; training
    with another verifier (here a Gemma3-27B-style config.json) is refused with the compare
    command that would cover it, while one it covered is admitted."""
    from test_families import GEMMA3_27B

    profile_path = tt.write_profile(tmp_path / "tiny.toml")
    profile = Profile.load(str(profile_path))
    verifier = tt.make_verifier(tmp_path / "verifier")
    report = tt.write_report(tmp_path / "reports", profile_path)
    covered = expected_for(None, None, profile, "speculators==0.9.0",
                           reference_identity=tt.REFERENCE, verifier=str(verifier))
    assert check_gate(covered, reports_dir=tmp_path / "reports").report_path == report
    gemma = tmp_path / "gemma3-27b.json"
    gemma.write_text(json.dumps(GEMMA3_27B))
    other = expected_for(None, None, profile, "speculators==0.9.0",
                         reference_identity=tt.REFERENCE, verifier=str(gemma))
    with pytest.raises(GateError) as err:
        check_gate(other, reports_dir=tmp_path / "reports")
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert f"verifier not covered: this run trains with verifier {gemma}" in msg
    assert "the report audited tiny" in msg
    assert (f"dflash-audit compare --ref speculators==0.9.0 --profile {profile_path} "
            f"--verifier {gemma}") in msg
    # a verifiers list edited into the report breaks its fingerprint
    data = json.loads(report.read_text())
    data["verifiers"][other.verifier_fingerprint] = {"name": "forged"}
    report.write_text(json.dumps(data))
    with pytest.raises(GateError, match="signature does not match its content"):
        check_gate(other, reports_dir=tmp_path / "reports")


def test_the_default_audit_covers_its_real_verifier_and_the_family_proxies():
    """What compare records (a warm real-input namespace, the synthetic family configs) has the
    fingerprint the gate computes from the verifier's folder or family spec."""
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.audit.compare import covered_verifiers
    from dflash_audit.train.gate import _verifier_fingerprint

    profile = Profile.load("reference-model")
    covered = covered_verifiers(plan_synthetic_cases(profile, 8, seed=8))
    assert _verifier_fingerprint("family:gemma3_text") in covered
    assert _verifier_fingerprint("family:qwen3_5") in covered
    # the real verifier: a warm audit reads its config back as a namespace of to_dict()
    from types import SimpleNamespace

    from transformers import AutoConfig

    from dflash_audit.data.verifier import resolve_verifier_path
    from dflash_audit.report.fingerprint import verifier_fingerprint

    _, folder = resolve_verifier_path("smollm2-135m", progress=None)
    warm = SimpleNamespace(**AutoConfig.from_pretrained(folder).to_dict())
    assert verifier_fingerprint(warm) == _verifier_fingerprint("smollm2-135m")


def test_a_proxy_audit_covers_the_real_verifier_until_its_config_is_edited(tmp_path):
    """An audit through a proxy of a Phi-3 config.json (longrope factors resampled to the
    proxy's width) covers training with the real verifier folder of that config; the same
    folder with its config.json edited after the audit (another rope_theta) is refused."""
    import torch
    from safetensors.torch import save_file
    from test_families import PHI3_MINI_128K

    from dflash_audit.report.fingerprint import report_fingerprint, sign_report
    from dflash_audit.train.gate import _verifier_fingerprint

    profile_path = tt.write_profile(tmp_path / "tiny.toml")
    profile = Profile.load(str(profile_path))
    audited = tmp_path / "audited" / "config.json"
    audited.parent.mkdir()
    audited.write_text(json.dumps(PHI3_MINI_128K))
    report = tt.write_report(tmp_path / "reports", profile_path)
    data = json.loads(report.read_text())
    data["verifiers"] = {_verifier_fingerprint(str(audited)): {"name": "proxy:audited"}}
    data["fingerprint"] = report_fingerprint("pass", data["reference"],
                                             data["candidate"]["fingerprint"],
                                             data["profile"]["fingerprint"],
                                             list(data["verifiers"]),
                                             data["candidate"]["canary"])
    report.write_text(json.dumps(sign_report({k: v for k, v in data.items()
                                              if k != "signature"})))
    real = tmp_path / "Phi-3-mini-128k"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(PHI3_MINI_128K))
    save_file({"lm_head.weight": torch.zeros(1)}, real / "model.safetensors")  # config only read

    def gate():
        return check_gate(expected_for(None, None, profile, "speculators==0.9.0",
                                       reference_identity=tt.REFERENCE, verifier=str(real)),
                          reports_dir=tmp_path / "reports")

    assert gate().report_path == report
    (real / "config.json").write_text(json.dumps({**PHI3_MINI_128K, "rope_theta": 250000.0}))
    with pytest.raises(GateError, match=f"verifier not covered: this run trains with verifier "
                                        f"{real}.*the report audited proxy:audited") as err:
        gate()
    assert f"--verifier {real}" in str(err.value) and err.value.exit_code == 2
