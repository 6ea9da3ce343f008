"""`dflash-audit train`'s gate decides before any candidate code is imported in the process
that trains (dflash_audit/train/sealed.py): a never-audited candidate whose import replaces the
gate is refused without its import ever running here; an audited one still trains (its canary
first in a sandboxed process of its own, which cannot read the report's canary folder); a
candidate file that names another candidate's class cannot borrow that one's report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import train_tiny as tt
from typer.testing import CliRunner

import dflash_audit.train.gate as gate_module
import dflash_audit.train.loop as loop_module
import dflash_audit.train.sealed as sealed_module
from dflash_audit.audit.sides.launch import identity_fingerprint
from dflash_audit.audit.sides.sandbox import sandbox_status
from dflash_audit.cli import app
from dflash_audit.train.gate import GateError
from dflash_audit.train.loop import train

#: What its import does: note the process it runs in, then replace every function of the gate
#: and of the canary with one that admits anything.
GATE_REPLACER = '''
import os
try:
    with open({marker!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
except OSError:  # a read-only sandbox
    pass
import dflash_audit.train.canary as canary
import dflash_audit.train.gate as gate
import dflash_audit.train.loop as loop
import dflash_audit.train.sealed as sealed
ok = gate.GateResult(report_path=gate.Path("none"), report_fingerprint="0" * 64,
                     candidate_fingerprint="0" * 64, profile_fingerprint="0" * 64)
for module in (loop, gate, sealed):
    for name in ("check_gate", "expected_for", "decide", "run_canary", "sealed_canary"):
        if hasattr(module, name):
            setattr(module, name, lambda *a, **k: ok)
gate.differences = lambda *a, **k: []
gate._integrity_ok = lambda *a, **k: True
canary.run_canary = loop.run_canary = lambda *a, **k: "canary skipped"
from dflash_audit.candidate import DrafterCandidate
candidate = DrafterCandidate
'''

#: A subclass of our drafter whose build() refuses to run where the report's canary folder is
#: readable in its own (sandboxed) canary process (HIDDEN_FROM names it; train's process, the
#: pid in TRAIN_PID, reads it anyway).
CANARY_READER = '''
import os
from dflash_audit.candidate import DrafterCandidate
class C(DrafterCandidate):
    def build(self, config):
        folder = os.environ.get("HIDDEN_FROM")
        if folder and str(os.getpid()) != os.environ.get("TRAIN_PID") and os.listdir(folder):
            raise RuntimeError(f"the canary process reads {folder}")
        return DrafterCandidate.build(self, config)
candidate = C
'''

GUARDED = {loop_module: ("check_gate", "expected_for", "decide", "run_canary", "sealed_canary"),
           gate_module: ("check_gate", "expected_for", "differences", "_integrity_ok"),
           sealed_module: ("decide", "sealed_canary")}


@pytest.fixture(scope="module")
def paths(tiny_run):
    return tiny_run


def test_a_never_audited_candidate_that_replaces_the_gate_is_refused_before_its_import(
        paths, tmp_path, monkeypatch):
    for module, names in GUARDED.items():  # put back at teardown, should a regression import it
        for name in names:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    originals = {(m, n): getattr(m, n) for m, names in GUARDED.items() for n in names
                 if hasattr(m, n)}
    marker = tmp_path / "imported.txt"
    hostile = tmp_path / "replacer.py"
    hostile.write_text(GATE_REPLACER.format(marker=str(marker)))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--out", str(out), "--verifier", str(paths["verifier"]), "--batches",
        str(paths["batches"]), "--profile", str(paths["profile"]), "--reports-dir",
        str(paths["reports"]), "--candidate", f"{hostile}:candidate", "--steps", "2",
        "--no-progress", "--no-tensorboard", "--no-eval"])
    assert result.exit_code == 2, result.output
    assert "training refused" in result.output and "candidate differs" in result.output
    # its import ran at most in its own process (sandboxed: not even there), never in train's
    pids = marker.read_text().split() if marker.exists() else []
    assert str(os.getpid()) not in pids
    assert all(getattr(m, n) is f for (m, n), f in originals.items())
    assert not (out / "checkpoints").exists()


def test_an_audited_candidate_trains_and_its_canary_process_cannot_read_the_canary(
        paths, tmp_path, monkeypatch, capsys):
    spec = tmp_path / "reader.py"
    spec.write_text(CANARY_READER)
    reports = tmp_path / "reports"  # inside the candidate's folder, which its sandbox reads
    report = tt.write_report(reports, paths["profile"], f"{spec}:candidate",
                             canary_from=(paths["verifier"], paths["batches"]))
    if sandbox_status().available:
        monkeypatch.setenv("HIDDEN_FROM", str(report.parent / "canary"))
        monkeypatch.setenv("TRAIN_PID", str(os.getpid()))
    summary = train(tt.tiny_config(paths, tmp_path / "run", steps=2,
                                   candidate=f"{spec}:candidate", reports_dir=str(reports)),
                    reference_identity=tt.REFERENCE)
    assert summary.step == 2 and summary.report_fingerprint
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "model.safetensors").is_file()
    log = capsys.readouterr().out
    assert "in its own process, gives the audited loss" in log
    assert "on the model it trains gives the audited loss" in log


def test_a_replaced_gate_function_refuses_the_run(monkeypatch):
    binding = sealed_module.Binding()
    binding.check("now")  # nothing replaced yet
    monkeypatch.setattr(loop_module, "run_canary", lambda *a, **k: "skipped")
    with pytest.raises(GateError, match=r"replaced dflash-audit's own functions "
                                        r"dflash_audit\.train\.loop\.run_canary") as err:
        binding.check("when it was imported")
    assert err.value.exit_code == 2


def test_a_file_naming_another_candidates_class_cannot_borrow_its_report(tmp_path, monkeypatch):
    """b.py's candidate is a.py's class: its process reports only a.py, but b.py (which runs
    its own code at import) is hashed too, located without running it; so is a package's
    __init__.py on the way to a module:attr candidate."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("class A:\n    def run_case(self, *a):\n        pass\n")
    (tmp_path / "b.py").write_text("import os  # anything at import\nfrom a import A\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("print('imported')\n")
    (tmp_path / "pkg" / "mod.py").write_text("from a import A\n")
    identity = {"source_files": [str(tmp_path / "a.py")]}
    own = identity_fingerprint(identity, "a.py:A", "p" * 64)
    borrowed = identity_fingerprint(identity, "b.py:A", "p" * 64)
    assert set(own["files"]) == {"a.py"}
    assert set(borrowed["files"]) == {"a.py", "b.py"}
    assert own["fingerprint"] != borrowed["fingerprint"]
    packaged = identity_fingerprint(identity, "pkg.mod:A", "p" * 64)
    assert set(packaged["files"]) == {"a.py", "__init__.py", "mod.py"}
    assert identity_fingerprint(identity, "a:A", "p" * 64) == own  # module or file: one file
    assert "pkg" not in sys.modules and "b" not in sys.modules  # located, never imported


def test_train_refuses_an_installation_an_audit_recorded_as_changed(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """An installation an earlier audit's candidate changed (its tamper record: a tool file
    whose good sha256 is not the one on disk) trains nothing: the gate refuses before anything
    else, exit 2, naming the file; once the record's content is back, the gate goes on."""
    import dflash_audit
    from dflash_audit.atomic import file_sha256
    from dflash_audit.audit.sides.tamper_record import record_path, record_tampering

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    init = Path(dflash_audit.__file__).resolve()
    record_tampering({str(init): "sha256:" + "0" * 64})
    with pytest.raises(GateError) as refused:
        sealed_module.decide(None, None, None, None, None)
    assert refused.value.exit_code == 2
    assert str(init) in str(refused.value) and "not restored" in str(refused.value)
    record_path().unlink()
    record_tampering({str(init): f"sha256:{file_sha256(init)}"})  # the content is the good one
    with pytest.raises(AttributeError):  # past the record: the dummy settings are read now
        sealed_module.decide(None, None, None, None, None)
    assert not record_path().exists()
