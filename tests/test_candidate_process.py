"""The candidate in its own process: every way it can die, hang or misbehave is a failure of
that case, with its cause and stderr tail; the other cases still run; nothing hangs."""

import json
import os
from pathlib import Path

import pytest
import torch
from session_share import once_per_run

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.options import CANDIDATE_TIMEOUT_ENV
from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.sides.candidate_process import (
    CandidateLoadError,
    read_candidate_outputs,
    run_candidate_process,
)
from dflash_audit.audit.sides.run_sides import write_cases
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.limits import limit_s
from dflash_audit.profile import Profile

HERE = Path(__file__).parent
CHAOS = f"{HERE / 'isolation_candidates.py'}:ChaosCandidate"
#: The per-case limit of the chaos run: long enough for a good case on a busy machine (8 s
#: quiet, scaled with the load: dflash_audit.limits), what the hanging case (c45) is killed at.
CASE_TIMEOUT_S = float(round(limit_s(8.0)))


def tiny_cases(lengths):
    base = plan_synthetic_cases(Profile.load("reference-model"), 1, seed=8)[0].case
    config = base.config.replace(block_size=4)
    return [synthetic_case(f"c{T}", config, base.loss, seed=T, seq_len=T, max_anchors=3)
            for T in lengths]


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory):
    return once_per_run(tmp_path_factory, "chaos", _chaos_run)


def _chaos_run(tmp: Path):
    cases = tiny_cases(range(40, 49))
    write_cases(cases, tmp / "cases")
    seen = []
    with pytest.MonkeyPatch.context() as env:  # the limit by its variable, as a user sets it
        env.setenv(CANDIDATE_TIMEOUT_ENV, str(CASE_TIMEOUT_S))
        runs = run_candidate_process(CHAOS, tmp / "cases", [c.name for c in cases],
                                     tmp / "out", threads=1, on_case=seen.append)
    return cases, runs, seen, tmp


def test_every_case_gets_one_result(chaos_run):
    cases, runs, seen, _ = chaos_run
    assert sorted(runs) == sorted(c.name for c in cases)
    assert sorted(r.case for r in seen) == sorted(runs)  # on_case once per case


@pytest.mark.parametrize("name,status,fragment", [
    ("c41", "exit", "called sys.exit(0)"),
    ("c42", "exit", "exited with code 3 while running the case"),
    ("c43", "crash", "crashed with SIGSEGV while running the case (segmentation fault"),
    ("c44", "killed", "was killed by SIGKILL while running the case (the kernel's OOM killer"),
    ("c45", "timeout", "run_case did not finish in {limit:.0f} s (load "),  # ids load-free
    ("c47", "raised", "the candidate's run_case raised RuntimeError: boom in run_case"),
])
def test_fault_is_a_failed_case_with_cause(chaos_run, name, status, fragment):
    run = chaos_run[1][name]
    assert run.status == status
    assert fragment.format(limit=CASE_TIMEOUT_S) in run.summary
    assert "chaos: " in run.stderr_tail  # the candidate's own stderr, kept for the report
    check = run.to_check_result()
    assert (check.name, check.status, check.details["cause"]) == ("run", "fail", status)


def test_a_timeout_names_the_option_and_the_variable_to_raise(chaos_run):
    more = int(CASE_TIMEOUT_S * 3)
    assert chaos_run[1]["c45"].summary.endswith(
        f"raise the limit with --candidate-timeout {more} (or {CANDIDATE_TIMEOUT_ENV}={more} "
        "or DFLASH_AUDIT_TIMEOUT_SCALE=3 for every limit)")


def test_segfault_tail_has_the_python_stack(chaos_run):
    assert "Fatal Python error: Segmentation fault" in chaos_run[1]["c43"].stderr_tail
    assert "isolation_candidates.py" in chaos_run[1]["c43"].stderr_tail


def test_timeout_is_measured_per_case(chaos_run):
    assert CASE_TIMEOUT_S <= chaos_run[1]["c45"].seconds < CASE_TIMEOUT_S + 10.0


def test_good_cases_around_the_faults_ran_and_match_in_process(chaos_run):
    cases, runs, _, tmp = chaos_run
    for case in cases:
        if case.name in ("c40", "c46", "c48"):
            assert runs[case.name].ok, runs[case.name]
            out = read_candidate_outputs(tmp / "out", case.name)
            inproc = DrafterCandidate().run_case(case.config, case.loss, case.weights,
                                                 {k: v.clone() for k, v in case.inputs.items()})
            assert torch.equal(out.tensors["logits"], inproc.tensors["logits"])
            assert out.tensors["mask.full_attention"].dtype == torch.bool
            assert out.tensors["anchor_draws"].shape[0] == 512
            assert out.metrics["loss_sum"] == inproc.metrics["loss_sum"]


