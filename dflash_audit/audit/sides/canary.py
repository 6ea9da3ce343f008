"""The canary: the gate checks the candidate's behaviour, not only its source.

A passing source fingerprint says nothing about a candidate whose behaviour depends on an
environment variable, a config file or a flag. So ``compare`` records, in the report folder,
one small synthetic case the candidate ran (``canary/case/``: inputs, weights, profile.json)
and the candidate's outputs on it (``canary/outputs/``), with their sha256 in
``report.json`` (``candidate.canary``). Before step 1, ``train`` reruns the candidate on that
case and compares its outputs with the recorded ones (:mod:`dflash_audit.train.canary`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dflash_audit.atomic import file_sha256

CANARY_DIR = "canary"


def stage_canary(planned: list[Any], cases_dir: Path, outputs_dir: Path, staging: Path
                 ) -> dict[str, Any] | None:
    """Copy the first synthetic case the candidate ran without failure, and its outputs,
    into ``staging`` (``case/`` + ``outputs/``); returns the ``candidate.canary`` entry of the
    report, or None when there is no such case."""
    from dflash_audit.audit.tolerance import tolerance

    for p in planned:
        out = Path(outputs_dir) / p.case.name
        if p.kind != "synthetic" or p.case.unsupported or not (
                out / "outputs.safetensors").is_file():
            continue
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(Path(cases_dir) / p.case.name, staging / "case")
        (staging / "outputs").mkdir(parents=True)
        for name in ("outputs.safetensors", "outputs.json"):
            shutil.copy2(out / name, staging / "outputs" / name)
        return {"case": p.case.name, "folder": CANARY_DIR, "tolerance": tolerance(p.case),
                "outputs_sha256": file_sha256(staging / "outputs" / "outputs.safetensors")}
    return None


def publish_canary(staging: Path, report_folder: Path) -> None:
    """Move the staged canary into ``report_folder/canary``."""
    shutil.copytree(staging, Path(report_folder) / CANARY_DIR)


