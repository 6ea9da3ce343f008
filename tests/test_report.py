"""Report writers (json, md, html, junit), aggregation over cases and the fingerprints."""

from __future__ import annotations

import base64
import io
import json
import re
import xml.etree.ElementTree as ET

import pytest
import torch
from PIL import Image

from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.report import (
    REPORT_FILES,
    CaseRecord,
    MaskPicture,
    Report,
    write_report,
)
from dflash_audit.report.fingerprint import (
    candidate_fingerprint,
    candidate_source_files,
    reference_key,
    report_fingerprint,
)
from dflash_audit.report.html import render_html
from dflash_audit.report.junit import render_junit
from dflash_audit.report.markdown import render_markdown

REFERENCE = {"kind": "sdist", "spec": "speculators==0.9.0", "short_id": "ad5e21eedc89",
             "sdist_sha256": "ad5e21eedc89" + "0" * 52, "version": "0.9.0", "ref": "0.9.0",
             "resolved_at": "2026-08-01T10:00:00+00:00", "source_dir": "/cache/tree"}


def result(name, case, status, abs_diff=None, diagnosis=(), **kw) -> CheckResult:
    return CheckResult(name=name, case=case, status=status, summary=f"{name} {status} on {case}",
                       max_abs_diff=abs_diff, diagnosis=list(diagnosis), **kw)


def make_report(results_by_case: dict[str, list[CheckResult]], masks=()) -> Report:
    cases = [CaseRecord(name=n, kind="real" if n.startswith("real") else "synthetic",
                        description=f"case {n}", layout={"layout": "full"}, results=rs)
             for n, rs in results_by_case.items()]
    return Report(reference=dict(REFERENCE),
                  candidate={"name": "cand", "spec": None, "fingerprint": "c" * 64, "files": {}},
                  profile={"name": "reference-model", "fingerprint": "p" * 64, "fields": {}},
                  inputs={"verifier": {"name": "tiny"}, "data": {"source": "x.jsonl"},
                          "seq_len": 64, "rows": 1},
                  cases=cases, created_at="2026-08-01T10:00:05+00:00",
                  timing={"candidate": 1.0, "reference": 2.0, "total": 3.5},
                  masks=list(masks))


@pytest.fixture
def failing() -> Report:
    mask_ref = torch.zeros(8, 24, dtype=torch.bool)
    mask_ref[:, :10] = True
    mask_cand = mask_ref.clone()
    mask_cand[3, 18] = True  # the candidate attends where the reference does not
    pic = MaskPicture(case="syn-000-full", layer_type="full_attention", candidate=mask_cand,
                      reference=mask_ref, seq_len=16, block_size=4, differs=True)
    return make_report({
        "real-00-full": [result("mask", "real-00-full", PASS, 0.0),
                         result("loss", "real-00-full", PASS, 1e-7),
                         result("metrics", "real-00-full", WARN, None, ["EAL definition"])],
        "syn-000-full": [result("mask", "syn-000-full", FAIL, 1.0, ["context rule <= vs <"],
                                first_diff={"anchor": 0, "slot": 3, "kv_position": 12},
                                candidate=torch.tensor([1.0, float("nan")]),
                                reference=torch.zeros(100)),
                         result("loss", "syn-000-full", FAIL, float("inf"), ["gamma 7 vs 4"]),
                         result("metrics", "syn-000-full", PASS, None)],
    }, masks=[pic])


def test_verdict_and_aggregation(failing):
    assert failing.verdict == "fail" and failing.exit_code == 1
    checks = {c["name"]: c for c in failing.checks()}
    assert [c["name"] for c in failing.checks()] == ["mask", "loss", "metrics"]
    assert (checks["mask"]["status"], checks["mask"]["passed"], checks["mask"]["failed"]) == (
        FAIL, 1, 1)
    assert checks["mask"]["worst_max_abs_diff"] == 1.0
    assert checks["mask"]["worst_abs_case"] == "syn-000-full"
    assert checks["mask"]["first_failure"]["first_diff"] == {"anchor": 0, "slot": 3,
                                                             "kv_position": 12}
    assert checks["loss"]["worst_max_abs_diff"] == float("inf")
    assert checks["metrics"]["status"] == WARN and checks["metrics"]["warned"] == 1
    causes = [d["cause"] for d in failing.diagnoses()]
    assert causes[:2] == ["context rule <= vs <", "gamma 7 vs 4"] and causes[-1] == "EAL definition"
    # a consequence named on more results still comes after the root cause it follows from
    downstream = "follows from the logits difference"
    chained = make_report({c: [result("logits", c, FAIL, 1.0, ["attention scale 1"]),
                               result("loss", c, FAIL, 1.0, [downstream]),
                               result("gradients", c, FAIL, 1.0, [downstream])]
                           for c in ("a", "b")})
    assert [d["cause"] for d in chained.diagnoses()] == ["attention scale 1", downstream]
    passing = make_report({"c": [result("mask", "c", PASS), result("metrics", "c", WARN)]})
    assert passing.verdict == "pass" and passing.exit_code == 0
    assert make_report({}).verdict == "fail"  # nothing checked is not a pass


