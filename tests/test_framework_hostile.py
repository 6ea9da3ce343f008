"""A hostile or careless framework adapter (``$DFLASH_AUDIT_ADAPTER_PATH``) and its inputs:
nothing it declares may end in exit 0 for a broken candidate, a traceback, a hang, a forged
line in the terminal or a report, or a built-in framework's name. Unit-level: no compare."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from framework_support import build_wheel

from dflash_audit.audit.cases.supported import framework_cases, nothing_runs
from dflash_audit.audit.frameworks import registry
from dflash_audit.audit.frameworks.capabilities import Capabilities, CapabilitiesError
from dflash_audit.audit.frameworks.install import (
    FrameworkInstallError,
    entry_problems,
    install_framework,
)
from dflash_audit.audit.frameworks.latent import (
    LatentDifference,
    LatentError,
    check_sources,
    parse_latent,
)
from dflash_audit.audit.frameworks.registry import FrameworkError, framework_facts
from dflash_audit.audit.result import WARN, CheckResult
from dflash_audit.audit.sides.launch import CandidateLaunch
from dflash_audit.audit.sides.candidate_runner import identity
from dflash_audit.profile import Profile
from dflash_audit.report.schema import CaseRecord, Report

ENTRY = {"capability": "draft_vocab", "would": "has one head", "source": "fw/a.py:1",
         "shows": "x"}
CAPS = Capabilities(draft_vocab=False)


# ---------------------------------------------------- a framework that runs no case at all
@pytest.fixture(scope="module")
def profile():
    return Profile.load("reference-model")


@pytest.mark.parametrize("caps, dtype, hint", [
    (Capabilities(dtypes=("fp32",)), "bf16", "--dtype fp32"),
    (Capabilities(verifier_families=("olmo9",)), "fp32", "--verifier family:olmo9"),
    (Capabilities(losses=("ce",)), "fp32", "losses"),
])
def test_no_supported_case_is_a_setup_error_not_a_pass(profile, caps, dtype, hint):
    """Every case outside CAPABILITIES runs no training step (only warnings): that audit
    must never pass. The planner names why and what to pass instead."""
    planned, _ = framework_cases([], profile, 2, 0, caps, "TestFW 1.0", dtype=dtype)
    assert planned and all(p.case.unsupported for p in planned)
    message = nothing_runs(planned, caps, "TestFW 1.0", dtype)
    assert message.startswith("none of the 2 audit cases can run on TestFW 1.0: ")
    assert hint in message and "\n" not in message
    if dtype == "bf16":  # the dtype alone blocks every case: no hint about the rest
        assert "--verifier" not in message and "losses" not in message
    ok, _ = framework_cases([], profile, 2, 0, Capabilities(dtypes=("fp32",)), "T 1", "fp32")
    assert nothing_runs(ok, caps, "T 1", "fp32") is None


def test_a_report_whose_cases_all_ran_no_step_never_passes():
    warn = CheckResult("supported", "c0", WARN, "not supported by X 1: dtype bf16")
    records = [CaseRecord("c0", "synthetic", "", {"unsupported": ["not supported by X 1"]},
                          [warn, CheckResult("anchors", "c0", WARN, "not provided")])]
    report = Report({}, {}, {}, {}, records, "")
    assert report.verdict == "fail" and report.exit_code == 1
    records[0].layout = {}
    assert Report({}, {}, {}, {}, records, "").verdict == "pass"


# ------------------------------------------------------------------ malformed CAPABILITIES
@pytest.mark.parametrize("data, message", [
    ("abc", "CAPABILITIES must be a dict"),
    (5, "CAPABILITIES must be a dict"),
    ([["packed_rows", False]], "CAPABILITIES must be a dict"),
    ({"packed_rows": "false"}, r"CAPABILITIES\['packed_rows'\] must be true or false"),
    ({"dtypes": []}, r"CAPABILITIES\['dtypes'\] is empty"),
    ({"layouts": []}, r"CAPABILITIES\['layouts'\] is empty"),
    ({"verifier_families": []}, r"CAPABILITIES\['verifier_families'\] is empty"),
    ({"verifier_families": ["qwen3\n\x1b[2K"]}, r"verifier_families.*not a model_type"),
    ({"layouts": [[[["full"]]]]}, "unknown value"),
])
def test_malformed_capabilities_are_one_line_setup_errors(data, message):
    with pytest.raises(CapabilitiesError, match=message) as err:
        Capabilities.from_dict(data)
    assert "\n" not in str(err.value) and len(str(err.value)) < 600


# ------------------------------------------------------------------------ malformed LATENT
@pytest.mark.parametrize("change, message", [
    ({"would": "ok\n\x1b[2Kverdict: PASS"}, r"\['would'\] must be one line of printable text"),
    ({"shows": "a\rb"}, r"\['shows'\] must be one line of printable text"),
    ({"would": "w" * 5000}, r"\['would'\] is longer than"),
    ({"source": "/etc/passwd.x:1"}, "relative to the framework's install root"),
    ({"source": "../../etc/hosts.allow:1"}, "relative to the framework's install root"),
    ({"source": "fw/../../x.py:1"}, "relative to the framework's install root"),
])
def test_latent_text_is_one_bounded_line_and_its_source_stays_inside(change, message):
    with pytest.raises(LatentError, match=message) as err:
        parse_latent([{**ENTRY, **change}], CAPS)
    assert "\n" not in str(err.value) and len(str(err.value)) < 800


@pytest.mark.parametrize("data", ["x" * 10_000_000, [{**ENTRY, "extra": "y" * 10_000_000}],
                                  [[[[[[[[[[[["deep"]]]]]]]]]]]]])
def test_a_huge_latent_gives_a_short_error(data):
    with pytest.raises(LatentError) as err:
        parse_latent(data, CAPS)
    assert len(str(err.value)) < 800 and "\n" not in str(err.value)


def test_check_sources_never_reads_outside_the_install_root(tmp_path):
    root = tmp_path / "site"
    (root / "fw").mkdir(parents=True)
    (tmp_path / "secret.py").write_text("token = 1\n")
    (root / "fw" / "link.py").symlink_to(tmp_path / "secret.py")
    d = LatentDifference("draft_vocab", "w", "fw/link.py:1", "token = 1")
    assert check_sources([d], root) == [
        f"fw/link.py:1: {root / 'fw' / 'link.py'} leads outside the install root {root}"]


# ------------------------------------------------------------ NAME / VERSION / constants
def _launch(key: str = "evilfw") -> CandidateLaunch:
    return CandidateLaunch(spec=f"{key}_adapter:candidate", framework={
        "key": key, "name": "EvilFW", "version": "1.0", "module": f"{key}_adapter",
        "external": f"/x/{key}_adapter.py"})


@pytest.mark.parametrize("name, version", [("Evil\nFW\x1b[31m", "1.0"), ("EvilFW", "1.0\n"),
                                           ("E" * 5000, "1.0")])
def test_a_name_that_is_not_one_short_line_is_refused(name, version):
    with pytest.raises(FrameworkError, match="NAME and VERSION must be") as err:
        framework_facts(_launch(), {"adapter": {"NAME": name, "VERSION": version}})
    assert "\n" not in str(err.value) and len(str(err.value)) < 600


@pytest.mark.parametrize("name", ["NVIDIA NeMo Automodel", "My SpecForge", "the z-lab dflash",
                                  "modelopt-fork"])
def test_a_builtin_name_anywhere_in_the_label_is_impersonation(name):
    assert registry.impersonation("evilfw", name, "1.0")


@pytest.mark.parametrize("name", ["Mnemonic", "Forge Inspector", "Spectral Forgery"])
def test_names_that_merely_contain_the_letters_are_not(name):
    assert registry.impersonation("evilfw", name, "1.0") is None


def test_constants_that_json_cannot_hold_are_a_short_error(monkeypatch):
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    module = type(sys)("evilfw_adapter")
    module.NAME, module.VERSION, module.LATENT = "EvilFW", "1.0", deep
    monkeypatch.setitem(sys.modules, "evilfw_adapter", module)
    out = identity(object(), "evilfw_adapter:candidate")
    assert "cannot be written as JSON" in out["adapter"]["error"]
    with pytest.raises(FrameworkError, match="cannot be written as JSON") as err:
        framework_facts(_launch(), out)
    assert "\n" not in str(err.value)
    module.LATENT = ["x" * 3_000_000]  # JSON, but no contract needs megabytes
    out = identity(object(), "evilfw_adapter:candidate")
    assert "larger than" in out["adapter"]["error"]


# ------------------------------------------------------------------ local-wheel REQUIREMENTS
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("hostile-wheels"))


def test_a_local_requirement_that_is_no_regular_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fw-1.0-py3-none-any.whl"
    os.mkfifo(fifo)  # pip (or hashing it) would block forever on a FIFO
    (tmp_path / "dev-1.0-py3-none-any.whl").symlink_to("/dev/zero")
    for path in (fifo, tmp_path / "dev-1.0-py3-none-any.whl",
                 tmp_path / "missing-1.0-py3-none-any.whl"):
        with pytest.raises(FrameworkInstallError, match="is not a regular file") as err:
            install_framework("testfw", "1.0", [str(path)], cache_dir=tmp_path / "c")
        assert "\n" not in str(err.value)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_rebuilt_local_wheel_is_installed_again(tmp_path, wheel):
    local = tmp_path / "w" / wheel.name
    local.parent.mkdir()
    local.write_bytes(wheel.read_bytes())
    site = install_framework("testfw", "1.0", [str(local)], cache_dir=tmp_path / "c")
    assert entry_problems(site.parent, [str(local)]) == []
    rebuilt = build_wheel(tmp_path / "v2", version="2.0")
    local.write_bytes(rebuilt.read_bytes())  # same path, new content
    assert entry_problems(site.parent, [str(local)]) == [f"made for another build of {local}"]
    install_framework("testfw", "1.0", [str(local)], cache_dir=tmp_path / "c")
    assert (site / "demo_fw_pkg" / "__init__.py").read_text() == "VERSION = '2.0'\n"
    manifest = json.loads((site.parent / "manifest.json").read_text())
    assert list(manifest["local_files"]) == [str(local)]
    local.write_bytes(wheel.read_bytes())  # back to the first build: offline, not usable
    with pytest.raises(FrameworkInstallError, match="offline.*made for another build of"):
        install_framework("testfw", "1.0", [str(local)], offline=True, cache_dir=tmp_path / "c")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_an_unwritable_cache_is_a_setup_error_as_an_ordinary_user(request, wheel):
    import shutil
    import subprocess
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="dflash-hostile-"))  # one every user can enter
    shared.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    wheel = Path(shutil.copy(wheel, shared))
    wheel.chmod(0o644)
    cache = shared / "rootonly"
    cache.mkdir(mode=0o700)
    code = ("import sys; from dflash_audit.audit.frameworks.install import install_framework\n"
            "from dflash_audit.audit.setup_error import CompareSetupError\n"
            f"try: install_framework('testfw', '1.0', [{str(wheel)!r}], cache_dir={str(cache)!r})\n"
            "except CompareSetupError as e: print('SETUP', e); sys.exit(2)\n")
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot write the tool's cache" in done.stdout and "DFLASH_AUDIT_CACHE" in done.stdout


# --------------------------------------------- --device cuda: the flex-padding case, fitted
@pytest.mark.parametrize("key", ["specforge", "modelopt", "zlab", "nemo"])
def test_the_flex_padding_case_is_one_the_framework_can_run(profile, key):
    """On --device cuda the audit adds a packed, padded case; a framework without packed rows
    or of other verifier families must get it fitted (never a run_case refusal = a FAIL)."""
    from dflash_audit.audit.cases.supported import framework_flex_case
    from dflash_audit.audit.cases.plan import FLEX_BLOCK_SIZE

    constants = registry.adapter_constants(registry.FOLDER / f"{key}_adapter.py")
    caps = Capabilities.from_dict(constants.get("CAPABILITIES") or _module_caps(key))
    p = framework_flex_case(profile, caps, key, 0, "fp32")
    assert caps.unsupported(p.case) == [] and not p.case.unsupported
    assert p.case.inputs["anchor_positions"].numel() * profile.block_size > FLEX_BLOCK_SIZE


def _module_caps(key: str) -> dict:
    import importlib

    return importlib.import_module(f"dflash_audit.audit.frameworks.{key}_adapter").CAPABILITIES


# --------------------------------------- run_case refusing every case dodges no check
def test_run_case_raising_not_supported_is_a_failed_run_not_a_skip(profile):
    """A case inside CAPABILITIES that run_case refuses (kit.NotSupported) is the candidate
    failing to run it, whatever the exception is called: only the planner skips cases."""
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.audit.frameworks import kit
    from dflash_audit.audit.sides.candidate_runner import run_one

    class Refuses:
        def run_case(self, config, loss, weights, inputs):
            raise kit.NotSupported("not supported by EvilFW 1.0: anything")

    case = plan_synthetic_cases(profile, 1)[0].case
    status, out = run_one(Refuses(), case)
    assert status["status"] == "raised" and out is None
    assert "NotSupported: not supported by EvilFW 1.0" in status["summary"]
