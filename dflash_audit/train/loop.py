"""The training loop behind ``dflash-audit train``.

Order of a run (:func:`train`):

1. **Gate** (:mod:`dflash_audit.train.gate`): a passing, signed audit report with a canary for
   this candidate, profile and reference, else :class:`~dflash_audit.train.gate.GateError`
   (decided before the candidate is imported: :mod:`dflash_audit.train.sealed`); once the
   model, its forward and optimizers exist (before step 1 and a resume's weights), the canary
   runs through train's own step on that model (:func:`dflash_audit.train.canary.run_canary`).
   The run folder ``out`` must be writable, and one that already holds a run
   (checkpoints, metrics) is only continued (``resume``) or replaced (``overwrite``):
   :func:`dflash_audit.train.state.check_run_folder`.
2. Verifier, data source (:mod:`~dflash_audit.train.sources`: batch files, or online capture),
   drafter from the profile (``Profile.to_drafter_config``), draft vocabulary from token
   counts when the profile sets ``draft_vocab_size``, frozen verifier-owned weights.
3. Optimizers and schedules (:mod:`~dflash_audit.train.optim`); ``--resume`` restores weights,
   optimizer, scheduler, RNG and data position (:mod:`~dflash_audit.train.state`).
4. Steps (:func:`dflash_audit.train.step.train_step`): anchors drawn each step with
   ``select_anchors`` from a seeded ``torch.Generator`` (``max_anchors`` and ``block_size``
   from the profile), the profile's loss and weighting, gradient clipping, bf16 autocast on
   CUDA, fp32 on CPU. Metrics to JSONL / TensorBoard / a progress bar (:mod:`.track`).
5. Checkpoints every ``save_every`` steps, at the end, and on SIGINT/SIGTERM (the step in
   flight finishes, a checkpoint is written, then the run stops: exit code 130 / 143).
6. Acceptance evaluation with real speculative decoding on held-out conversations
   (:mod:`~dflash_audit.train.evaluate`), before training (``eval_untrained``) and after (a
   SIGINT there keeps the last checkpoint and the summary: exit 130, ``--resume`` evaluates).

Multi-process: under ``torchrun --nproc_per_node=P`` (``WORLD_SIZE`` > 1) the drafter is
wrapped in ``DistributedDataParallel`` on the gloo backend (CPU) or NCCL (CUDA, one GPU per
``LOCAL_RANK``); ranks read different rows, gradients are averaged, rank 0 writes checkpoints
(with every rank's RNG and data position) and metrics. A row's anchors are drawn from a
generator seeded by the row's key, so P ranks x R rows per step train the same drafter as one
process with P*R rows per step (offline batches; up to fp32 reduction order).

``--fsdp`` (``cfg.fsdp``) shards the drafter with FSDP2 instead of DDP
(:class:`dflash_audit.train.fsdp.ShardedDrafter`: ``fully_shard`` per draft layer, then the
model; bf16 compute and fp32 reduction on CUDA as the reference, fp32 on CPU). The canary runs
on the model just before it is sharded in place; optimizers are built on the shards;
checkpoints hold the full state dicts (the same files as without FSDP, written by rank 0 from
an unsharded copy, which evaluation also runs on) and the full optimizer states, for an exact
resume under ``--fsdp`` with the same number of processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_audit.train import state as ckpt
from dflash_audit.train.canary import run_canary
from dflash_audit.train.distributed import (
    DistEnv,
    StopSignals,
    _all_max,
    _all_reduce_sum,
    _gather,
    init_distributed,
    release_group,
    resolve_device,
)
from dflash_audit.train.fsdp import (
    ShardedDrafter,
    full_optimizer_state,
    load_full_state,
    no_gradient_sync,
)
from dflash_audit.train.gate import GateResult
from dflash_audit.train.optim import OptimSpec, build_optimizers, build_schedulers
from dflash_audit.train.plot import plot_or_warn
from dflash_audit.train.sealed import Binding, candidate_work, decide, sealed_canary
from dflash_audit.train.setup import (
    TrainError,
    build_drafter,
    eval_prompt_set,
    evaluate_drafter,
    make_source,
    next_micro_batches,
    step_inputs,
)
from dflash_audit.train.step import drafter_forward, train_step
from dflash_audit.train.track import Tracker, loss_curve

__all__ = ["RUN_FIELDS", "DistEnv", "TrainConfig", "TrainError", "TrainSummary",
           "build_drafter", "make_source", "next_micro_batches", "step_inputs", "train"]


@dataclass
class TrainConfig:
    """Every setting of a run. Fields in :data:`RUN_FIELDS` define the trajectory and must
    match on ``resume``; the rest (output, logging, evaluation, stopping) may change."""

    out: str = "runs/train"
    verifier: str = "smollm2-135m"
    batches: str | None = None  # offline: directory of batch files
    data: str | None = None  # online: "chitchat" or a .jsonl file
    profile: str = "reference-model"
    candidate: str | None = None
    ref: str | None = None
    report: str | None = None
    reports_dir: str = "reports"
    steps: int = 300
    rows_per_step: int = 1
    seq_len: int = 1024  # online
    regenerate: bool = False  # online
    max_new_tokens: int = 64  # online, with regenerate
    max_turns: int | None = None  # online, with regenerate: first N assistant turns
    online_chunk: int = 32  # online: conversations captured together
    seed: int = 0
    optimizer: str | None = None  # None: the profile's optimizer, else adamw
    lr: float = 6e-4
    muon_lr: float | None = None
    weight_decay: float = 0.01
    schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    save_every: int = 100
    keep_checkpoints: int = 2
    eval_data: str | None = None  # default: the training data's conversation source
    eval_conversations: int = 40  # online: conversations held out from training
    eval_prompts: int = 32
    eval_max_new_tokens: int = 64
    eval_at_end: bool = True
    eval_untrained: bool = False
    tensorboard: bool = True
    progress: bool = True
    device: str = "auto"
    fsdp: bool = False  # under torchrun: FSDP2 (fully_shard per draft layer) instead of DDP
    stop_at: int | None = None  # stop (with a checkpoint) once this global step is done
    resume: str | None = None  # "latest" or a checkpoint folder
    overwrite: bool = False  # start fresh in an `out` that holds a run (its files removed)

    def optim_spec(self, profile_optimizer: str | None) -> OptimSpec:
        return OptimSpec(optimizer=self.optimizer or profile_optimizer or "adamw", lr=self.lr,
                         weight_decay=self.weight_decay, muon_lr=self.muon_lr,
                         schedule=self.schedule, warmup_steps=self.warmup_steps,
                         total_steps=self.steps, min_lr_ratio=self.min_lr_ratio,
                         grad_clip=self.grad_clip)


RUN_FIELDS = ("verifier", "batches", "data", "profile", "candidate", "steps", "rows_per_step",
              "seq_len", "regenerate", "max_new_tokens", "max_turns", "online_chunk", "seed",
              "optimizer", "lr", "muon_lr", "weight_decay", "schedule", "warmup_steps",
              "min_lr_ratio", "grad_clip", "eval_conversations", "fsdp")


@dataclass
class TrainSummary:
    """Outcome of :func:`train` (also written to ``<out>/summary.json`` by rank 0)."""

    out: str
    step: int
    checkpoint: str | None
    stopped_by: str | None  # "SIGINT" | "SIGTERM" | "stop_at" | None (finished)
    report_fingerprint: str
    first_loss: float | None = None
    last_loss: float | None = None
    wall_s: float = 0.0
    loss_curve: list[dict[str, Any]] = field(default_factory=list)  # track.loss_curve
    eval: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None  # <out>/curves.png: loss and acceptance length over the steps
    parallel: str = "none"  # "none" | "ddp" | "fsdp"
    world_size: int = 1

    @property
    def exit_code(self) -> int:
        """0 finished / stop_at, 130 SIGINT, 143 SIGTERM."""
        return {"SIGINT": 130, "SIGTERM": 143}.get(self.stopped_by or "", 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -------------------------------------------------------------------------------- train
def train(cfg: TrainConfig, *, reference_identity: dict[str, Any] | None = None,
          gate: GateResult | None = None) -> TrainSummary:
    """Run (or resume) a training run; see the module docstring.

    Args:
        cfg: the run's settings.
        reference_identity: an already resolved reference identity dict (else ``cfg.ref``
            is resolved offline from the cache).
        gate: an already accepted gate result (skips the report lookup; for callers that
            checked it themselves).

    Raises:
        GateError: no passing audit report for this candidate/profile/reference.
        TrainError, ResumeError, OptimConfigError, DataError, ProfileError, CandidateError:
            bad settings, data or checkpoint; the message names the problem.
    """
    from dflash_audit.candidate import load_candidate
    from dflash_audit.data.verifier import load_verifier, resolve_verifier
    from dflash_audit.profile import Profile

    start_wall = time.perf_counter()
    if cfg.steps < 1 or cfg.rows_per_step < 1 or cfg.save_every < 1:
        raise TrainError("--steps, --rows-per-step and --save-every must be >= 1")
    device = resolve_device(cfg.device, DistEnv())
    env = init_distributed(device.type)
    device = resolve_device(cfg.device, env)
    if cfg.fsdp and not env.distributed:  # before anything is read, written or removed
        raise TrainError("--fsdp shards the drafter across processes: run train under "
                         "`torchrun --nproc_per_node=N` (N >= 2), or drop --fsdp")
    out = Path(cfg.out)
    # bound before any candidate code runs in this process (sealed: the gate decides first)
    binding, in_process_canary = Binding(), run_canary
    try:
        profile = Profile.load(cfg.profile)
        say = None if not env.is_main else (lambda m: print(f"dflash-audit: {m}", flush=True))
        resolved = resolve_verifier(cfg.verifier, progress=say)  # once: the gate and the loop
        with candidate_work(cfg.candidate) as work:  # None: our drafter, our code
            gate = gate or decide(cfg, profile, resolved, reference_identity, work, say)
            optim_spec = cfg.optim_spec(profile.optimizer)
            # every rank checks (so all refuse together), only rank 0 removes for --overwrite
            ckpt.check_run_folder(out, cfg.resume, cfg.overwrite, remove=env.is_main)
            if env.distributed:
                dist.barrier()

            verifier = load_verifier(resolved, progress=say)
            source, held = make_source(cfg, verifier, profile, env)
            config = profile.to_drafter_config(verifier.model.config, source.mask_token_id,
                                               source.target_layer_ids)
            sealed = sealed_canary(cfg.candidate, gate, config, verifier.model, cfg.seed, work)
        candidate = load_candidate(cfg.candidate)  # the first candidate code in this process
        binding.check("when it was imported")
        model = build_drafter(candidate, config, verifier.model, cfg.seed,
                              source.vocab_rows() if config.uses_draft_vocab else None)
        run = {k: getattr(cfg, k) for k in RUN_FIELDS}
        run.update(world_size=env.world_size, profile_fingerprint=profile.fingerprint(),
                   optimizer=optim_spec.optimizer)

        start_step = 0
        resumed = None
        if cfg.resume:
            path = ckpt.resolve_checkpoint(out, cfg.resume)
            resumed = ckpt.load_training_state(path)
            diffs = ckpt.run_differences(resumed["run"], run)
            if diffs:
                raise ckpt.ResumeError(f"--resume: {path} belongs to a different run:\n  "
                                       + "\n  ".join(diffs) + "\nrerun with the checkpoint's "
                                       "values of these options, or train into a new --out "
                                       "without --resume")
            ckpt.load_model_weights(path, model)
            start_step = int(resumed["step"])
        model.train()
        # behaviour, not only source: the canary through train's own step on this model
        # (under FSDP just before it is sharded in place, on CPU as in the audit)
        canary = functools.partial(in_process_canary, model, config,
                                   report_path=gate.report_path, info=gate.canary)
        shard = None
        if cfg.fsdp:
            note = canary(drafter_forward(model, profile.loss_spec(), config.block_size,
                                          config.sample_from_anchor),
                          [p for p in model.parameters() if p.requires_grad])
            shard = ShardedDrafter(model, device, keep_copy=env.is_main)
        else:
            model.to(device)
        optimizers = build_optimizers(model, optim_spec)
        schedulers = build_schedulers(optimizers, optim_spec)
        if resumed is not None:
            for opt, sd in zip(optimizers, resumed["optimizers"], strict=True):
                if shard is None:
                    opt.load_state_dict(sd)
                else:
                    load_full_state(model, opt, None, sd)
            for sched, sd in zip(schedulers, resumed["schedulers"], strict=True):
                sched.load_state_dict(sd)
            mine = resumed["ranks"][env.rank]
            torch.set_rng_state(mine["torch_rng"])
            source.load_state_dict(mine["data"])

        ddp = None
        if env.distributed and shard is None:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        forward = drafter_forward(ddp or model, profile.loss_spec(), config.block_size,
                                  config.sample_from_anchor)
        params = [p for p in model.parameters() if p.requires_grad]
        if shard is None:
            note = canary(forward, params, device=device)
        binding.check("in build() or the canary")
        if env.is_main:
            print("".join(f"dflash-audit: {n}\n" for n in (sealed, note) if n), end="", flush=True)
        no_sync = ddp.no_sync if ddp else (lambda: no_gradient_sync(model)) if shard else None

        tracker = Tracker(out, cfg.steps, start_step, enabled=env.is_main,
                          tensorboard=cfg.tensorboard, progress=cfg.progress)
        try:
            parallel = "fsdp" if shard else "ddp" if ddp else "none"
            summary = TrainSummary(out=str(out), step=start_step, checkpoint=None, stopped_by=None,
                                   report_fingerprint=gate.report_fingerprint,
                                   parallel=parallel, world_size=env.world_size)
            prompts: list[list[int]] = []
            if env.is_main and (cfg.eval_at_end or cfg.eval_untrained):
                prompts, _ = eval_prompt_set(cfg, source, held, verifier.tokenizer)
                if not prompts:
                    tracker.message("warning: no held-out prompt found; skipping evaluation")
            evaluates = bool(_all_max(int(bool(prompts)), env))  # rank 0 evaluates, all gather

            def evaluate(step: int, name: str) -> None:
                drafter = shard.unsharded() if shard else model
                if env.is_main:
                    summary.eval[name] = evaluate_drafter(drafter, verifier, prompts, cfg,
                                                          tracker, step, name)

            if cfg.eval_untrained and start_step == 0 and evaluates:
                evaluate(0, "untrained")
            if env.distributed:
                dist.barrier()
            tracker.message(f"training {config.num_hidden_layers}-layer drafter "
                            f"(B={config.block_size}, A={profile.max_anchors}, "
                            f"V_d={config.effective_draft_vocab_size}, {optim_spec.optimizer}, "
                            f"lr {optim_spec.lr:g}"
                            + ({"none": "", "ddp": f", DDP over {env.world_size} processes",
                                "fsdp": f", FSDP2 over {env.world_size} processes"}[parallel])
                            + f") from step {start_step} to {cfg.steps}; "
                            f"audit report {gate.report_path}")

            def save(step: int) -> Path | None:
                ranks = _gather(ckpt.RankState(torch.get_rng_state(), source.state_dict()), env)
                saved, optimizer_states = model, None
                if shard is not None:  # every rank gathers; rank 0 holds the full state
                    optimizer_states = [full_optimizer_state(model, o) for o in optimizers]
                    saved = shard.unsharded()
                    digests = [ckpt.weights_digest(saved)] if env.is_main else []
                else:
                    digests = _gather(ckpt.weights_digest(model), env)
                if len(set(digests)) > 1:
                    raise TrainError(f"data-parallel ranks hold different weights at step {step} "
                                     f"(digests {[d[:12] for d in digests]}); DDP lost sync")
                path = None
                if env.is_main:
                    path = ckpt.save_checkpoint(
                        out, step, saved, optimizers, schedulers, ranks, run,
                        gate.report_fingerprint, gate.checkpoint_metadata(),
                        verifier.identity.path, list(getattr(verifier.model.config,
                                                             "architectures", None) or []),
                        keep=cfg.keep_checkpoints, extra={"weights_digests": digests},
                        optimizer_states=optimizer_states)
                if env.distributed:
                    dist.barrier()
                return path

            with StopSignals() as signals:
                step = start_step
                while step < cfg.steps:
                    t0 = time.perf_counter()
                    micro = next_micro_batches(source, cfg.seed, profile.max_anchors,
                                               config.block_size, device)
                    result = train_step(forward, micro, params, optimizers, schedulers,
                                        optim_spec.grad_clip, no_sync, device)
                    step += 1
                    raw = _all_reduce_sum(result.metrics, env)
                    record = tracker.log_step(step, raw, result.grad_norm, result.lrs,
                                              time.perf_counter() - t0)
                    summary.first_loss = record.get("loss") if summary.first_loss is None \
                        else summary.first_loss
                    summary.last_loss = record.get("loss")
                    stop = _all_max(signals.received, env)
                    at_stop = cfg.stop_at is not None and step >= cfg.stop_at
                    if stop or at_stop or step % cfg.save_every == 0 or step == cfg.steps:
                        path = save(step)
                        summary.checkpoint = str(path) if path else None
                        if env.is_main:
                            tracker.message(f"checkpoint step {step}: {path}")
                    if stop or at_stop:
                        summary.stopped_by = (signal.Signals(stop).name if stop else "stop_at")
                        break
                summary.step = step
            if summary.stopped_by is None and cfg.eval_at_end and evaluates:
                try:
                    evaluate(step, "trained")
                except KeyboardInterrupt:  # the run's checkpoint is written: keep the summary
                    summary.stopped_by = "SIGINT"
                    tracker.message(f"evaluation interrupted; checkpoint {summary.checkpoint}")
            summary.wall_s = time.perf_counter() - start_wall
            if env.is_main:
                summary.loss_curve = loss_curve(out / "metrics.jsonl")
                plot = plot_or_warn(out, tracker.message)
                summary.plot = str(plot) if plot else None
                (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
            return summary
        finally:
            tracker.close()
    finally:
        # DDP's reducer holds the group: torn down after it, at exit, gloo's threads can abort
        # the rank ("terminate called without an active exception"), even after an error
        ddp = forward = no_sync = None
        release_group(env)
