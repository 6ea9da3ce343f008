"""Latent differences (an adapter's ``LATENT``): validated like CAPABILITIES, every built-in
adapter's citations verified against the framework's real source at its pinned version (the
tool's own install, tests/framework_support.py), listed by the planner with the cases that
had such input, and shown as warnings in every report format and the conformance matrix
without changing the verdict."""

from __future__ import annotations

import importlib
import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from framework_support import framework_site
from test_report import make_report, result

from dflash_audit.audit.cases.supported import framework_cases
from dflash_audit.audit.frameworks.capabilities import Capabilities
from dflash_audit.audit.frameworks.latent import (
    LatentError,
    check_sources,
    latent_findings,
    parse_latent,
    undeclared,
)
from dflash_audit.audit.frameworks.registry import adapter_constants
from dflash_audit.audit.result import PASS, WARN
from dflash_audit.model.loss import LOSS_NAMES
from dflash_audit.profile import Profile
from dflash_audit.report.html import render_html
from dflash_audit.report.junit import render_junit
from dflash_audit.report.markdown import render_markdown

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ROOT / "dflash_audit" / "audit" / "frameworks"
ENTRY = {"capability": "packed_rows", "would": "has no document mask: packed rows would leak",
         "source": "pkg/mod.py:3-4", "shows": "kv < anchor"}


@pytest.mark.parametrize("latent, message", [
    ("nope", r"LATENT must be a list of dicts"),
    ([{**ENTRY, "where": 1}], r"LATENT\[0\]: missing key\(s\) \[\], unknown key\(s\) \['where'\]"),
    ([{k: v for k, v in ENTRY.items() if k != "shows"}], r"missing key\(s\) \['shows'\]"),
    ([{**ENTRY, "would": " "}], r"\['would'\] must be non-empty strings"),
    ([{**ENTRY, "capability": "packing"}], r"unknown capability 'packing'"),
    ([{**ENTRY, "capability": "draft_vocab"}], r"does not lack 'draft_vocab'"),
    ([{**ENTRY, "source": "pkg/mod.py"}], r"must be PATH:LINE or PATH:FIRST-LAST"),
    ([{**ENTRY, "source": "pkg/mod.py:9-3"}], r"must be PATH:LINE"),
])
def test_latent_is_validated_like_capabilities(latent, message):
    with pytest.raises(LatentError, match=message):
        parse_latent(latent, Capabilities(packed_rows=False))