def test_stdout_does_not_mix_into_ours(chaos_run, capfd):
    runs, tmp = chaos_run[1], chaos_run[3]
    assert "candidate noise" not in capfd.readouterr().out
    assert "candidate noise on stdout" in "".join(
        p.read_text() for p in (tmp / ".out.logs").glob("stdout-*.txt"))
    assert runs["c46"].ok


def test_load_error_is_a_setup_error(tmp_path):
    cases = tiny_cases([40])
    write_cases(cases, tmp_path / "cases")
    with pytest.raises(CandidateLoadError, match="has no attribute 'Nope'"):
        run_candidate_process(f"{HERE / 'isolation_candidates.py'}:Nope", tmp_path / "cases",
                              ["c40"], tmp_path / "out")


def test_exit_while_loading_fails_every_case_without_looping(tmp_path):
    cases = tiny_cases([40, 41])
    write_cases(cases, tmp_path / "cases")
    runs = run_candidate_process(f"{HERE / 'isolation_candidates.py'}:ExitAtImport",
                                 tmp_path / "cases", ["c40", "c41"], tmp_path / "out")
    assert {r.status for r in runs.values()} == {"startup"}
    assert "ended (code 0) before running it" in runs["c40"].summary


def test_case_and_outputs_round_trip(tmp_path):
    case = tiny_cases([40])[0]
    back = Case.read(case.write(tmp_path))
    assert back.config == case.config and back.loss == case.loss
    assert all(torch.equal(back.inputs[k], v) for k, v in case.inputs.items())
    out = SideOutputs(tensors={"a": torch.arange(6).reshape(2, 3).t()},  # not contiguous
                      metrics={"eal": float("nan"), "odd": [1]}, structure={"x": 1})
    out.write(tmp_path)
    again = SideOutputs.read(tmp_path)
    assert torch.equal(again.tensors["a"], out.tensors["a"])
    assert again.metrics["eal"] != again.metrics["eal"]  # NaN survives
    assert again.metrics["odd"] == "[1]"
    with pytest.raises(TypeError, match=r"tensors\['b'\] is a list; expected a torch.Tensor"):
        SideOutputs(tensors={"b": [1]}, metrics={}, structure={}).write(tmp_path)


def test_candidate_side_in_compare_form(chaos_run):
    from dflash_audit.audit.sides.candidate_process import candidate_side

    _, runs, _, tmp = chaos_run
    side = candidate_side(runs, tmp / "out")
    assert side["c40"][1] is None and "logits" in side["c40"][0].tensors
    assert side["c45"][0] is None and side["c45"][1].details["cause"] == "timeout"


def test_load_only_gives_the_identity_without_importing_here(tmp_path):
    from dflash_audit.audit.sides.candidate_load import load_candidate_identity

    ident = load_candidate_identity(CHAOS, tmp_path)
    assert ident["name"] == "chaos" and ident["has_select_anchors"] is True
    assert any(f.endswith("isolation_candidates.py") for f in ident["source_files"])
    with pytest.raises(CandidateLoadError, match=r"ended \(exit code 0\) before the candidate "
                                                 r"was loaded"):
        load_candidate_identity(f"{HERE / 'isolation_candidates.py'}:ExitAtImport", tmp_path)
    with pytest.raises(CandidateLoadError, match="has no attribute 'Nope'"):
        load_candidate_identity(f"{HERE / 'isolation_candidates.py'}:Nope", tmp_path)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="prctl is Linux")
