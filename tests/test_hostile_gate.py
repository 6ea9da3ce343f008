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
from dflash_audit.limits import limit_s
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


# ------------------------------------------- what the candidate's process hands back
# (its identity, heartbeat, status and outputs live in a folder it can write)
FIFO_IDENTITY = """
import os, sys
os.mkfifo(os.path.join(sys.argv[2], "candidate.json"))  # the runner's out_dir
os._exit(0)
"""
NOT_AN_OBJECT = """
import json, os, sys
with open(os.path.join(sys.argv[2], "candidate.json"), "w") as f:
    json.dump(["not", "an", "identity"], f)
os._exit(0)
"""
FLOOD = """
import os, sys
chunk = b"x" * (1 << 20)
for _ in range(256):  # 256 MiB on stderr, then it dies
    sys.stderr.buffer.write(chunk)
sys.stderr.flush()
os._exit(7)
"""


def _in_thread(call, fifo, limit):
    """``call()`` in a thread: (its result or exception, whether it ended within ``limit``
    seconds); when it did not, the FIFO ``fifo`` it is blocked on is opened for writing to
    free it."""
    import threading

    box = {}

    def run():
        try:
            box["out"] = call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            box["out"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():  # blocked on the FIFO: open its other end so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
        return box.get("out"), False
    return box.get("out"), True


def _identity_in_thread(spec, out_dir, limit):
    from dflash_audit.audit.sides.candidate_load import load_candidate_identity

    return _in_thread(lambda: load_candidate_identity(spec, out_dir), out_dir / "candidate.json",
                      limit)


@pytest.mark.parametrize("source, words", [
    (FIFO_IDENTITY, "before the candidate was loaded"),
    (NOT_AN_OBJECT, "is a JSON list, not an object"),
])
def test_an_identity_the_candidate_replaced_is_refused_not_waited_on(source, words, tmp_path,
                                                                     monkeypatch):
    """The candidate's import replaces its identity file with a FIFO (a read would block
    forever: compare and train hang) or with JSON that is no identity: one CandidateLoadError
    (exit 2), at once."""
    from dflash_audit.audit.sides.candidate_process import CandidateLoadError
    from dflash_audit.audit.sides.sandbox import work_root

    (tmp_path / "replaces.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    out_dir = Path(__import__("tempfile").mkdtemp(dir=work_root())) / "identity"
    try:
        out, ended = _identity_in_thread("replaces.py:Candidate", out_dir, limit_s(120.0))
        assert ended, "the identity read blocked on a FIFO"
        assert isinstance(out, CandidateLoadError) and words in str(out), out
    finally:
        __import__("shutil").rmtree(out_dir.parent, ignore_errors=True)


def test_a_flood_of_output_from_the_candidate_costs_no_memory(tmp_path, monkeypatch):
    """Its import prints 256 MiB and dies: the setup error keeps only the tail, and this
    process never holds the flood (its traced peak stays far under it)."""
    import tracemalloc

    from dflash_audit.audit.sides.candidate_process import TAIL_CHARS, CandidateLoadError
    from dflash_audit.audit.sides.sandbox import work_root

    (tmp_path / "flood.py").write_text(FLOOD)
    monkeypatch.chdir(tmp_path)
    out_dir = Path(__import__("tempfile").mkdtemp(dir=work_root())) / "identity"
    tracemalloc.start()
    try:
        out, ended = _identity_in_thread("flood.py:Candidate", out_dir, limit_s(120.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        __import__("shutil").rmtree(out_dir.parent, ignore_errors=True)
    assert ended and isinstance(out, CandidateLoadError) and "exit code 7" in str(out)
    assert str(out).endswith("x" * 100) and len(str(out)) < TAIL_CHARS + 300
    assert peak < 32 << 20, f"held {peak >> 20} MiB of the candidate's output"


FIFO_HEARTBEAT = """
import os, sys, time
os.mkfifo(os.path.join(sys.argv[2], "started.json"))  # read by compare while it runs
time.sleep(2)
os._exit(0)
"""


def test_a_heartbeat_the_candidate_replaced_with_a_fifo_never_blocks_compare(tmp_path,
                                                                            monkeypatch):
    """Compare polls the runner's heartbeat while the candidate runs: a FIFO there is no
    heartbeat (never waited on), and the case ends as a startup failure."""
    from dflash_audit.audit.sides.candidate_process import run_candidate_process
    from dflash_audit.audit.sides.candidate_runner import HEARTBEAT
    from dflash_audit.audit.sides.sandbox import work_root

    assert HEARTBEAT in FIFO_HEARTBEAT
    (tmp_path / "beats.py").write_text(FIFO_HEARTBEAT)
    (tmp_path / "cases").mkdir()
    monkeypatch.chdir(tmp_path)
    root = Path(__import__("tempfile").mkdtemp(dir=work_root()))
    try:
        out, ended = _in_thread(lambda: run_candidate_process(
            "beats.py:Candidate", tmp_path / "cases", ["x"], root / "out",
            startup_timeout_s=limit_s(120.0)), root / "out" / HEARTBEAT, limit_s(120.0))
        assert ended, "compare blocked on the heartbeat FIFO"
        assert out["x"].status == "startup" and "ended (code 0)" in out["x"].summary, out
    finally:
        __import__("shutil").rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("outputs_json", ["fifo", "[1, 2]", "[" * 5000 + "]" * 5000, "link"])
def test_a_failing_candidates_outputs_never_break_the_canary_staging(outputs_json, tmp_path):
    """Compare stages the canary before the verdict is known, from the candidate's own output
    folder: an ``outputs.json`` that is a FIFO (a read blocks for ever), no object, nested
    too deeply, or a planted symlink, stages no canary -- never a hang or a traceback."""
    from types import SimpleNamespace

    from dflash_audit.atomic import save_safetensors
    from dflash_audit.audit.sides.canary import stage_canary

    case = SimpleNamespace(name="synthetic-00", unsupported=False)
    src, out = tmp_path / "cases" / case.name, tmp_path / "outputs" / case.name
    src.mkdir(parents=True)
    out.mkdir(parents=True)
    for name in ("inputs", "weights"):
        save_safetensors({"w": __import__("torch").zeros(2)}, src / f"{name}.safetensors")
    (src / "profile.json").write_text("{}")
    save_safetensors({"loss": __import__("torch").zeros(())}, out / "outputs.safetensors")
    target = out / "outputs.json"
    if outputs_json == "fifo":
        os.mkfifo(target)
    elif outputs_json == "link":
        (tmp_path / "elsewhere.json").write_text('{"trainable": [], "metrics": {}}')
        target.symlink_to(tmp_path / "elsewhere.json")
    else:
        target.write_text(outputs_json)
    out_, ended = _in_thread(lambda: stage_canary(
        [SimpleNamespace(case=case, kind="synthetic")], tmp_path / "cases",
        tmp_path / "outputs", tmp_path / "staging"), target, 60)
    assert ended, "staging the canary blocked on a FIFO"
    assert out_ is None, out_