def test_a_lacking_capability_is_never_dropped(tmp_path):
    """Declared entries carry their citation; a lacking capability nobody declared is listed
    as undeclared; the citation check reads the real lines."""
    caps = Capabilities(packed_rows=False, losses=("ce",), layouts=("full", "sliding"))
    assert caps.lacking() == ["packed_rows", "layouts", "losses"]
    assert Capabilities().lacking() == []
    assert Capabilities(losses=tuple(reversed(LOSS_NAMES))).lacking() == []  # all: not short
    declared = parse_latent([ENTRY], caps)
    found = latent_findings("TestFW 1.0", caps, declared, {"packed_rows": ["syn-001"]})
    assert [(f["capability"], f["declared"]) for f in found] == [
        ("packed_rows", True), ("layouts", False), ("losses", False)]
    assert found[0]["text"] == ("TestFW 1.0 has no document mask: packed rows would leak "
                                "(pkg/mod.py:3-4)")
    assert found[0]["cases"] == ["syn-001"]
    assert "not declared by its adapter" in found[2]["text"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("a = 1\nb = 2\nok = (kv <\n      anchor)\n")
    assert check_sources(declared, tmp_path) == []
    (tmp_path / "pkg" / "mod.py").write_text("a = 1\nb = 2\nok = kv <= anchor\nz\n")
    assert "do not contain 'kv < anchor'" in check_sources(declared, tmp_path)[0]
    (tmp_path / "pkg" / "mod.py").write_text("a = 1\n")
    assert "has 1 lines" in check_sources(declared, tmp_path)[0]
    assert "does not exist" in check_sources(declared, tmp_path / "elsewhere")[0]


@pytest.mark.parametrize("key", ["specforge", "modelopt", "zlab", "nemo"])
def test_every_builtin_claim_holds_in_the_frameworks_source(key):
    """Each built-in adapter declares what its framework would do for every capability it
    lacks, and each citation holds in the framework installed at the pinned version: the
    file exists and the cited lines contain what the finding claims."""
    adapter = importlib.import_module(f"dflash_audit.audit.frameworks.{key}_adapter")
    caps = Capabilities.from_dict(adapter.CAPABILITIES)
    latent = parse_latent(adapter.LATENT, caps)
    assert latent and undeclared(caps, latent) == [], [d.capability for d in
                                                       undeclared(caps, latent)]
    site = framework_site(key, importable=False)
    assert check_sources(latent, site) == []
    assert json.loads(json.dumps(adapter.LATENT)) == adapter.LATENT  # what the runner reports


def test_the_named_latent_differences_of_specforge_and_modelopt():
    """The issue's examples: no document mask and no per-document positions in both; one
    target layer per draft layer in ModelOpt."""
    for key, label in (("specforge", "SpecForge 0.2.0"), ("modelopt", "NVIDIA ModelOpt 0.47.0")):
        adapter = importlib.import_module(f"dflash_audit.audit.frameworks.{key}_adapter")
        caps = Capabilities.from_dict(adapter.CAPABILITIES)
        texts = [f["text"] for f in latent_findings(label, caps, parse_latent(adapter.LATENT,
                                                                              caps))]
        assert any(t.startswith(f"{label} has no document mask: ") and
                   "would leak across documents" in t for t in texts), texts
        assert any(t.startswith(f"{label} has no per-document positions") for t in texts)
    modelopt = importlib.import_module("dflash_audit.audit.frameworks.modelopt_adapter")
    assert any(d["capability"] == "any_target_layer_count" and "ValueError" in d["would"]
               for d in modelopt.LATENT)


def test_speculators_and_the_kit_example():
    """The reference lacks nothing (no latent difference); the kit's toy declares its own,
    citing its own lines."""
    constants = adapter_constants(FRAMEWORKS / "speculators_adapter.py")
    caps = Capabilities.from_dict(constants["CAPABILITIES"])
    assert caps.lacking() == [] and latent_findings("speculators 0.9.0", caps, []) == []
    toy = ROOT / "examples" / "frameworks" / "toy_framework_adapter.py"
    constants = adapter_constants(toy)
    caps = Capabilities.from_dict(constants["CAPABILITIES"])
    latent = parse_latent(constants["LATENT"], caps)
    assert undeclared(caps, latent) == [] and check_sources(latent, toy.parent) == []


def test_the_planner_says_which_cases_needed_what_the_framework_lacks():
    """Packed rows cut to one document and cases left out are recorded per capability, and
    the budget is still filled with supported cases."""
    profile = Profile.load("reference-model")
    caps = Capabilities(packed_rows=False, verifier_families=("qwen3", "mistral"))
    exercised: dict[str, list[str]] = {}
    planned, _ = framework_cases([], profile, 2, 0, caps, "TestFW 1.0", exercised=exercised)
    assert len(planned) == 2 and not any(p.case.unsupported for p in planned)
    cut = [p.case.name for p in planned if p.layout.get("cut_to_first_document")]
    assert cut and all(n.rsplit("-doc", 1)[0] in exercised["packed_rows"] for n in cut)
    assert exercised["verifier_families"] == ["syn-000-llama-full", "syn-002-qwen3_5-mixed",
                                              "syn-003-gemma3_text-full"]


def _latent_report(status=PASS):
    report = make_report({"syn-000": [result("mask", "syn-000", status, 0.0)]})
    report.candidate["framework"] = {"label": "TestFW 1.0", "spec": "framework:testfw"}
    caps = Capabilities(packed_rows=False, draft_vocab=False)
    report.latent = latent_findings("TestFW 1.0", caps, parse_latent([ENTRY], caps),
                                    {"packed_rows": ["syn-000"]})
    return report


def test_latent_differences_are_warnings_in_every_format():
    report = _latent_report()
    assert report.verdict == "pass" and report.exit_code == 0  # never a failure
    text = "TestFW 1.0 has no document mask: packed rows would leak (pkg/mod.py:3-4)"
    data = report.to_dict()
    assert [d["text"] for d in data["latent"]][0] == text
    assert data["latent"][1]["declared"] is False and data["latent"][1]["capability"] == (
        "draft_vocab")
    md = render_markdown(report)
    assert "### Latent differences (2 warning(s)" in md
    assert f"- ⚠️ {text} [input of 1 audit case(s), cut or left out: syn-000]" in md
    assert "cannot express draft vocab" in md
    html = render_html(report)
    assert "<h2>Latent differences</h2>" in html and "has no document mask" in html
    suite = ET.fromstring(render_junit(report).split("\n", 1)[1])
    latent = [tc for tc in suite.iter("testcase") if tc.get("classname") == "dflash_audit.latent"]
    assert [tc.get("name") for tc in latent] == ["latent[packed_rows:1]", "latent[draft_vocab:1]"]
    assert latent[0].find("system-out").text.startswith("WARN: " + text)
    assert latent[0].find("failure") is None and suite.get("failures") == "0"
    assert suite.get("tests") == "3"
    assert _latent_report(WARN).verdict == "pass"


def test_the_conformance_matrix_lists_every_latent_difference():
    spec = importlib.util.spec_from_file_location("conformance_matrix",
                                                  ROOT / "scripts" / "conformance_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    report = _latent_report()
    rows = [{"label": "TestFW 1.0", "verdict": "pass", "checks": {"mask": ("pass", "")},
             "error": None, "latent": report.latent},
            {"label": "Other 1.0", "verdict": "pass", "checks": {"mask": ("pass", "")},
             "error": None, "latent": []}]
    table = matrix.render(rows, ["mask"])
    assert "| **latent differences** | ⚠️ 2 (warnings) | none |" in table
    assert "- ⚠️ TestFW 1.0 has no document mask: packed rows would leak (pkg/mod.py:3-4)" in table
    assert "- ⚠️ TestFW 1.0 cannot express draft vocab" in table