def test_one_cause_one_bullet_with_the_cases_it_covers():
    """Issue 11: the same unexplained difference on three cases is one bullet listing them,
    its per-case numbers kept in report.json."""
    def unexplained(i):
        return (f"unexplained difference in logits: no tested hypothesis reproduces the "
                f"candidate (max abs {0.1 * (i + 1):.3g}; first at anchor {i}, slot 1)")

    report = make_report({f"c{i}": [result("logits", f"c{i}", FAIL, 0.1, [unexplained(i)])]
                          for i in range(3)})
    (entry,) = report.diagnoses()
    assert entry["cause"] == ("unexplained difference in logits: no tested hypothesis "
                              "reproduces the candidate")
    assert entry["cases"] == ["c0", "c1", "c2"]
    assert entry["per_case"]["c2"] == unexplained(2)
    md = render_markdown(report)
    assert md.count("unexplained difference in logits") == 1
    assert "cases: `c0`, `c1`, `c2`; numbers per case in report.json" in md
    assert render_html(report).count("<li>") == 1 + 3  # one bullet, three folded per-case lines


def test_write_report_files(failing, tmp_path):
    folder = write_report(failing, tmp_path / "reports")
    assert re.fullmatch(r"20260801T100005Z-ad5e21eedc89", folder.name)
    assert sorted(p.name for p in folder.iterdir()) == sorted(REPORT_FILES)
    again = write_report(failing, tmp_path / "reports")
    assert again.name == folder.name + "-2"

    data = json.loads((folder / "report.json").read_text())  # strict JSON: NaN/inf as strings
    assert data["verdict"] == "fail" and data["exit_code"] == 1
    assert data["reference"]["sdist_sha256"] == REFERENCE["sdist_sha256"]
    assert data["candidate"] == {"name": "cand", "spec": None, "fingerprint": "c" * 64,
                                 "files": {}}
    assert data["profile"]["fingerprint"] == "p" * 64
    assert [(c["name"], c["status"]) for c in data["checks"]] == [
        ("mask", "fail"), ("loss", "fail"), ("metrics", "warn")]
    assert data["checks"][1]["worst_max_abs_diff"] == "Infinity"
    first = data["cases"][1]["results"][0]
    assert first["candidate"] == [1.0, "NaN"]
    assert first["reference"] == {"shape": [100], "dtype": "torch.float32"}
    assert data["timing"]["total"] == 3.5
    assert data["fingerprint"] == failing.fingerprint
    assert [c["name"] for c in data["cases"]] == ["real-00-full", "syn-000-full"]


def test_markdown_fits_a_comment(failing):
    md = render_markdown(failing)
    assert md.splitlines()[0] == "## dflash-audit compare: ❌ FAIL"
    assert "| mask | ❌ fail | 1 / 1 / 0 | 1 |" in md
    assert "context rule <= vs <" in md and "`speculators==0.9.0`" in md
    assert "| sdist sha256 | `" + REFERENCE["sdist_sha256"] + "` |" in md
    many = make_report({f"syn-{i:03d}": [result("mask", f"syn-{i:03d}", FAIL, 1.0,
                                                [f"cause {i % 40} " + "x" * 300])]
                        for i in range(600)})
    text = render_markdown(many)
    assert len(text) < 65536 and "more in report.json" in text
    ok = render_markdown(make_report({"c": [result("mask", "c", PASS, 0.0)]}))
    assert ok.startswith("## dflash-audit compare: ✅ PASS")


def _png(data_uri: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(data_uri.split(",", 1)[1]))).convert("RGB")


def test_html_shows_differing_masks(failing):
    page = render_html(failing)
    uris = re.findall(r'src="(data:image/png;base64,[^"]+)"', page)
    assert len(uris) == 3  # candidate, reference, difference
    cand, ref, diff = (_png(u) for u in uris)
    scale = cand.width // 24
    assert cand.size == (24 * scale, 8 * scale) and scale >= 1
    at = (18 * scale, 3 * scale)
    assert cand.getpixel(at) == (46, 125, 50)  # block part, attended
    assert ref.getpixel(at) == (255, 255, 255)
    assert diff.getpixel(at) == (220, 30, 30)  # only the candidate attends
    assert diff.getpixel((0, 0)) == (200, 200, 200)  # both attend
    assert "difference: 1 entries" in page and "context rule &lt;= vs &lt;" in page


