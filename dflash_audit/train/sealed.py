"""Train's gate decides before any candidate code is imported in the process that trains.

DESIGN.md section 9: a gate that imports the candidate before it decides is a gate the
candidate can replace (an import can rebind ``check_gate`` or ``run_canary`` in
:mod:`dflash_audit.train.loop`, or anything else in the process). So
:func:`dflash_audit.train.loop.train` runs, for a user's ``--candidate``:

1. :func:`decide` -- the candidate's identity (its source files) comes from a process of its
   own, sandboxed as in compare
   (:func:`~dflash_audit.audit.sides.candidate_load.load_candidate_identity`); its
   fingerprint is computed here by the function compare records it with
   (:func:`~dflash_audit.audit.sides.launch.identity_fingerprint`), which also
   hashes the files the spec names, located without running code -- a candidate whose
   process lies about its files still hashes its own; then the report lookup, signature,
   report fingerprint, profile, reference and verifier checks
   (:mod:`dflash_audit.train.gate`). Nothing of the candidate is imported here.
2. :func:`sealed_canary` -- the report's canary case through train's step on the model the
   candidate builds, in another process of its own
   (:mod:`dflash_audit.train.canary_runner`, same sandbox): it gets a private copy of the
   case (the verifier-owned weights the report leaves out filled in from train's verifier),
   never the recorded outputs, and the report's canary folder is hidden from it; what it
   writes is compared here with the recorded outputs
   (:func:`dflash_audit.train.canary.judge_canary`), in a process that has not run any of its
   code.
3. Only then is the candidate imported (``load_candidate``), the model built and the canary
   run once more, in this process, on the very model train trains
   (:func:`dflash_audit.train.canary.run_canary`; it catches a build() that behaves
   differently here: an environment variable, a config file, a flag). The functions of the
   modules that decide (:data:`GUARDED_MODULES`) are bound before the import
   (:class:`Binding`) and checked after it, after build() and after that canary: one that
   was replaced refuses the run.

Our own drafter (no ``--candidate``) is our code: its fingerprint is computed in this process
and only the in-process canary runs (no extra process, as fast as before).

What this cannot prove: once the candidate's code runs in train's process it can do anything
the process can (the binding check is evidence of a crude rebinding, not a proof). The
decision -- which report admits the run and that the candidate's build() behaves as audited on
its canary -- is made before that, where no candidate code can reach it. Where the sandbox
cannot start (:func:`~dflash_audit.audit.sides.sandbox.sandbox_status`) the candidate's
processes run without it, as in compare, and train says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash_audit.audit.options import CANDIDATE_START_TIMEOUT_S, CANDIDATE_TIMEOUT_ENV
from dflash_audit.audit.sides.candidate_load import load_candidate_identity
from dflash_audit.audit.sides.candidate_process import load_error, log_tail, runner_env
from dflash_audit.audit.sides.candidate_runner import EXIT_LOAD_ERROR, LOAD_ERROR, STATUS
from dflash_audit.audit.sides.launch import CandidateLaunch
from dflash_audit.audit.sides.sandbox import links_in, sandbox_status, sandboxed, work_root
from dflash_audit.candidate import is_our_drafter
from dflash_audit.limits import exceeded, limit_s
from dflash_audit.train.canary import check_canary_config, judge_canary, load_canary
from dflash_audit.train.canary_runner import RESULT
from dflash_audit.train.gate import GateError, GateResult, check_gate, expected_for
from dflash_audit.train.setup import TrainError

#: Seconds the sealed canary process may take on a quiet machine: start, import torch and the
#: candidate, build, one step (a real case on a loaded CPU takes well under a minute); scaled
#: with the load, set by ``$DFLASH_AUDIT_CANDIDATE_TIMEOUT`` (:func:`dflash_audit.limits.limit_s`).
CANARY_TIMEOUT_S = CANDIDATE_START_TIMEOUT_S + 300.0
#: Modules whose functions decide whether and how train runs: bound before the candidate is
#: imported, checked after (:class:`Binding`).
GUARDED_MODULES = ("dflash_audit.train.loop", "dflash_audit.train.gate",
                   "dflash_audit.train.canary", "dflash_audit.train.step",
                   "dflash_audit.train.sealed", "dflash_audit.audit.tolerance",
                   "dflash_audit.report.fingerprint")


@contextlib.contextmanager
def candidate_work(candidate_spec: str | None) -> Iterator[Path | None]:
    """A private work folder for the processes of a user's candidate, inside the audits' work
    root (:func:`~dflash_audit.audit.sides.sandbox.work_root`: hidden from every sandbox but
    the folders bound back), removed afterwards; None for our drafter (no process).

    Raises:
        TrainError: the work root cannot be used (its message says what to do).
    """
    from dflash_audit.audit.setup_error import CompareSetupError

    if is_our_drafter(candidate_spec):
        yield None
        return
    try:
        root = work_root()
    except CompareSetupError as exc:
        raise TrainError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="dflash-audit-train-", dir=root) as tmp:
        yield Path(tmp)


def decide(cfg: Any, profile: Any, verifier: Any, reference_identity: dict[str, Any] | None,
           work: Path | None, say: Callable[[str], None] | None = None) -> GateResult:
    """The gate's decision, before the candidate is imported in this process (step 1 of the
    module docstring).

    Args:
        cfg: the run's :class:`~dflash_audit.train.loop.TrainConfig` (``candidate``: None for
            our drafter, no process started; ``ref``, ``report``, ``reports_dir``).
        profile: the run's :class:`~dflash_audit.profile.Profile`.
        verifier: the run's resolved verifier (:func:`expected_for`).
        reference_identity: an already resolved reference identity (None: ``cfg.ref``
            resolved offline).
        work: a folder from :func:`candidate_work` (None: only for our drafter).
        say: where a warning goes (None: nowhere; rank 0 prints it).

    Raises:
        CandidateLoadError: the candidate cannot be loaded in its process (exit 2).
        GateError: no matching passing report, or an installation recorded as changed by an
            earlier audit's candidate (exit 2); or its audit failed (exit 1).
    """
    from dflash_audit.audit.setup_error import CompareSetupError
    from dflash_audit.audit.sides.integrity import tool_roots
    from dflash_audit.audit.sides.tamper_record import refuse_recorded_tampering

    try:  # an installation an earlier audit's candidate changed trains nothing either
        refuse_recorded_tampering(tool_roots().values())
    except CompareSetupError as exc:
        raise GateError(str(exc)) from None
    candidate_spec = cfg.candidate
    identity = None
    if not is_our_drafter(candidate_spec):
        if work is None:
            raise ValueError("decide: a user's candidate needs a work folder (candidate_work)")
        _warn_unsandboxed(say)
        identity = load_candidate_identity(candidate_spec, work / "identity")
    expected = expected_for(identity, candidate_spec, profile, cfg.ref, reference_identity,
                            Path(cfg.reports_dir), verifier)
    return check_gate(expected, Path(cfg.report) if cfg.report else None,
                      Path(cfg.reports_dir))


def _warn_unsandboxed(say: Callable[[str], None] | None) -> None:
    status = sandbox_status()
    if not status.available and say is not None:
        say(f"warning: the candidate's own processes (identity, canary) run without a sandbox "
            f"({status.reason}): they can write everything this user can")


def sealed_canary(candidate_spec: str | None, gate: GateResult, config: Any,
                  verifier_model: Any, seed: int, work: Path | None,
                  timeout_s: float | None = None) -> str | None:
    """Run the accepted report's canary through train's step on the model the candidate
    builds, in a sandboxed process of its own, and compare here (step 2 of the module
    docstring). None (nothing run) for our drafter (``work`` None).

    Args:
        gate: the accepted report (:func:`decide`).
        config: the drafter config train builds (the canary must have been recorded at it).
        verifier_model: train's verifier, for the verifier-owned weights the canary omits.
        seed: train's seed (``build()`` runs seeded, as in train).
        work: a folder from :func:`candidate_work`.

    Returns:
        a one-line note for the log, or None.

    Raises:
        GateError: the canary is damaged, recorded at another config, or the candidate's
            process fails on it, hangs, breaks the protocol or computes other outputs (exit 2).
        CandidateLoadError: the candidate cannot be loaded in that process (exit 2).
    """
    if work is None or is_our_drafter(candidate_spec):
        return None
    case, recorded = load_canary(gate.report_path, gate.canary)
    check_canary_config(case, config, gate.report_path)
    omitted = [k for k in (gate.canary or {}).get("omitted_weights") or [] if isinstance(k, str)]
    if omitted:  # train's model takes them from the verifier: so does this copy of the case
        from dflash_audit.model.verifier_weights import verifier_state

        t2d = case.weights.get("t2d") if config.uses_draft_vocab else None
        state = verifier_state(verifier_model, t2d)
        case.weights.update({k: state[k] for k in omitted if k in state})
    case_dir = case.write(work / "canary-case")
    out_dir = work / "canary-out"
    out_dir.mkdir()
    launch = CandidateLaunch(spec=candidate_spec)
    cmd = [launch.executable, "-m", "dflash_audit.train.canary_runner", str(case_dir),
           str(out_dir), "--candidate", candidate_spec, "--seed", str(seed)]
    env = runner_env(None, launch)
    canary_folder = gate.report_path.parent / str((gate.canary or {}).get("folder") or "canary")
    cmd = sandboxed(cmd, candidate_spec, case_dir.parent, out_dir, env, hidden=[canary_folder])
    where = f"the audit's canary case {case.name} of {gate.report_path}"
    stderr = work / "canary-stderr.txt"  # beside, not in, what the candidate can write
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    limit = limit_s(CANARY_TIMEOUT_S, CANDIDATE_TIMEOUT_ENV) if timeout_s is None else timeout_s
    try:
        returncode = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        raise GateError(exceeded(f"the candidate's process (sealed canary: {where}; does its "
                                 "import or build() hang?)", limit, CANDIDATE_TIMEOUT_ENV,
                                 scaled=timeout_s is None)) from None
    finally:  # also any process the candidate left behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if returncode == EXIT_LOAD_ERROR and (out_dir / LOAD_ERROR).is_file():
        raise load_error(out_dir, launch)
    result = out_dir / RESULT
    tail = log_tail(stderr).strip()  # the tail only: the candidate chose its length
    status = _read_result(result)
    if status is None:
        raise GateError(f"the candidate's process ended (exit code {returncode}) without "
                        f"a result on {where} (sealed canary): its import, build() or the step "
                        "exits or crashes" + (f"\n{tail[-600:]}" if tail else ""))
    if status.get("status") != "ok":
        raise GateError(f"the model candidate.build() returns fails on {where}, run through "
                        f"train's step in the candidate's own process: "
                        f"{str(status.get('summary'))[:600]}")
    try:
        from dflash_audit.audit.case import SideOutputs

        outputs = SideOutputs.read(result)
    except (OSError, ValueError, KeyError) as exc:
        raise GateError(f"the candidate's process wrote unreadable outputs for {where} "
                        f"(sealed canary): {type(exc).__name__}: {exc}") from None
    bad = sorted(k for k, v in outputs.metrics.items()
                 if isinstance(v, bool) or not isinstance(v, (int, float)))
    if bad:
        raise GateError(f"the candidate's process wrote metrics that are not numbers ({bad[:3]}) "
                        f"for {where} (sealed canary)")
    judge_canary(outputs.tensors, outputs.metrics, recorded, gate.canary, case.name,
                 gate.report_path, where="train's step in a sandboxed process of the candidate")
    return (f"canary {case.name}: train's step on the model the candidate builds, in its own "
            "process, gives the audited loss and gradients")


def _read_result(folder: Path) -> dict[str, Any] | None:
    """The runner's ``status.json`` in ``folder``; None when it is missing, unreadable, or the
    folder holds symlinks or special files (a planted link is never followed)."""
    from dflash_audit.user_input import read_output_json

    if folder.is_symlink() or not folder.is_dir() or links_in(folder):
        return None
    try:
        status = read_output_json(folder / STATUS)
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


class Binding:
    """The functions and classes of :data:`GUARDED_MODULES` as they are now (before any
    candidate code runs in this process); :meth:`check` refuses when one was replaced."""

    def __init__(self) -> None:
        import importlib

        self._bound: dict[tuple[str, str], Any] = {}
        for name in GUARDED_MODULES:
            module = importlib.import_module(name)
            for attr, value in vars(module).items():
                if callable(value) and not attr.startswith("__"):
                    self._bound[(name, attr)] = value

    def replaced(self) -> list[str]:
        """``module.name`` of every bound function or class no longer the same object."""
        return [f"{m}.{a}" for (m, a), value in self._bound.items()
                if getattr(sys.modules.get(m), a, None) is not value]

    def check(self, when: str) -> None:
        """Raises:
            GateError: a bound function was replaced (exit 2), naming the first ones.
        """
        changed = self.replaced()
        if changed:
            raise GateError(f"the candidate's code replaced dflash-audit's own functions "
                            f"{', '.join(changed[:4])} {when}: a candidate must not change the "
                            "tool that gates and trains it; refusing to train")
