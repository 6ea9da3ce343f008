"""Runs INSIDE a candidate's own, sandboxed process: train's canary step on the model the
candidate builds (:mod:`dflash_audit.train.sealed` starts it before any candidate code is
imported in the process that trains, and judges what it writes).

Usage: ``python -m dflash_audit.train.canary_runner CASE_DIR OUT_DIR --candidate SPEC
[--seed N] [--threads N]``. CASE_DIR is the report's canary case with every weight
(:meth:`dflash_audit.audit.case.Case.write`: the verifier-owned ones the report leaves out
filled in by the parent from train's verifier); the recorded outputs are never given here, and
the report's canary folder is hidden from the sandbox.

The candidate is loaded, ``build(config)`` makes the drafter exactly as train does
(:func:`dflash_audit.train.setup.build_drafter`: seeded, fp32), the case's weights are loaded
into it and one step of train's own :func:`dflash_audit.train.step.train_step` with train's
forward (:func:`dflash_audit.train.step.drafter_forward`) runs on it
(:func:`dflash_audit.train.canary.canary_outputs`). Files written into OUT_DIR (the only
channel to the parent, the protocol of :mod:`dflash_audit.audit.sides.candidate_runner`):

- ``load_error.json`` = ``{"message"}`` when the candidate cannot be loaded (exit code 3);
- ``canary/status.json`` = ``{"status": "ok" | "raised", "summary", "traceback"}`` and, when
  ok, ``canary/outputs.safetensors`` (``loss`` and ``grad.<name>``) + ``outputs.json``
  (the step's metrics), published atomically.

Everything here runs in the candidate's process, so the candidate can change any of it: what
it writes is only an input to the parent's comparison, never a verdict.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import traceback
from pathlib import Path

#: The result folder's name in OUT_DIR.
RESULT = "canary"


def main(argv: list[str] | None = None) -> int:
    """Run the canary step; 0 when a result was published (whatever its status), 3 when the
    candidate cannot be loaded."""
    from dflash_audit.audit.sides.candidate_runner import (
        EXIT_LOAD_ERROR,
        LOAD_ERROR,
        die_with_parent,
        publish,
        write_json_atomic,
    )

    parser = argparse.ArgumentParser(prog="python -m dflash_audit.train.canary_runner")
    parser.add_argument("case_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    die_with_parent()
    faulthandler.enable()

    import torch

    from dflash_audit.audit.case import Case, SideOutputs
    from dflash_audit.candidate import CandidateError, load_candidate
    from dflash_audit.train.canary import canary_outputs
    from dflash_audit.train.gate import GateError
    from dflash_audit.train.setup import TrainError, build_drafter
    from dflash_audit.train.step import drafter_forward

    if args.threads:
        torch.set_num_threads(args.threads)
    case = Case.read(args.case_dir)  # ours, read before any candidate code runs
    target = args.candidate.rpartition(":")[0]
    if target.endswith(".py"):  # its sibling modules import, as when run as a script
        sys.path.insert(0, str(Path(target).resolve().parent))
    try:
        candidate = load_candidate(args.candidate)
    except CandidateError as exc:
        write_json_atomic(args.out_dir / LOAD_ERROR, {"message": str(exc)})
        return EXIT_LOAD_ERROR
    outputs = None
    try:
        model = build_drafter(candidate, case.config, None, args.seed)
        model.train()
        forward = drafter_forward(model, case.loss, case.config.block_size,
                                  case.config.sample_from_anchor)
        params = [p for p in model.parameters() if p.requires_grad]
        now, metrics = canary_outputs(model, case, forward, params)
        outputs = SideOutputs(tensors=now, metrics=metrics, structure={})
        status = {"status": "ok", "summary": "", "traceback": ""}
    except (GateError, TrainError) as exc:
        status = {"status": "raised", "summary": str(exc), "traceback": ""}
    except Exception as exc:  # noqa: BLE001 - the candidate's code: reported to the parent
        status = {"status": "raised", "summary": f"{type(exc).__name__}: {str(exc)[:300]}",
                  "traceback": traceback.format_exc()}
    publish(args.out_dir, RESULT, status, outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
