"""The canary: the gate checks the behaviour of the model train trains, not only its source.

A passing source fingerprint says nothing about a candidate whose behaviour depends on an
environment variable, a config file, a flag, or on whether it is being audited. So ``compare``
records, in the report folder, one case the candidate ran and the reference checked -- the
first real case when there is one (its drafter config is the one ``train`` builds for that
verifier and profile), else the first synthetic one -- and what the candidate computed on it:

- ``canary/case/``: ``inputs.safetensors``, ``profile.json`` and ``weights.safetensors``; of
  a real case without the verifier-owned full-vocabulary tensors (``embed_tokens``, and the
  heads unless a draft vocabulary selects rows of them): train's model holds them already,
  loaded from the same verifier, so they are checked by the outputs they produce;
- ``canary/outputs/``: the loss, the per-slot weights, the aligned loss mask and the gradient
  of every trainable weight of the case (``outputs.safetensors``) with the numeric metrics and
  trainable names (``outputs.json``). Nothing outside the output protocol is kept: an output
  only the candidate invented never reaches the report folder.

``report.json``'s ``candidate.canary`` names the case and its kind, the tolerance, and the
sha256 of every canary file; it is part of the report fingerprint and of the signature, so a
canary cannot be swapped. Before step 1 ``train`` loads the canary into the very model object
it is about to train, runs train's own step on it and compares
(:mod:`dflash_audit.train.canary`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dflash_audit.atomic import file_sha256, save_safetensors

CANARY_DIR = "canary"
#: At most this many metrics / trainable names are kept (a candidate chooses them).
MAX_NAMES = 512
#: Full-vocabulary verifier tensors left out of a real canary's weights.
VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")


def _pick(planned: list[Any], outputs_dir: Path) -> Any:
    """The canary's case: the first real (else synthetic) one the candidate has outputs for,
    in a folder of its that holds no symlink or special file (never followed)."""
    from dflash_audit.audit.sides.sandbox import links_in

    def ran_it(folder: Path) -> bool:
        return (not folder.is_symlink() and folder.is_dir() and not links_in(folder)
                and (folder / "outputs.safetensors").is_file())

    ran = [p for p in planned if not p.case.unsupported
           and ran_it(Path(outputs_dir) / p.case.name)]
    return next((p for p in ran if p.kind == "real"), None) or next(
        (p for p in ran if p.kind == "synthetic"), None)


def stage_canary(planned: list[Any], cases_dir: Path, outputs_dir: Path, staging: Path
                 ) -> dict[str, Any] | None:
    """Stage the canary (see the module docstring) into ``staging`` (``case/`` +
    ``outputs/``); returns the ``candidate.canary`` entry of the report, or None when no case
    ran without failure."""
    from safetensors import SafetensorError, safe_open

    from dflash_audit.audit.protocol import spec_for
    from dflash_audit.audit.tolerance import tolerance

    p = _pick(planned, outputs_dir)
    if p is None:
        return None
    src, out = Path(cases_dir) / p.case.name, Path(outputs_dir) / p.case.name
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "case").mkdir(parents=True)
    (staging / "outputs").mkdir(parents=True)
    for name in ("inputs.safetensors", "profile.json"):
        shutil.copy2(src / name, staging / "case" / name)
    def read(path: Path, keep: Any) -> dict[str, Any]:  # only the tensors kept are read
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep(k)}

    with safe_open(src / "weights.safetensors", framework="pt") as f:
        names = list(f.keys())
    omitted = []
    if p.kind == "real":
        omitted = [k for k in VERIFIER_OWNED if k in names and not (
            p.case.config.uses_draft_vocab and k != "embed_tokens.weight")]
    save_safetensors(read(src / "weights.safetensors", lambda k: k not in omitted),
                     staging / "case" / "weights.safetensors")
    found = _candidate_meta(out)
    if found is None:
        return None
    trainable, metrics = found
    kept = {"loss", "aligned_loss_mask", *(f"grad.{n}" for n in trainable if n in names)}
    try:  # nothing outside the protocol is kept
        tensors = read(out / "outputs.safetensors", lambda k: k in kept or (
            k.startswith("loss_weights.") and spec_for(k) is not None))
    except (OSError, SafetensorError):  # its run of the case failed: no canary
        return None
    save_safetensors({k: v.contiguous() for k, v in tensors.items()
                      if not k.startswith("loss_weights.") or v.numel() <= 2**20},
                     staging / "outputs" / "outputs.safetensors")
    (staging / "outputs" / "outputs.json").write_text(json.dumps(
        {"metrics": metrics, "structure": {}, "defaults": {}, "trainable": trainable},
        indent=1, sort_keys=True))
    files = {f.relative_to(staging).as_posix(): file_sha256(f)
             for f in sorted(staging.rglob("*")) if f.is_file()}
    return {"case": p.case.name, "kind": p.kind, "folder": CANARY_DIR,
            "tolerance": tolerance(p.case), "omitted_weights": omitted, "files": files}


def _candidate_meta(out: Path) -> tuple[list[str], dict[str, Any]] | None:
    """The trainable names and numeric metrics of the candidate's ``outputs.json`` in ``out``
    (at most :data:`MAX_NAMES` each); None when it is no readable JSON object (a symlink, a
    FIFO, too deep: the candidate's run of that case failed, and a failing audit records no
    canary)."""
    from dflash_audit.user_input import read_output_json

    try:
        meta = read_output_json(out / "outputs.json")
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    names, metrics = meta.get("trainable"), meta.get("metrics")
    trainable = [str(n) for n in names][:MAX_NAMES] if isinstance(names, list) else []
    metrics = {str(k): v for k, v in list(metrics.items())[:MAX_NAMES]
               if isinstance(v, (int, float)) and len(str(k)) <= 100} \
        if isinstance(metrics, dict) else {}
    return trainable, metrics


def publish_canary(staging: Path, report_folder: Path) -> None:
    """Copy the staged canary into ``report_folder/canary``."""
    shutil.copytree(staging, Path(report_folder) / CANARY_DIR)
