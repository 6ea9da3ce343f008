"""The framework-audit infrastructure without a reference run: spec parsing and the registry,
the cached install (a real wheel, real pip), --candidate-python, capabilities and the case
planner, provenance marking, hard labels in the output protocol."""

from __future__ import annotations

import dataclasses
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from framework_support import build_wheel, write_adapter
from typer.testing import CliRunner

from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.cases.supported import framework_cases
from dflash_audit.audit.frameworks import registry
from dflash_audit.audit.frameworks.capabilities import (
    Capabilities,
    CapabilitiesError,
    single_document,
)
from dflash_audit.atomic import file_sha256
from dflash_audit.audit.frameworks.install import (
    FrameworkInstallError,
    install_framework,
    site_manifest,
)
from dflash_audit.audit.frameworks.provenance import mark_provenance, who_computed
from dflash_audit.audit.frameworks.registry import (
    FrameworkError,
    candidate_launch,
    parse_framework_spec,
)
from dflash_audit.audit.protocol import validate_outputs
from dflash_audit.audit.result import FAIL, PASS, WARN, CheckResult
from dflash_audit.audit.sides.candidate_runner import run_one
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.cli import app
from dflash_audit.model.loss import LossSpec
from dflash_audit.profile import Profile


# ------------------------------------------------------------------------- spec + registry
@pytest.mark.parametrize("spec, expected", [
    ("framework:specforge", ("specforge", None, None)),
    ("framework:SpecForge==0.2.0", ("specforge", "0.2.0", None)),
    ("framework:speculators@main", ("speculators", None, "speculators@main")),
    ("framework:speculators==0.9.0", ("speculators", None, "speculators==0.9.0")),
    ("framework:speculators:path:/x/y", ("speculators", None, "path:/x/y")),
    ("framework:path:/x/y", ("speculators", None, "path:/x/y")),
    ("framework:speculators", ("speculators", None, None)),
])
def test_parse_framework_spec(spec, expected):
    fs = parse_framework_spec(spec)
    assert (fs.key, fs.version, fs.ref) == expected


@pytest.mark.parametrize("spec", ["framework:", "framework:specforge==", "framework:speculators@"])
def test_bad_framework_specs_name_the_choices(spec):
    with pytest.raises(FrameworkError, match="framework:speculators@REF"):
        parse_framework_spec(spec)


def test_unknown_and_unavailable_frameworks(monkeypatch):
    with pytest.raises(FrameworkError, match=r"unknown framework 'nope'.*speculators@REF"):
        candidate_launch("framework:nope")
    monkeypatch.setitem(registry.KNOWN, "future", ("Future Trainer", "3.1.4"))
    with pytest.raises(FrameworkError, match=r"Future Trainer 3\.1\.4 is not available in this "
                                             r"build .*future_adapter\.py is missing"):
        candidate_launch("framework:future==3.1.4")
    assert "framework:future==3.1.4 (Future Trainer; not available in this build)" in \
        registry.choices_text()
    assert registry.choices_text().endswith(  # each form as it is typed
        "framework:speculators@REF | framework:speculators==X.Y.Z | "
        "framework:speculators:path:DIR (the reference at another ref or release)")


