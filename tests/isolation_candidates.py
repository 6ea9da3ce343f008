"""Faulty candidates for tests/test_candidate_process.py, loaded as ``file.py:attr`` by the
candidate process. ``ChaosCandidate`` picks its fault from the case's sequence length T
(:data:`FAULTS`), so one run exercises every fault and the runner's restarts."""

import ctypes
import os
import signal
import sys
import time

from dflash_audit.candidate import DrafterCandidate

#: T of a synthetic case -> what the candidate does on it.
FAULTS = {40: "ok", 41: "sys_exit_0", 42: "os_exit_3", 43: "segfault", 44: "sigkill",
          45: "sleep", 46: "print", 47: "raise", 48: "ok"}


class ChaosCandidate(DrafterCandidate):
    name = "chaos"

    def run_case(self, config, loss, weights, inputs):
        fault = FAULTS.get(int(inputs["input_ids"].shape[-1]), "ok")
        print(f"chaos: {fault}", file=sys.stderr, flush=True)
        if fault == "sys_exit_0":
            sys.exit(0)
        if fault == "os_exit_3":
            os._exit(3)
        if fault == "segfault":
            ctypes.string_at(0)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "sleep":
            time.sleep(3600)
        if fault == "print":
            print("candidate noise on stdout " * 10, flush=True)
        if fault == "raise":
            raise RuntimeError("boom in run_case")
        return super().run_case(config, loss, weights, inputs)


class ExitAtImport:
    """A factory that calls os._exit(0) while the runner loads it: nothing can run."""

    def __new__(cls):
        os._exit(0)
