"""What the candidate's process did on one case (:class:`CandidateCaseRun`: ran, raised,
exited, crashed, was killed, timed out, did not start) and the words for how a process died
(:func:`death_summary`); :mod:`.candidate_process` watches the process and records them.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

#: Statuses of :class:`CandidateCaseRun` (``ok`` and the failure causes).
CAUSES = {"ok": "ran", "raised": "raised an exception", "exit": "exited",
          "protocol": "broke the output protocol", "crash": "crashed", "killed": "was killed",
          "timeout": "timed out", "startup": "did not start"}
SIGNAL_HINTS = {
    signal.SIGSEGV: "segmentation fault: native code (an extension, a kernel) read invalid "
                    "memory",
    signal.SIGKILL: "the kernel's OOM killer sends SIGKILL when memory runs out",
    signal.SIGABRT: "abort: a native assertion or an uncaught C++ exception",
    signal.SIGBUS: "bus error: invalid memory access in native code",
}


@dataclass
class CandidateCaseRun:
    """What the candidate process did on one case.

    ``status`` is a key of :data:`CAUSES`; ``summary`` one line for the report; ``detail``
    the candidate's traceback when it raised; ``stderr_tail`` / ``stdout_tail`` the last
    :data:`.candidate_process.TAIL_CHARS` characters of what the process printed up to then.
    """

    case: str
    status: str
    summary: str = ""
    detail: str = ""
    stderr_tail: str = ""
    stdout_tail: str = ""
    seconds: float | None = None
    #: causes named from the raise's message (:func:`dflash_audit.audit.sides.raised.name_raise`)
    diagnosis: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_status(cls, case: str, status: dict[str, Any]) -> CandidateCaseRun:
        """The run recorded by a ``status.json`` of :mod:`.candidate_runner`."""
        diagnosis = status.get("diagnosis")
        return cls(case, str(status.get("status", "protocol")), str(status.get("summary", "")),
                   str(status.get("traceback", "")),
                   diagnosis=[str(d) for d in diagnosis] if isinstance(diagnosis, list) else [])

    def to_check_result(self) -> Any:
        """The failing ``run`` CheckResult of a failed case (cause, traceback, stderr tail)."""
        from dflash_audit.audit.result import FAIL, CheckResult

        hint = {"timeout": [("the candidate did not finish the case in time: an endless loop, "
                            "a deadlock, or a case far slower than the reference (raise "
                            "--candidate-timeout if it is only slow)")],
                "killed": ["out of memory is the usual cause of SIGKILL"],
                "exit": ["the candidate must return SideOutputs from run_case, not exit"],
                "raised": ["the candidate's parameters do not match the reference's state dict "
                           "(names or shapes): compare fc in/out features, layer count and "
                           "head sizes with the reference"]
                if "state_dict" in self.summary or "size mismatch" in self.summary else [],
                "protocol": [("the candidate does not follow the protocol of "
                             "dflash_audit.candidate")]}.get(self.status, [])
        return CheckResult(name="run", case=self.case, status=FAIL, summary=self.summary,
                           diagnosis=[*self.diagnosis, *hint],
                           details={"cause": self.status, "traceback": self.detail,
                                    "stderr_tail": self.stderr_tail,
                                    "stdout_tail": self.stdout_tail, "seconds": self.seconds})


def death_summary(returncode: int) -> tuple[str, str]:
    """``(status, summary)`` for a candidate process that ended with ``returncode`` while a
    case ran (negative: killed by that signal, as :mod:`subprocess` reports it)."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        hint = SIGNAL_HINTS.get(sig)
        status = "killed" if sig in (signal.SIGKILL, signal.SIGTERM) else "crash"
        verb = "was killed by" if status == "killed" else "crashed with"
        return status, (f"the candidate process {verb} {sig.name} while running the case"
                        + (f" ({hint})" if hint else ""))
    return "exit", (f"the candidate process exited with code {returncode} while running the "
                    "case (os._exit or sys.exit in the candidate's code, or an interpreter "
                    "abort)")