def test_cli_unknown_framework_exits_2_without_traceback(tmp_path):
    result = CliRunner().invoke(app, ["compare", "--candidate", "framework:nope", "--offline",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown framework 'nope'" in result.output and "Traceback" not in result.output


def test_the_speculators_adapter_is_registered_from_its_source():
    found = registry.available_adapters()
    assert found["speculators"]["NAME"] == "speculators"
    assert found["speculators"]["REQUIREMENTS"] == []
    assert found["speculators"]["module"] == "dflash_audit.audit.frameworks.speculators_adapter"


# ------------------------------------------------------------------------------ install
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheels"))


def test_install_caches_verifies_and_repairs(tmp_path, wheel, capsys):
    with pytest.raises(FrameworkInstallError, match=r"offline, and testfw 1\.0 is not usable.*"
                                                    r"pip install --no-deps .*--target"):
        install_framework("testfw", "1.0", [str(wheel)], offline=True, cache_dir=tmp_path)
    site = install_framework("testfw", "1.0", [str(wheel)], cache_dir=tmp_path)
    assert site == tmp_path / "frameworks" / "testfw-1.0" / "site"
    assert "installing testfw 1.0 into the tool's cache" in capsys.readouterr().err  # said once
    assert (site / "demo_fw_pkg" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    manifest = json.loads((site.parent / "manifest.json").read_text())
    assert manifest["requirements"] == [str(wheel)]
    assert manifest["files"] == site_manifest(site)
    # a second use, offline: the cache only (nothing is installed)
    stamp = (site.parent / "manifest.json").stat().st_mtime_ns
    assert install_framework("testfw", "1.0", [str(wheel)], offline=True,
                             cache_dir=tmp_path) == site
    assert (site.parent / "manifest.json").stat().st_mtime_ns == stamp
    assert "installing" not in capsys.readouterr().err
    (site / "__pycache__").mkdir()  # what importing it writes does not count as damage
    (site / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert install_framework("testfw", "1.0", [str(wheel)], offline=True, cache_dir=tmp_path)
    (site / "demo_fw_pkg" / "__init__.py").write_text("VERSION = 'tampered'\n")
    with pytest.raises(FrameworkInstallError, match="changed demo_fw_pkg/__init__.py"):
        install_framework("testfw", "1.0", [str(wheel)], offline=True, cache_dir=tmp_path)
    install_framework("testfw", "1.0", [str(wheel)], cache_dir=tmp_path)  # rebuilt
    assert (site / "demo_fw_pkg" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    assert "is changed demo_fw_pkg/__init__.py; installing it again" in capsys.readouterr().err


def _import_version(site: Path) -> str:
    """``demo_fw_pkg.VERSION`` imported from ``site`` by a fresh interpreter that writes no
    bytecode (as the candidate's process: it only reads what the install compiled)."""
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    code = "import demo_fw_pkg; print(demo_fw_pkg.VERSION)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_an_install_is_compiled_and_its_bytecode_verified(tmp_path, wheel):
    """The install writes checked-hash bytecode (PEP 552) for every module and lists it in the
    manifest, so the candidate's process, which cannot write bytecode, never compiles the
    framework again; a pyc replaced since (code of another source, carrying this source's
    hash: Python alone would run it) is damage, installed again; an entry installed before
    entries were compiled is compiled on its next use, once."""
    import importlib.util

    source = tmp_path / "frameworks" / "testfw-1.0" / "site" / "demo_fw_pkg" / "__init__.py"
    pyc = Path(importlib.util.cache_from_source(str(source)))
    site = install_framework("testfw", "1.0", [str(wheel)], cache_dir=tmp_path)
    manifest = json.loads((site.parent / "manifest.json").read_text())
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b11  # hash-based, checked
    assert manifest["bytecode"][pyc.relative_to(site).as_posix()] == file_sha256(pyc)
    assert _import_version(site) == "1.0"
    planted = tmp_path / "planted.pyc"
    (tmp_path / "planted.py").write_text("VERSION = 'planted'\n")
    py_compile.compile(str(tmp_path / "planted.py"), str(planted),
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    data = planted.read_bytes()
    pyc.write_bytes(data[:8] + importlib.util.source_hash(source.read_bytes()) + data[16:])
    assert _import_version(site) == "planted"  # what the manifest's digest is there for
    with pytest.raises(FrameworkInstallError, match=r"changed demo_fw_pkg/__pycache__/"):
        install_framework("testfw", "1.0", [str(wheel)], offline=True, cache_dir=tmp_path)
    install_framework("testfw", "1.0", [str(wheel)], cache_dir=tmp_path)  # installed again
    assert _import_version(site) == "1.0"
    # an entry made before installs were compiled: compiled by its next use, and only then
    shutil.rmtree(pyc.parent)
    manifest = json.loads((site.parent / "manifest.json").read_text())
    del manifest["bytecode"]
    (site.parent / "manifest.json").write_text(json.dumps(manifest))
    install_framework("testfw", "1.0", [str(wheel)], offline=True, cache_dir=tmp_path)
    assert pyc.is_file() and pyc.relative_to(site).as_posix() in json.loads(
        (site.parent / "manifest.json").read_text())["bytecode"]
    stamp = (site.parent / "manifest.json").stat().st_mtime_ns
    install_framework("testfw", "1.0", [str(wheel)], offline=True, cache_dir=tmp_path)
    assert (site.parent / "manifest.json").stat().st_mtime_ns == stamp


def test_pip_failure_is_a_setup_error(tmp_path):
    broken = tmp_path / "broken-1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip")  # a regular file pip cannot install
    with pytest.raises(FrameworkInstallError, match="(?s)failed .*--candidate-python"):
        install_framework("testfw", "1.0", [str(broken)], cache_dir=tmp_path)
    assert not (tmp_path / "frameworks" / "testfw-1.0").exists()


def test_adapter_in_development_plugs_in(tmp_path, wheel, monkeypatch):
    folder = tmp_path / "adapters"
    write_adapter(folder, wheel, "{}")
    monkeypatch.setenv(registry.ADAPTER_PATH_ENV, str(folder))
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FrameworkError, match=r"TestFW 2\.0 is not supported; its adapter is "
                                             r"pinned to 1\.0 \(--candidate framework:testfw==1\.0"):
        candidate_launch("framework:testfw==2.0")
    launch = candidate_launch("framework:testfw==1.0")
    assert launch.spec == "testfw_adapter:candidate"
    assert launch.pythonpath == [str(folder), str(tmp_path / "cache" / "frameworks" /
                                                   "testfw-1.0" / "site")]


# -------------------------------------------------------------------- --candidate-python
def test_candidate_python_is_checked(tmp_path):
    with pytest.raises(FrameworkError, match="no such executable interpreter"):
        candidate_launch(None, python=str(tmp_path / "nope" / "python"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    with pytest.raises(FrameworkError, match=r"cannot import torch .*install it into that "
                                             r"environment"):
        candidate_launch(None, python=str(tmp_path / "venv" / "bin" / "python"))
    assert candidate_launch(None, python=sys.executable).executable == sys.executable


# ------------------------------------------------------------------ capabilities + plan
@pytest.fixture(scope="module")
def profile():
    return Profile.load("reference-model")


def test_capabilities_from_dict_and_reasons(profile):
    with pytest.raises(CapabilitiesError, match=r"unknown CAPABILITIES key\(s\) \['packing'\]"):
        Capabilities.from_dict({"packing": False})
    caps = Capabilities.from_dict({"packed_rows": False, "losses": ["ce"],
                                   "layouts": ["full"], "verifier_families": ["llama"]})
    case = plan_synthetic_cases(profile, 3, seed=0)[1].case  # qwen3, sliding
    reasons = caps.unsupported(case)
    assert "loss 'kl_div' (supported: ce)" in reasons
    assert "sliding draft-layer layout (supported: full)" in reasons
    assert "verifier family 'qwen3' (supported: llama)" in reasons
    assert Capabilities().unsupported(case) == []


def test_single_document_cuts_a_packed_row(profile):
    packed = next(p.case for p in plan_synthetic_cases(profile, 12, seed=0)
                  if int(p.case.inputs["document_ids"].max()) >= 1)
    cut = single_document(packed)
    T0 = int((packed.inputs["document_ids"][0] == 0).sum())
    assert cut.inputs["input_ids"].shape == (1, T0)
    assert torch.equal(cut.inputs["hidden_states"], packed.inputs["hidden_states"][:, :T0])
    assert bool((cut.inputs["document_ids"] == 0).all())
    valid = cut.inputs["anchor_positions"][cut.inputs["anchor_valid"]]
    assert cut.inputs["anchor_positions"].numel() == packed.inputs["anchor_positions"].numel()
    assert bool((valid < T0 - cut.config.block_size).all())
    assert cut.name == packed.name + "-doc0"


def test_framework_cases_fill_the_budget_with_supported_cases(profile):
    caps = Capabilities(packed_rows=False, verifier_families=("llama", "qwen3", "mistral"))
    planned, notes = framework_cases([], profile, 6, 0, caps, "TestFW 1.0")
    assert len(planned) == 6 and not any(p.case.unsupported for p in planned)
    families = {p.case.config.verifier_model_type for p in planned}
    assert families == {"llama", "qwen3", "mistral"}  # still spread over what it supports
    assert all(int(p.case.inputs["document_ids"].max()) == 0 and
               not bool((p.case.inputs["document_ids"] < 0).any()) for p in planned)
    assert any(n.startswith("not supported by TestFW 1.0: verifier family 'gemma3_text'")
               for n in notes)
    assert any("takes one document per row" in n for n in notes)


def test_unsupported_profile_leaves_cases_for_anchors_and_derivation(profile):
    caps = Capabilities(losses=("ce",))
    planned, notes = framework_cases([], profile, 2, 0, caps, "TestFW 1.0")
    assert len(planned) == 2
    assert all(p.case.unsupported == ["not supported by TestFW 1.0: loss 'kl_div' (supported: "
                                      "ce)"] for p in planned)
    status, out = run_one(DrafterCandidate(), planned[0].case)  # no training step is run
    assert status["status"] == "ok" and set(out.tensors) == {"anchor_draws",
                                                             "anchor_draws_valid"}
    assert out.derivation and "head_dim" in out.derivation


# -------------------------------------------------------------------------- provenance
def test_provenance_marks_adapter_values():
    prov = {"loss": "adapter", "grad.": "adapter", "grad.fc.weight": "framework"}
    assert who_computed("loss", prov) == "adapter"
    assert who_computed("grad.norm.weight", prov) == "adapter"
    assert who_computed("grad.fc.weight", prov) == "framework"
    assert who_computed("logits", prov) == "framework"
    results = [CheckResult("loss", "c", PASS, "loss 0.5 matches"),
               CheckResult("logits", "c", PASS, "logits match"),
               CheckResult("targets", "c", FAIL, "targets differ", diagnosis=["x"])]
    mark_provenance(results, {"loss": "adapter", "targets": "adapter"}, "z-lab dflash 0.1.0")
    loss, logits, targets = results
    assert loss.status == WARN and loss.summary.startswith(
        "loss: computed by the adapter, not audited as z-lab dflash 0.1.0's (loss)")
    assert logits.status == PASS and "provenance" not in logits.details
    assert targets.status == FAIL and targets.summary.startswith("[targets: computed by the "
                                                                 "adapter")
    assert "may be the adapter's, not z-lab dflash 0.1.0's]" in targets.summary
    assert targets.diagnosis == ["x"]  # the note is no cause: root causes stay the checks' own
    # a mask result reads only its own layer type's mask: z-lab's sliding mask is z-lab's
    masks = [CheckResult("mask", "c", FAIL, "sliding masks differ",
                         details={"layer_type": "sliding_attention"}, diagnosis=["window"]),
             CheckResult("mask", "c", PASS, "full masks agree",
                         details={"layer_type": "full_attention"})]
    mark_provenance(masks, {"mask.full_attention": "adapter"}, "z-lab dflash 0.1.0")
    assert masks[0].summary == "sliding masks differ" and masks[0].diagnosis == ["window"]
    assert masks[1].status == WARN and "mask.full_attention" in masks[1].summary


def test_provenance_of_a_mask_is_per_layer_type():
    """z-lab's sliding mask is its own, the full-attention one the adapter's: only the
    full-attention mask result is marked."""
    from types import SimpleNamespace

    prov = {"mask.full_attention": "adapter", "mask.sliding_attention": "framework"}
    outputs = SimpleNamespace(tensors={"mask.full_attention": 0, "mask.sliding_attention": 0})
    results = [CheckResult("mask", "c", PASS, "equal", details={"layer_type": lt})
               for lt in ("full_attention", "sliding_attention")]
    full, sliding = mark_provenance(results, prov, "z-lab dflash 0.1.0", outputs)
    assert full.status == WARN and "(mask.full_attention)" in full.summary
    assert sliding.status == PASS and "provenance" not in sliding.details


def test_provenance_covers_parts_of_what_a_check_reads():
    """A declared part of an output a check reads marks that check: SpecForge's converted
    ``structure.target_layer_ids``, the layout fields its derive_config sets on a sliding
    layout (its derivation's own ``provenance`` entry), a ``metrics.`` family; a declared part
    the case does not hold marks nothing."""
    from types import SimpleNamespace

    from dflash_audit.audit.frameworks.provenance import case_provenance

    outputs = SimpleNamespace(
        tensors={"logits": 0}, metrics={"train_acc": 0.5}, metadata={},
        structure={"target_layer_ids": [1], "state_dict": {"fc.weight": {}}},
        derivation={"layer_types": ["sliding_attention"], "saved.use_sliding_window": True,
                    "provenance": {"layer_types": "adapter",
                                   "saved.use_sliding_window": "adapter"}})
    declared = {"structure.target_layer_ids": "adapter", "metrics.": "adapter",
                "derivation.sliding_window": "adapter",  # not in this case's derivation
                "structure.state_dict.frozen_names": "adapter", "logits": "framework"}
    prov = case_provenance(declared, outputs)
    assert prov["derivation.layer_types"] == "adapter"
    results = [CheckResult(name, "c", PASS, f"{name} agree")
               for name in ("structure", "metrics", "derivation", "logits")]
    structure, metrics, derivation, logits = mark_provenance(
        results, prov, "SpecForge 0.2.0", outputs)
    assert structure.status == WARN and structure.details["provenance"]["adapter"] == [
        "structure.target_layer_ids", "structure.state_dict.frozen_names"]
    assert metrics.status == WARN and metrics.details["provenance"]["adapter"] == ["metrics."]
    assert derivation.status == WARN and derivation.details["provenance"]["adapter"] == [
        "derivation.layer_types", "derivation.saved.use_sliding_window"]
    assert logits.status == PASS
    # a full layout: SpecForge's own generated layout, nothing the adapter set
    full = SimpleNamespace(tensors={}, metrics={}, metadata={}, structure={},
                           derivation={"layer_types": ["full_attention"], "provenance": {}})
    [plain] = mark_provenance([CheckResult("derivation", "c", PASS, "equal")],
                              case_provenance({}, full), "SpecForge 0.2.0", full)
    assert plain.status == PASS


@pytest.mark.parametrize("key", ["modelopt", "specforge", "zlab"])
def test_every_output_an_adapter_computes_is_marked_where_a_check_reads_it(key):
    """Each output a built-in adapter declares its own is read by some check, so a PASS on it
    is never plain (``settings.*`` are declared choices no check compares); z-lab's metrics
    and derivation are the adapter's (they passed as z-lab's before)."""
    import importlib
    from types import SimpleNamespace

    from dflash_audit.audit.frameworks.provenance import CHECK_KEYS, DICT_OUTPUTS, adapter_keys

    adapter = importlib.import_module(f"dflash_audit.audit.frameworks.{key}_adapter")
    declared = [k for k, v in adapter.PROVENANCE.items()
                if v == "adapter" and not k.startswith("settings.")]
    assert declared
    for part in declared:
        top, _, field = part.partition(".")
        outputs = SimpleNamespace(tensors={} if top in DICT_OUTPUTS else {
            part + "x" if part.endswith(".") else part: 0}, **{
            name: ({(field + "x" if field.endswith(".") else field) or "x": 0}
                   if name == top else {}) for name in DICT_OUTPUTS})
        assert any(adapter_keys(check, {part: "adapter"}, outputs) for check in CHECK_KEYS), part
    if key == "zlab":
        assert {"metrics", "derivation"} <= set(declared)


def test_a_rule_names_the_framework_that_has_it_and_no_other():
    """"ModelOpt's rule" was printed on SpecForge cases where, with B = 2, its sampler also
    admits a = T - B: a rule's name carries the framework only when it is the candidate."""
    from dflash_audit.audit.checks.anchors import AT_T_MINUS_B, NEEDS_NEXT
    from dflash_audit.audit.frameworks.rules import attribute_rules

    def results():
        cause = f"{AT_T_MINUS_B}; the block of an anchor at T-B ends at T-1"
        return [CheckResult("anchors", "c", FAIL, f"{cause} (position 6 of T=8)",
                            diagnosis=[cause, f"{NEEDS_NEXT}: ..."],
                            details={"causes": [cause]})]

    [mo] = attribute_rules(results(), {"key": "modelopt", "label": "NVIDIA ModelOpt 0.47.0"})
    own = f"{AT_T_MINUS_B} (NVIDIA ModelOpt 0.47.0's rule); the block of an anchor at T-B"
    assert mo.diagnosis[0].startswith(own) and mo.summary.startswith(own)
    assert mo.details["causes"][0].startswith(own)
    assert mo.diagnosis[1] == f"{NEEDS_NEXT}: ..."  # SpecForge's rule, not ModelOpt's
    [sf] = attribute_rules(results(), {"key": "specforge", "label": "SpecForge 0.2.0"})
    assert sf.diagnosis == [f"{AT_T_MINUS_B}; the block of an anchor at T-B ends at T-1",
                            f"{NEEDS_NEXT} (SpecForge 0.2.0's rule): ..."]
    [plain] = attribute_rules(results(), None)
    assert plain.diagnosis == results()[0].diagnosis


def test_the_checks_name_no_framework_in_their_wording():
    """Rule names in the checks' and diagnoses' wording are neutral (string constants, not
    docstrings); whose rule it is is said by frameworks/rules.py for that framework only."""
    import ast
    import re

    import dflash_audit

    root = Path(dflash_audit.__file__).parent / "audit"
    names = re.compile(r"SpecForge|ModelOpt|z-lab|NeMo", re.IGNORECASE)
    found = []
    for path in [*root.glob("checks/*.py"), *root.glob("replay/*.py"), root / "diagnose.py",
                 root / "hard_labels.py"]:
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body and isinstance(
            n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and id(n) not in docs and names.search(n.value)]
    assert not found, found


def test_capabilities_new_keys_name_what_cannot_be_given(profile):
    """What a z-lab-convention framework cannot name (ids 0 and N), a one-target-layer-per-
    draft-layer rule, windows below the block, loss mixes, one head for both roles; unknown
    values of list keys refused; weighting 'none' accepted."""
    with pytest.raises(CapabilitiesError, match=r"unknown value\(s\) \['bidirectional'\]"):
        Capabilities.from_dict({"block_attention": ["bidirectional"]})
    assert Capabilities.from_dict({"weightings": ["none", "dpace"]}).weightings == (
        "none", "dpace")
    case = plan_synthetic_cases(profile, 2, seed=0)[1].case  # qwen3 sliding
    caps = Capabilities(any_target_layer_count=False, embedding_layer=False, last_layer=False,
                        window_below_block=False, loss_mixes=False, separate_draft_head=False)
    n = case.config.num_verifier_layers
    cfg = case.config.replace(target_layer_ids=[0, 5, n], sliding_window=1)
    weights = {**case.weights, "lm_head.weight": case.weights["lm_head.weight"] + 1}
    odd = dataclasses.replace(case, config=cfg, weights=weights,
                              loss=LossSpec('{"kl_div": 0.5, "ce": 0.5}'))
    reasons = " | ".join(caps.unsupported(odd))
    for what in (f"3 target layers for {cfg.num_hidden_layers} draft layer(s)",
                 "target layer id 0 (the embedding output", f"target layer id {n} (the last "
                 "layer's output before the final norm", "a sliding window W=1 smaller than "
                 "the block", "a mix of loss terms", "a draft lm_head that differs"):
        assert what in reasons, (what, reasons)
    assert Capabilities().unsupported(odd) == []


def test_planner_deepens_drafters_for_one_target_layer_per_draft_layer(profile):
    """reference-model's 3 target layers [2, N//2, N-3] for a framework that takes one target
    layer per draft layer: 3 draft layers in every case, the profile's ids kept, named."""
    from dflash_audit.audit.cases.supported import fitted_profile

    caps = Capabilities(any_target_layer_count=False, packed_rows=False)
    fitted, note = fitted_profile(profile, caps, 30, "TestFW 1.0")
    assert fitted.num_draft_layers == 3 and "one target layer per draft layer" in note
    planned, _ = framework_cases([], fitted, 3, 0, caps, "TestFW 1.0")
    assert len(planned) == 3 and not any(p.case.unsupported for p in planned)
    assert all(p.case.config.num_hidden_layers == 3 and
               list(p.case.config.target_layer_ids) == [2, 6, 9] for p in planned)
    assert fitted_profile(profile, Capabilities(), 30, "x") == (profile, None)


# -------------------------------------------------------------------------- hard labels
def test_target_ids_replace_targets_in_the_protocol(profile):
    case = plan_synthetic_cases(profile, 1, seed=0)[0].case
    _, out = run_one(DrafterCandidate(), case)
    assert validate_outputs(out, case) == []
    Q = case.inputs["anchor_positions"].numel() * case.config.block_size
    out.tensors["target_ids"] = out.tensors.pop("targets")[0].argmax(-1)[None]
    assert out.tensors["target_ids"].shape == (1, Q)
    assert validate_outputs(out, case) == []
    out.tensors["target_ids"] = out.tensors["target_ids"].float()
    assert [f.key for f in validate_outputs(out, case)] == ["target_ids"]
    del out.tensors["target_ids"]
    assert [f.key for f in validate_outputs(out, case)] == ["targets"]


def test_an_unsupported_dtype_is_listed_not_failed(profile):
    planned, notes = framework_cases([], profile, 1, 0, Capabilities(dtypes=("fp32",)),
                                     "TestFW 1.0", dtype="bf16")
    assert planned[0].case.unsupported == [
        "not supported by TestFW 1.0: dtype bf16 (supported: fp32)"]
    assert notes[0].startswith("not supported by TestFW 1.0: dtype bf16")


# ------------------------------------------------------------------------------- train
@pytest.mark.parametrize("spec", ["framework:specforge", "framework:speculators==0.9.0"])
def test_train_refuses_a_framework_candidate(spec, tmp_path):
    """`train` trains our drafter or a user candidate; a framework spec is refused before
    anything is loaded or written: exit 2, one line, no traceback."""
    result = CliRunner().invoke(app, ["train", "--candidate", spec, "--out",
                                      str(tmp_path / "run")])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert ("train trains our drafter or your own candidate; a framework is audited, not "
            "trained here: train with the framework itself") in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
