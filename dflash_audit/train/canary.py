"""The gate's canary check: before step 1, ``train`` runs the canary an audit recorded
(:mod:`dflash_audit.audit.sides.canary`) through its own step
(:func:`dflash_audit.train.step.train_step`, with the forward function the loop trains with)
on the very model object it is about to train, in its own process, and compares the loss,
the metrics and every gradient with what the audited candidate computed on that case, at the
audit's tolerance. The model's own weights are put back afterwards (its initial weights, and
its gradients cleared), so training starts exactly as without the canary.

In train's process nothing here is a separate run the candidate could recognise by a second
``build()`` or a different call path: ``build()`` is called once, and the canary step is the
step function and forward of training itself. (Code running in train's process can still
inspect anything in it, and replace anything in it; the canary proves the model trained is
the model audited on one case, not more.) For a user's candidate the same step
(:func:`canary_outputs`) runs first in a sandboxed process of the candidate's own, before its
code is imported here, and what that process computed is judged here
(:func:`judge_canary`, :mod:`dflash_audit.train.sealed`): a check its import cannot replace.

A difference refuses training with exit code **2**, naming the first differing outputs; so
does a report whose canary was recorded at another drafter config (a report with synthetic
cases only, or one audited through a width-shrunk proxy of the verifier) -- train needs a
canary at the config it trains, which ``compare`` records from its first real case.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash_audit.atomic import file_sha256
from dflash_audit.audit.sides.canary import CANARY_DIR
from dflash_audit.train.gate import GateError

DEFAULT_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def output_differences(now: dict[str, Any], recorded: Any, tol: dict[str, float],
                       metrics: dict[str, float] | None = None) -> list[str]:
    """How the tensors ``now`` (``{name: tensor}``) and ``metrics`` differ from the
    ``recorded`` SideOutputs, one line per differing output with its first differing index;
    empty when they agree (recorded tensors missing from ``now`` and extra gradients are
    differences too)."""
    import torch

    from dflash_audit.audit.tolerance import closeness

    diffs = []
    for key, r in recorded.tensors.items():
        c = now.get(key)
        if c is None:
            if key.startswith("grad.") or key == "loss":
                diffs.append(f"{key}: not produced by the model train trains")
            continue
        c = c.detach().cpu().to(r.dtype) if c.is_floating_point() and r.is_floating_point() \
            else c.detach().cpu()
        if c.shape != r.shape or c.dtype != r.dtype:
            diffs.append(f"{key}: now {str(c.dtype)[6:]} {list(c.shape)}, audited "
                         f"{str(r.dtype)[6:]} {list(r.shape)}")
        elif r.is_floating_point():
            res = closeness(c, r, **tol)
            if not res.ok:
                non_finite = f", {res.non_finite_text()}" if res.num_non_finite else ""
                diffs.append(f"{key}: {res.num_bad} of {r.numel()} values differ (max abs "
                             f"{res.max_abs:.3g}{non_finite}), first at index "
                             f"{list(res.first_bad)}: now {float(c[res.first_bad]):.6g}, "
                             f"audited {float(r[res.first_bad]):.6g}")
        elif not torch.equal(c, r):
            diffs.append(f"{key}: {int((c != r).sum())} of {r.numel()} values differ")
    for key in sorted(k for k in now if k.startswith("grad.") and k not in recorded.tensors):
        diffs.append(f"{key}: trained now, not trainable in the audit")
    for key, c in (metrics or {}).items():
        r = recorded.metrics.get(key)
        if isinstance(r, (int, float)) and not (
                abs(c - r) <= 1e-4 * max(1.0, abs(r)) or (math.isnan(c) and math.isnan(r))):
            diffs.append(f"metric {key}: now {c}, audited {r}")
    return diffs


def load_canary(report_path: Path, info: dict[str, Any] | None) -> tuple[Any, Any]:
    """The canary ``(Case, recorded SideOutputs)`` of an accepted report, every file checked
    against its sha256 in ``report.json`` (signed with it).

    Raises:
        GateError: no canary entry, or a canary file missing or changed (exit code 2).
    """
    from dflash_audit.audit.case import Case, SideOutputs

    report_path = Path(report_path)
    if not info:
        raise GateError(f"the report {report_path} records no canary case; rerun the audit")
    folder = report_path.parent / str(info.get("folder") or CANARY_DIR)
    try:
        files = info["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("the report lists no canary files")
        for rel, digest in files.items():
            if file_sha256(folder / rel) != digest:
                raise ValueError(f"{rel} does not match its sha256 in report.json")
        return Case.read(folder / "case"), SideOutputs.read(folder / "outputs")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GateError(f"the canary of audit report {report_path} is damaged or missing "
                        f"({folder}: {exc}); rerun the audit") from None


def _config_differences(case_config: Any, config: Any) -> list[str]:
    a, b = case_config.to_dict(), config.to_dict()
    return [f"{k} {a.get(k)!r} in the canary, {b.get(k)!r} here" for k in sorted(a | b)
            if a.get(k) != b.get(k)]


def check_canary_config(case: Any, config: Any, report_path: Path) -> None:
    """Refuse a canary recorded at another drafter config than ``config`` (the one train
    builds).

    Raises:
        GateError: the configs differ (exit code 2), naming the first differing fields.
    """
    how = ("audit the verifier and profile you train with, with at least one real row "
           "(`dflash-audit compare --rows 1 ...`): its first real case is the canary")
    diffs = _config_differences(case.config, config)
    if diffs:
        raise GateError(f"the canary {case.name} of {report_path} was recorded at another "
                        f"drafter config than the one train builds ({'; '.join(diffs[:4])}), "
                        f"so it cannot run on the model train trains; {how}")


def canary_outputs(model: Any, case: Any, forward: Any, params: list[Any],
                   omitted: Any = (), device: Any = "cpu") -> tuple[dict[str, Any],
                                                                    dict[str, float]]:
    """Load the canary ``case``'s weights into ``model``, run :func:`train_step` with
    ``forward`` over ``params`` (no optimizer), and put the model's own weights, gradients
    and the torch RNG back afterwards.

    Args:
        omitted: weight names the case leaves out (the model holds them already).

    Returns:
        ``({"loss": fp32 scalar, "grad.<name>": tensor}, metrics)``: what train's step
        computed (metrics without ``loss_total``).

    Raises:
        GateError: the case's weights do not fit the model, or the step fails on it (exit 2).
    """
    import torch

    from dflash_audit.train.step import MODEL_INPUTS, train_step

    state = model.state_dict()
    missing = sorted(set(state) - set(case.weights) - set(omitted or ()))
    unknown = sorted(set(case.weights) - set(state))
    if missing or unknown or any(tuple(case.weights[k].shape) != tuple(state[k].shape)
                                 for k in case.weights if k in state):
        raise GateError(f"the canary {case.name} does not fit the model train trains (missing "
                        f"{missing[:3]}, unknown {unknown[:3]}): candidate.build(config) "
                        "returns another architecture than the audited one")
    saved = {k: v.detach().clone() for k, v in state.items()}
    rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            for key, value in case.weights.items():
                state[key].copy_(value)
        inputs = {k: case.inputs[k].to(device) for k in MODEL_INPUTS}
        result = train_step(forward, [inputs], params, optimizers=(), schedulers=(),
                            grad_clip=None, device=device)
        now = {f"grad.{n}": p.grad for n, p in model.named_parameters()
               if p.requires_grad and p.grad is not None}
        now["loss"] = torch.tensor(result.loss, dtype=torch.float32)
        metrics = {k: v for k, v in result.metrics.items() if k != "loss_total"}
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise GateError(f"the model train trains fails on the audit's canary case {case.name} "
                        f"({type(exc).__name__}: {str(exc)[:300]}); it is not the candidate "
                        "that passed the audit") from None
    finally:
        with torch.no_grad():
            for key, value in saved.items():
                state[key].copy_(value)
        for p in model.parameters():
            p.grad = None
        torch.set_rng_state(rng)
    return now, metrics


def judge_canary(now: dict[str, Any], metrics: dict[str, float], recorded: Any,
                 info: dict[str, Any] | None, case_name: str, report_path: Path,
                 where: str = "train's own step") -> None:
    """Compare what train's step computed on the canary (``now``, ``metrics``:
    :func:`canary_outputs`) with the ``recorded`` outputs at the canary's tolerance.

    Raises:
        GateError: any output differs (exit code 2), listing the first differences.
    """
    diffs = output_differences(now, recorded, (info or {}).get("tolerance")
                               or DEFAULT_TOLERANCE, metrics)
    if diffs:
        listing = "\n".join(f"  - {d}" for d in diffs[:6])
        raise GateError(f"the model train trains does not behave as audited: on the canary case "
                        f"{case_name} of {report_path}, {where} gives\n{listing}\n"
                        "(what differs from the audit: an environment variable, a config file "
                        "or a flag the candidate reads, or a build() / run_case that detects "
                        "the audit?) Make run_case run the model build() returns and rerun the "
                        "audit in this environment.")


def run_canary(model: Any, config: Any, forward: Any, params: list[Any], report_path: Path,
               info: dict[str, Any] | None, device: Any = "cpu") -> str:
    """Run the canary of ``report_path`` through :func:`train_step` on ``model`` (the
    drafter train trains, config ``config``) with ``forward`` (the loop's forward function)
    and ``params`` (its trainable parameters); restore the model's weights afterwards.

    Returns:
        a one-line note for the log.

    Raises:
        GateError: the canary is missing or damaged, was recorded at another drafter config,
            does not load into the model, or its loss / metrics / gradients differ (exit 2).
    """
    case, recorded = load_canary(report_path, info)
    check_canary_config(case, config, report_path)
    try:
        now, metrics = canary_outputs(model, case, forward, params,
                                      (info or {}).get("omitted_weights") or (), device)
    except GateError as exc:
        raise GateError(f"{exc} (audit report {report_path})") from None
    judge_canary(now, metrics, recorded, info, case.name, report_path)
    return (f"canary {case.name}: train's step on the model it trains gives the audited loss "
            f"and gradients ({len(now) - 1} gradients)")