def test_a_killed_compare_leaves_no_candidate_running(tmp_path):
    """kill -9 of the process that started the candidate runner kills the runner too
    (PR_SET_PDEATHSIG), here while the candidate's import hangs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "hangs.py").write_text("import time\ntime.sleep(600)\ncandidate = None\n")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'dflash_audit.audit.sides.candidate_runner', "
        f"{str(tmp_path)!r}, {str(tmp_path / 'out')!r}, '--candidate', "
        f"{str(tmp_path / 'hangs.py') + ':candidate'!r}, '--load-only'])\n"
        "print(p.pid, flush=True)\ntime.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    runner = int(parent.stdout.readline())
    time.sleep(3)  # the runner is importing the candidate
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(runner, 0)
            if Path(f"/proc/{runner}/stat").read_text().split()[2] == "Z":  # init reaps it
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.1)
    else:
        os.kill(runner, signal.SIGKILL)
        pytest.fail("the candidate runner outlived the process that started it")


def test_threads_per_side_follow_dflash_audit_threads(monkeypatch):
    """Each side's intra-op threads: every usable core, or ``$DFLASH_AUDIT_THREADS`` on a shared
    machine; a value that is not a positive integer is a setup error naming it."""
    from dflash_audit.audit.setup_error import CompareSetupError
    from dflash_audit.audit.sides.run_sides import usable_cores

    monkeypatch.delenv("DFLASH_AUDIT_THREADS", raising=False)
    assert usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("DFLASH_AUDIT_THREADS", "3")
    assert usable_cores() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("DFLASH_AUDIT_THREADS", bad)
        with pytest.raises(CompareSetupError, match=f"DFLASH_AUDIT_THREADS='{bad}'"):
            usable_cores()


@pytest.mark.parametrize("where", ["cases", "private copy"])
def test_a_full_work_folder_is_a_setup_error_not_a_traceback(where, tmp_path, monkeypatch):
    # no space left writing the cases (safetensors raises its own error, not OSError) or
    # copying them for the candidate: one message naming the folder (exit 2)
    import errno
    import shutil

    from safetensors import SafetensorError

    from dflash_audit.audit.setup_error import CompareSetupError
    from dflash_audit.audit.sides.run_sides import write_work_cases

    if where == "cases":
        def full(self, folder):
            raise SafetensorError("Error while serializing: I/O error: No space left on device "
                                  "(os error 28)")
        monkeypatch.setattr(Case, "write", full)
    else:
        def full(src, dst, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(CompareSetupError, match="cannot write the cases into .*No space left"):
        write_work_cases(tiny_cases([40]), tmp_path / "work")


def _starts(out_dir: Path) -> int:
    """How many candidate processes wrote into ``out_dir``: one stdout log each."""
    return len(list(out_dir.parent.joinpath(f".{out_dir.name}.logs").glob("stdout-*.txt")))


def test_one_process_loads_the_candidate_then_runs_cases_written_after(tmp_path):
    """The audit's candidate process (WaitingCandidate) reports its identity before any case
    exists, blocks, then runs the cases handed over: in the sandbox one process in all (the
    candidate imported once); without one, a fresh process runs them (it never lives while
    the cases are written)."""
    from dflash_audit.audit.sides.candidate_load import WaitingCandidate
    from dflash_audit.audit.sides.sandbox import sandbox_status

    cases = tiny_cases([40, 47])
    mine, out = tmp_path / "mine", tmp_path / "out"
    with WaitingCandidate(CHAOS, mine, out, threads=1) as waiting:
        assert waiting.identity["name"] == "chaos" and waiting.identity["has_select_anchors"]
        assert list(mine.iterdir()) == []  # loaded before any case was written
        write_cases(cases, mine)
        runs = run_candidate_process(CHAOS, mine, ["c40", "c47"], out, threads=1,
                                     waiting=waiting)
    assert runs["c40"].ok and runs["c47"].status == "raised"  # ChaosCandidate raises on 47
    if sandbox_status().available:  # one, unless a concurrent audit registered a folder
        # every sandbox hides meanwhile (its view then differs: a fresh process, as before)
        assert _starts(out) == 1 or (_starts(out), waiting.fallback) == (2, "sandbox changed")
    else:
        assert _starts(out) == 2


def test_a_bound_folder_replaced_meanwhile_gets_a_fresh_process(tmp_path):
    """A folder bound from the start (compare's ``--verifier``) holds what was there then: one
    replaced by a rename before the cases are handed over is another folder, so a fresh
    process (with the folder as it is now) runs them (found by the hostile review: the old
    folder's config made a correct candidate FAIL its derivation)."""
    from dflash_audit.audit.sides.candidate_load import WaitingCandidate
    from dflash_audit.audit.sides.reference_records import record_dirs
    from dflash_audit.audit.sides.sandbox import sandbox_status

    folder, other = tmp_path / "verifier", tmp_path / "other"
    folder.mkdir()
    other.mkdir()
    record_dirs()  # as compare does: the folders every sandbox hides exist before it starts
    mine, out = tmp_path / "mine", tmp_path / "out"
    with WaitingCandidate(None, mine, out, threads=1, readable=[folder]) as waiting:
        folder.rename(tmp_path / "old")
        other.rename(folder)
        write_cases(tiny_cases([40]), mine)
        runs = run_candidate_process(None, mine, ["c40"], out, threads=1, waiting=waiting)
    assert runs["c40"].ok and _starts(out) == 2
    if sandbox_status().available:  # without one a fresh process runs the cases anyway
        assert waiting.fallback == "sandbox changed"


def test_a_waiting_process_that_died_is_replaced_by_a_fresh_one(tmp_path):
    from dflash_audit.audit.sides.candidate_load import WaitingCandidate

    cases = tiny_cases([40])
    mine, out = tmp_path / "mine", tmp_path / "out"
    with WaitingCandidate(None, mine, out, threads=1) as waiting:
        if waiting.proc is not None:
            os.killpg(waiting.proc.pid, 9)
            waiting.proc.wait()
        write_cases(cases, mine)
        runs = run_candidate_process(None, mine, ["c40"], out, threads=1, waiting=waiting)
    assert runs["c40"].ok and _starts(out) == 2


def test_a_load_error_of_the_waiting_process_is_the_load_error(tmp_path):
    from dflash_audit.audit.sides.candidate_load import WaitingCandidate

    with pytest.raises(CandidateLoadError, match="has no attribute 'Nope'"):
        WaitingCandidate(f"{HERE / 'isolation_candidates.py'}:Nope", tmp_path / "m",
                         tmp_path / "o")
    with pytest.raises(CandidateLoadError, match=r"ended \(exit code 0\) before the candidate "
                                                 r"was loaded"):
        WaitingCandidate(f"{HERE / 'isolation_candidates.py'}:ExitAtImport", tmp_path / "m2",
                         tmp_path / "o2")


FRAMEWORK_ADAPTER = """\
NAME, VERSION = "GateFW", "1.0"
FRAMEWORK_MODULES = ["gate_fw_core"]
from dflash_audit.candidate import DrafterCandidate
candidate = DrafterCandidate()
"""
GATED_MODULE = """\
import os, time
from pathlib import Path
gate = Path(__file__).with_name("gate")
while not gate.exists():  # the framework's import goes on until the test opens the gate
    time.sleep(0.05)
if gate.read_text() == "crash":
    os._exit(7)
if gate.read_text() == "raise":
    raise RuntimeError("no GPU found")
"""


@pytest.fixture(params=["sandbox", "no sandbox"])
def sandbox_mode(request, monkeypatch):
    """Each mode the candidate runs in: the sandbox where this machine has one (skipped where
    not), and none (``DFLASH_AUDIT_SANDBOX=off``)."""
    from dflash_audit.audit.sides import sandbox as sb

    if request.param == "no sandbox":
        monkeypatch.setenv(sb.SANDBOX_ENV, "off")
    sb.sandbox_status.cache_clear()
    if request.param == "sandbox" and not sb.sandbox_status().available:
        pytest.skip("no bubblewrap sandbox on this machine")
    yield request.param
    monkeypatch.undo()
    sb.sandbox_status.cache_clear()


#: what the gated framework module does once opened, and the load error that follows (None: none)
GATE_OUTCOMES = {"imports": ("go", None),
                 "crashes": ("crash", r"loading candidate 'framework:gatefw' ended \(exit code 7\)"
                                      r" before the candidate was loaded"),
                 "raises": ("raise", r"^framework:gatefw \(GateFW 1\.0\): RuntimeError while "
                                     r"importing FRAMEWORK_MODULES: no GPU found$")}


def test_a_frameworks_load_error_names_it_as_the_user_did(tmp_path):
    """A framework's load error names ``framework:KEY`` (name and version), not the internal
    spec of its adapter module; a plain candidate's message is the runner's."""
    from dflash_audit.audit.sides.candidate_process import load_error
    from dflash_audit.audit.sides.launch import CandidateLaunch

    spec = "dflash_audit.audit.frameworks.zlab_adapter:candidate"
    module = spec.split(":")[0]  # in a path it is no name of the candidate: left as it is
    text = f"could not import candidate {module!r}: OSError: /x/{module}.json"
    (tmp_path / "load_error.json").write_text(json.dumps({"message": text}))
    framework = CandidateLaunch(spec=spec, framework={"key": "zlab", "name": "z-lab dflash",
                                                      "version": "0.1"})
    assert str(load_error(tmp_path, framework)) == (
        "framework:zlab (z-lab dflash 0.1): could not import candidate 'framework:zlab': "
        f"OSError: /x/{module}.json")
    assert str(load_error(tmp_path, CandidateLaunch(spec=spec))) == text


def test_a_module_the_adapter_lists_that_is_not_there_names_the_list_not_importlib(
        tmp_path, monkeypatch):
    """A FRAMEWORK_MODULES entry that is not installed: the importer is the adapter's list
    (it was importlib/__init__.py, the last frame outside the frozen machinery), and the
    setup error names the framework as ``framework:KEY (Name version)``."""
    import sys
    import types

    from dflash_audit.audit.frameworks.import_failure import import_failure_message
    from dflash_audit.audit.sides.candidate_runner import import_failure, import_framework_modules
    from dflash_audit.audit.sides.launch import CandidateLaunch

    adapter = types.ModuleType("listing_fw_adapter")
    adapter.FRAMEWORK_MODULES = ["listing_fw_not_installed"]
    monkeypatch.setitem(sys.modules, adapter.__name__, adapter)
    with pytest.raises(ImportError) as raised:
        import_framework_modules(f"{adapter.__name__}:candidate")
    failure = import_failure(raised.value)
    assert failure == {"missing_module": "listing_fw_not_installed",
                       "importer": "the adapter's FRAMEWORK_MODULES",
                       "error": "ModuleNotFoundError: No module named 'listing_fw_not_installed'"}
    launch = CandidateLaunch(spec=f"{adapter.__name__}:candidate", python=sys.executable,
                             framework={"key": "listfw", "name": "ListFW", "version": "2.1"})
    assert import_failure_message(launch, failure).startswith(
        "framework:listfw (ListFW 2.1) cannot import 'listing_fw_not_installed' (the adapter's "
        "FRAMEWORK_MODULES imports it) when its candidate loaded, before any case: ")


@pytest.mark.parametrize("outcome", list(GATE_OUTCOMES))
def test_a_framework_imports_its_modules_while_the_cases_are_built(outcome, sandbox_mode,
                                                                     tmp_path):
    """A framework's waiting process reports its identity before it imports FRAMEWORK_MODULES
    (the parent builds the cases meanwhile: a ModelOpt audit 1.9x -> 1.6x the default one);
    the cases are handed over once they are imported, to the same process; a process that
    dies importing them is the load error it was before the reordering, never a case's
    failure. Without a sandbox the process is ended only once the import is done (it was
    killed half way, and a crash there became every case's failure, exit 1)."""
    import threading

    from dflash_audit.audit.sides.candidate_load import WaitingCandidate
    from dflash_audit.audit.sides.launch import CandidateLaunch

    folder = tmp_path / "fw"
    folder.mkdir()
    (folder / "gate_fw_adapter.py").write_text(FRAMEWORK_ADAPTER)
    (folder / "gate_fw_core.py").write_text(GATED_MODULE)
    launch = CandidateLaunch(spec="gate_fw_adapter:candidate", pythonpath=[str(folder)],
                             framework={"key": "gatefw", "name": "GateFW", "version": "1.0"})
    mine, out = tmp_path / "mine", tmp_path / "out"
    gate, failure = GATE_OUTCOMES[outcome]
    if sandbox_mode == "no sandbox":  # the constructor waits for the import: opened meanwhile
        opener = threading.Timer(1.0, (folder / "gate").write_text, [gate])
        opener.start()
        try:
            if failure:
                with pytest.raises(CandidateLoadError, match=failure):
                    WaitingCandidate(launch, mine, out, threads=1, timeout_s=limit_s(30.0))
                return
            with WaitingCandidate(launch, mine, out, threads=1,
                                  timeout_s=limit_s(30.0)) as waiting:
                assert waiting.proc is None  # ended, after its import
                write_cases(tiny_cases([40]), mine)
                runs = run_candidate_process(launch, mine, ["c40"], out, threads=1,
                                             waiting=waiting)
        finally:
            opener.join()
        assert runs["c40"].ok and _starts(out) == 2
        return
    # the identity comes while the gate is shut: before the fix, a load timeout here
    with WaitingCandidate(launch, mine, out, threads=1, timeout_s=limit_s(30.0)) as waiting:
        assert waiting.identity["adapter"]["NAME"] == "GateFW"  # while the import waits
        write_cases(tiny_cases([40]), mine)
        (folder / "gate").write_text(gate)
        if failure:
            with pytest.raises(CandidateLoadError, match=failure):
                run_candidate_process(launch, mine, ["c40"], out, threads=1, waiting=waiting)
            return
        runs = run_candidate_process(launch, mine, ["c40"], out, threads=1, waiting=waiting)
    assert runs["c40"].ok
    assert _starts(out) == 1 or waiting.fallback == "sandbox changed"