def test_html_of_an_audit_without_masks_claims_no_comparison():
    """The candidate failed every case, so the reference was not run: no mask was compared,
    and the page says so and shows the report's notes (as report.md does), never "No mask
    differs between candidate and reference"."""
    from dflash_audit.audit.sides.run_sides import REFERENCE_NOT_RUN

    report = make_report({"syn-000-full": [result("run", "syn-000-full", FAIL)]})
    report.notes.append(REFERENCE_NOT_RUN)
    page = render_html(report)
    assert "No mask differs" not in page
    assert "No mask was compared" in page
    assert REFERENCE_NOT_RUN.replace("'", "&#x27;") in page
    assert REFERENCE_NOT_RUN in render_markdown(report)


def test_junit_one_testcase_per_check_and_case(failing):
    root = ET.fromstring(render_junit(failing))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == 6 and suite.get("failures") == "2" and suite.get("tests") == "6"
    failures = {tc.get("name"): tc.find("failure") for tc in cases
                if tc.find("failure") is not None}
    assert set(failures) == {"mask[syn-000-full]", "loss[syn-000-full]"}
    mask = failures["mask[syn-000-full]"]
    assert mask.get("message") == "mask fail on syn-000-full"
    assert "context rule <= vs <" in mask.text and "kv_position" in mask.text
    warn = next(tc for tc in cases if tc.get("name") == "metrics[real-00-full]")
    assert warn.find("failure") is None and "EAL definition" in warn.find("system-out").text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"] == "fail" and props["fingerprint"] == failing.fingerprint


class _Buggy(DrafterCandidate):
    name = "buggy"


def test_fingerprints():
    key = reference_key(REFERENCE)
    assert "resolved_at" not in key and "source_dir" not in key and key["version"] == "0.9.0"
    fp = report_fingerprint("pass", REFERENCE, "c" * 64, "p" * 64)
    moved = {**REFERENCE, "resolved_at": "later", "source_dir": "/elsewhere"}
    assert report_fingerprint("pass", moved, "c" * 64, "p" * 64) == fp
    assert report_fingerprint("fail", REFERENCE, "c" * 64, "p" * 64) != fp
    assert report_fingerprint("pass", {**REFERENCE, "version": "0.9.1"}, "c" * 64,
                              "p" * 64) != fp

    ours = candidate_fingerprint(DrafterCandidate(), "p" * 64)
    assert "dflash_audit/candidate.py" in ours["files"]
    assert "dflash_audit/model/drafter.py" in ours["files"]
    assert ours == candidate_fingerprint(DrafterCandidate(), "p" * 64)
    assert candidate_fingerprint(DrafterCandidate(), "q" * 64)["fingerprint"] != \
        ours["fingerprint"]
    buggy = candidate_fingerprint(_Buggy(), "p" * 64)
    assert "test_report.py" in buggy["files"] and buggy["fingerprint"] != ours["fingerprint"]
    assert all(p.suffix == ".py" for p in candidate_source_files(_Buggy()))


def test_markdown_names_the_recipe_and_the_checkpoint_weights():
    """A reader of the PR comment sees which loss recipe was audited and that --weights was
    used (a checkpoint config.json carries no loss: the recipe comes from a built-in profile)."""
    report = make_report({"real-00-full": [result("loss", "real-00-full", PASS, 0.0)]})
    report.profile["fields"] = {"loss": "ce", "weighting": "dpace", "gamma": 4.0,
                                "block_size": 8, "layer_layout": ["full"],
                                "sample_from_anchor": False,
                                "description": "speculators drafter config c/config.json "
                                               "(recipe: reference-train-cli)"}
    report.inputs["weights"] = "/runs/ckpt"
    md = render_markdown(report)
    assert ("Recipe audited: loss `ce`, weighting `dpace`, gamma 4, block_size 8, layers "
            "['full'], sample_from_anchor False (speculators drafter config c/config.json "
            "(recipe: reference-train-cli)).") in md
    assert ("Real cases ran on the checkpoint weights in `/runs/ckpt` (`--weights`); synthetic "
            "cases on seeded random weights.") in md
    assert "Recipe audited" not in render_markdown(make_report({"c": [result("loss", "c", PASS)]}))
