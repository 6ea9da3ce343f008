"""Trajectory conformance: the reference's DFlashDraftModel trained in OUR loop follows our
drafter's loss curve.

Both sides start from the same initial weights (one state dict, reference key names), see the
same batches and the same anchors (drawn once by our loop's seeded generator and injected into
the reference), and are stepped by the same code: ``dflash_audit.train.step.train_step`` with
optimizers and schedules from ``dflash_audit.train.optim``. Only the model differs: ours in
this process, the reference's in its own process from its resolved source (speculators 0.9.0
by default), fp32 on CPU, eager attention and eager losses.

Usage (real: SmolLM2-135M verifier, chitchat batches, the README's CPU profile)::

    python benchmarks/bench_trajectory.py --steps 20 \\
        --profile examples/profiles/smollm2-cpu.toml --batches data/chitchat-regen

    python benchmarks/bench_trajectory.py --tiny      # a tiny random verifier, seconds

Prints both loss curves step by step with absolute and relative differences; exit code 0
when every step's relative loss difference is within ``--rtol`` (default 1e-3), else 1.

Internally the script has two sides: ``--reference-side CASE_DIR`` is what runs inside the
reference's process (launched through ``dflash_audit.reference_source.run_reference``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the reference side
def reference_side(case_dir: Path) -> int:
    """Runs in the reference's process: its DFlashDraftModel, our train_step and optimizers."""
    import torch
    from safetensors.torch import load_file

    # the reference runs isolated (python -I -S, its own sys.path): this side also needs our
    # train_step and optimizers, so it puts this checkout's package root on the path itself
    sys.path[:0] = [str(REPO / "reference"), str(REPO)]
    import adapter  # reference/adapter.py: imports of the resolved speculators, build_config

    source = os.environ.get("DFLASH_AUDIT_REFERENCE_SOURCE")
    if source:
        adapter.ensure_distribution_metadata(Path(source))
    import speculators
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import core

    from dflash_audit.train.optim import OptimSpec, build_optimizers, build_schedulers
    from dflash_audit.train.step import train_step

    if source and not Path(speculators.__file__).resolve().is_relative_to(Path(source).resolve()):
        adapter.fail(case_dir, "wrong_source", f"speculators imported from {speculators.__file__}")
    case = json.loads((case_dir / "case.json").read_text())
    drafter, loss = case["drafter"], case["loss"]
    torch.manual_seed(0)
    model = core.DFlashDraftModel(adapter.build_config(drafter, case_dir)).float()
    missing, unexpected = model.load_state_dict(load_file(case_dir / "weights.safetensors"),
                                                strict=False)
    model.train()
    optim = OptimSpec(**{**case["optim"], "betas": tuple(case["optim"]["betas"])})
    optimizers = build_optimizers(model, optim)
    schedulers = build_schedulers(optimizers, optim)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_config = resolve_loss_config(loss["loss"], "eager")

    def forward(inputs):
        anchors, valid = inputs["anchor_positions"], inputs["anchor_valid"].bool()
        core.select_anchors = lambda loss_mask, n, block_size: (anchors.clone(), valid.clone())
        _, value, _metrics = model(
            hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
            loss_mask=inputs["loss_mask"],
            verifier_last_hidden_states=inputs["verifier_last_hidden_states"],
            document_ids=inputs["document_ids"], position_ids=inputs["position_ids"],
            loss_config=loss_config, gamma=loss["gamma"], max_anchors=anchors.numel(),
            per_position_loss_weight=loss["weighting"], dpace_alpha=loss["dpace_alpha"])
        return value, {}

    losses, grad_norms = [], []
    for k in range(case["steps"]):
        micro = [load_file(case_dir / f"step_{k:04d}_{m}.safetensors")
                 for m in range(case["rows_per_step"])]
        result = train_step(forward, micro, params, optimizers, schedulers, optim.grad_clip)
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
    (case_dir / "reference_losses.json").write_text(json.dumps({
        "losses": losses, "grad_norms": grad_norms, "trainable": [
            n for n, p in model.named_parameters() if p.requires_grad],
        "load_missing": list(missing), "load_unexpected": list(unexpected),
        "speculators": speculators.__file__}))
    return 0


# ----------------------------------------------------------------------- our side
def prepare_and_run_ours(case_dir: Path, verifier: str, batches: str, profile_spec: str,
                         steps: int, seed: int, lr: float, warmup_steps: int,
                         rows_per_step: int = 1) -> dict:
    """Build our drafter as `dflash-audit train` does, write the case (initial weights and
    every step's inputs with anchors), train ``steps`` steps in our loop; our losses."""
    import dataclasses

    from safetensors.torch import save_file

    from dflash_audit.candidate import load_candidate
    from dflash_audit.data.verifier import load_verifier
    from dflash_audit.profile import Profile
    from dflash_audit.train.loop import (
        DistEnv,
        TrainConfig,
        build_drafter,
        make_source,
        next_micro_batches,
    )
    from dflash_audit.train.optim import build_optimizers, build_schedulers
    from dflash_audit.train.step import drafter_forward, train_step

    cfg = TrainConfig(verifier=verifier, batches=batches, profile=profile_spec, steps=steps,
                      seed=seed, lr=lr, warmup_steps=warmup_steps, rows_per_step=rows_per_step)
    profile = Profile.load(profile_spec)
    v = load_verifier(verifier, progress=None)
    source, _ = make_source(cfg, v, profile, DistEnv())
    config = profile.to_drafter_config(v.model.config, source.mask_token_id,
                                       source.target_layer_ids)
    model = build_drafter(load_candidate(None), config, v.model, seed,
                          source.vocab_rows() if config.uses_draft_vocab else None)
    model.train()
    case_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in model.state_dict().items()},
              case_dir / "weights.safetensors")
    optim = cfg.optim_spec(profile.optimizer)
    (case_dir / "case.json").write_text(json.dumps({
        "drafter": config.to_dict(), "loss": dataclasses.asdict(profile.loss_spec()),
        "optim": dataclasses.asdict(optim), "steps": steps, "rows_per_step": rows_per_step,
        "max_anchors": profile.max_anchors}, indent=1))
    optimizers = build_optimizers(model, optim)
    schedulers = build_schedulers(optimizers, optim)
    forward = drafter_forward(model, profile.loss_spec(), config.block_size,
                              config.sample_from_anchor)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, grad_norms, wall = [], [], 0.0
    for k in range(steps):
        micro = next_micro_batches(source, seed, profile.max_anchors, config.block_size)
        for m, inputs in enumerate(micro):
            save_file({n: t.contiguous() for n, t in inputs.items()},
                      case_dir / f"step_{k:04d}_{m}.safetensors")
        t0 = time.perf_counter()
        result = train_step(forward, micro, params, optimizers, schedulers, optim.grad_clip)
        wall += time.perf_counter() - t0
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
    return {"losses": losses, "grad_norms": grad_norms, "wall_s": wall,
            "config": {"block_size": config.block_size, "max_anchors": profile.max_anchors,
                       "draft_layers": config.num_hidden_layers,
                       "draft_vocab": config.effective_draft_vocab_size,
                       "optimizer": optim.optimizer, "lr": optim.lr, "loss": profile.loss,
                       "weighting": profile.weighting}}


def run_reference_side(case_dir: Path, ref: str | None, timeout_s: float = 3600) -> dict:
    """Launch this script's reference side in the reference's process."""
    from dflash_audit.reference_source import resolve_reference, run_reference

    identity = resolve_reference(ref)
    t0 = time.perf_counter()
    run_reference(identity, ["--reference-side", str(case_dir)], case_dir, timeout_s,
                  adapter=Path(__file__).resolve())
    out = json.loads((case_dir / "reference_losses.json").read_text())
    out["wall_s"] = time.perf_counter() - t0
    out["reference"] = f"{identity.spec} ({identity.short_id})"
    return out


def compare_curves(ours: list[float], ref: list[float], rtol: float) -> dict:
    """Per-step absolute / relative loss differences and the verdict."""
    rows = []
    for k, (a, b) in enumerate(zip(ours, ref, strict=True)):
        diff = abs(a - b)
        rows.append({"step": k + 1, "ours": a, "reference": b, "abs_diff": diff,
                     "rel_diff": diff / max(abs(b), 1e-12)})
    worst = max(rows, key=lambda r: r["rel_diff"])
    return {"rows": rows, "max_abs_diff": max(r["abs_diff"] for r in rows),
            "max_rel_diff": worst["rel_diff"], "worst_step": worst["step"], "rtol": rtol,
            "within_tolerance": worst["rel_diff"] <= rtol}


def tiny_setup(work: Path) -> dict[str, str]:
    """The tests' tiny verifier, batches and profile (tests/train_tiny.py)."""
    sys.path.insert(0, str(REPO / "tests"))
    import train_tiny as tt

    paths = tt.setup_run(work, rows=4)
    return {"verifier": str(paths["verifier"]), "batches": str(paths["batches"]),
            "profile": str(paths["profile"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference-side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="tiny random verifier (fast)")
    parser.add_argument("--verifier", default="smollm2-135m")
    parser.add_argument("--batches", help="batch directory from `dflash-audit data`")
    parser.add_argument("--profile", default=str(REPO / "examples/profiles/smollm2-cpu.toml"))
    parser.add_argument("--ref", default=None, help="reference spec (default: the lock)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--work", type=Path, default=None, help="keep the case files here")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    if args.reference_side is not None:
        return reference_side(args.reference_side)

    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-trajectory-"))
    if args.tiny:
        setup = tiny_setup(work / "tiny")
        args.verifier, args.batches, args.profile = (setup["verifier"], setup["batches"],
                                                     setup["profile"])
        args.lr = 3e-3
    if not args.batches:
        parser.error("--batches DIR is required (write it with `dflash-audit data`), or --tiny")
    case_dir = work / "case"
    ours = prepare_and_run_ours(case_dir, args.verifier, args.batches, args.profile, args.steps,
                                args.seed, args.lr, args.warmup_steps)
    ref = run_reference_side(case_dir, args.ref)
    result = compare_curves(ours["losses"], ref["losses"], args.rtol)
    result.update(config=ours["config"], reference=ref["reference"],
                  ours_wall_s=ours["wall_s"], reference_wall_s=ref["wall_s"],
                  ours_grad_norms=ours["grad_norms"], reference_grad_norms=ref["grad_norms"])
    print(f"trajectory conformance: {args.steps} steps, reference {ref['reference']}, "
          f"config {ours['config']}")
    print(f"{'step':>4}  {'ours':>12}  {'reference':>12}  {'abs diff':>10}  {'rel diff':>10}")
    for r in result["rows"]:
        print(f"{r['step']:>4}  {r['ours']:>12.7f}  {r['reference']:>12.7f}  "
              f"{r['abs_diff']:>10.2e}  {r['rel_diff']:>10.2e}")
    verdict = "PASS" if result["within_tolerance"] else "FAIL"
    print(f"{verdict}: max abs diff {result['max_abs_diff']:.2e}, max rel diff "
          f"{result['max_rel_diff']:.2e} at step {result['worst_step']} (rtol {args.rtol:g}); "
          f"our loop {ours['wall_s']:.1f} s, reference process {ref['wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
