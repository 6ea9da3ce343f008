"""The training loop behind ``dflash-audit train``.

Order of a run (:func:`train`):

1. **Gate** (:mod:`dflash_audit.train.gate`): a passing audit report for this candidate,
   profile and reference must exist, else :class:`~dflash_audit.train.gate.GateError`.
2. Verifier, data source (:mod:`~dflash_audit.train.sources`: batch files, or online capture
   by the verifier in the loop), drafter from the profile (``Profile.to_drafter_config``),
   draft vocabulary from token counts when the profile sets ``draft_vocab_size``, frozen
   verifier-owned weights.
3. Optimizers and schedules (:mod:`~dflash_audit.train.optim`); ``--resume`` restores weights,
   optimizer, scheduler, RNG and data position (:mod:`~dflash_audit.train.state`).
4. Steps (:func:`dflash_audit.train.step.train_step`): anchors drawn each step with
   ``select_anchors`` from a seeded ``torch.Generator`` (``max_anchors`` and ``block_size``
   from the profile), the profile's loss and weighting, gradient clipping, bf16 autocast on
   CUDA and fp32 on CPU. Metrics go to JSONL / TensorBoard / a progress bar
   (:mod:`~dflash_audit.train.track`).
5. Checkpoints every ``save_every`` steps, at the end, and on SIGINT/SIGTERM (the step in
   flight finishes, a checkpoint is written, then the run stops: exit code 130 / 143).
6. Acceptance evaluation with real speculative decoding on held-out conversations
   (:mod:`~dflash_audit.train.evaluate`), before training (``eval_untrained``) and after.

Multi-process: under ``torchrun --nproc_per_node=P`` (``WORLD_SIZE`` > 1) the drafter is
wrapped in ``DistributedDataParallel`` on the gloo backend (CPU) or NCCL (CUDA, one GPU per
``LOCAL_RANK``); ranks read different rows and anchors, gradients are averaged, rank 0
writes checkpoints (with every rank's RNG and data position) and metrics.

FSDP on CUDA (documented, not exercised on CPU): for drafters too large for one GPU, replace
the DDP wrap with FSDP2, ``torch.distributed.fsdp.fully_shard`` applied to each
``model.layers[i]`` and then to the model, after the frozen verifier-owned weights are
loaded (they stay unsharded-frozen: ``requires_grad=False`` parameters are skipped by the
optimizers). Build the optimizers after sharding (Muon's Newton-Schulz works on DTensors),
run the step unchanged (bf16 autocast, or ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``), and save with ``torch.distributed.checkpoint.state_dict.
get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))``
on rank 0 before :func:`dflash_audit.model.checkpoint.save_pretrained`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_audit.model.anchors import select_anchors
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.verifier_weights import load_verifier_weights
from dflash_audit.train import state as ckpt
from dflash_audit.train.gate import GateResult, check_gate, expected_for
from dflash_audit.train.optim import OptimSpec, build_optimizers, build_schedulers
from dflash_audit.train.step import MODEL_INPUTS, drafter_forward, train_step
from dflash_audit.train.track import Tracker, loss_curve


class TrainError(Exception):
    """The run cannot start or continue; the message says why and what to do."""


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
    stop_at: int | None = None  # stop (with a checkpoint) once this global step is done
    resume: str | None = None  # "latest" or a checkpoint folder

    def optim_spec(self, profile_optimizer: str | None) -> OptimSpec:
        return OptimSpec(optimizer=self.optimizer or profile_optimizer or "adamw", lr=self.lr,
                         weight_decay=self.weight_decay, muon_lr=self.muon_lr,
                         schedule=self.schedule, warmup_steps=self.warmup_steps,
                         total_steps=self.steps, min_lr_ratio=self.min_lr_ratio,
                         grad_clip=self.grad_clip)


RUN_FIELDS = ("verifier", "batches", "data", "profile", "candidate", "steps", "rows_per_step",
              "seq_len", "regenerate", "max_new_tokens", "max_turns", "online_chunk", "seed",
              "optimizer", "lr", "muon_lr", "weight_decay", "schedule", "warmup_steps",
              "min_lr_ratio", "grad_clip", "eval_conversations")


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

    @property
    def exit_code(self) -> int:
        """0 finished / stop_at, 130 SIGINT, 143 SIGTERM."""
        return {"SIGINT": 130, "SIGTERM": 143}.get(self.stopped_by or "", 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- helpers
class StopSignals:
    """Context manager: SIGINT/SIGTERM set :attr:`received` instead of killing the process,
    so the loop can finish the step and checkpoint. Handlers are restored on exit."""

    def __init__(self) -> None:
        self.received: int = 0
        self._old: dict[int, Any] = {}

    def _handler(self, signum, _frame) -> None:
        self.received = signum

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> DistEnv:
    """Read torchrun's environment; initialize the process group when ``WORLD_SIZE`` > 1
    (gloo on CPU, NCCL on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    env = DistEnv(rank=int(os.environ.get("RANK", "0")), world_size=world,
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    return env


def resolve_device(requested: str, env: DistEnv) -> torch.device:
    """``auto`` -> CUDA (this rank's GPU) when available, else CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise TrainError("--device cuda, but torch sees no GPU; use --device cpu")
        return torch.device("cuda", env.local_rank)
    return torch.device(requested)


def _all_reduce_sum(values: dict[str, float], env: DistEnv) -> dict[str, float]:
    if not env.distributed:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def _all_max(value: int, env: DistEnv) -> int:
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _gather(obj: Any, env: DistEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def step_inputs(batch: Any, anchors: tuple[torch.Tensor, torch.Tensor], device: torch.device
                ) -> dict[str, torch.Tensor]:
    """A batch's tensors plus the anchors, on ``device`` (the drafter's forward inputs).
    Inference-mode tensors (online capture) are cloned so autograd may save them."""
    tensors = {k: v.clone() if v.is_inference() else v
               for k, v in ((k, v.to(device)) for k, v in batch.tensors().items())}
    tensors["anchor_positions"], tensors["anchor_valid"] = (a.to(device) for a in anchors)
    return {k: tensors[k] for k in MODEL_INPUTS}


def next_micro_batches(source: Any, anchor_gen: torch.Generator, max_anchors: int,
                       block_size: int, device: torch.device | str = "cpu"
                       ) -> list[dict[str, torch.Tensor]]:
    """The next step's micro-batches: the source's rows for this rank, each with up to
    ``max_anchors`` anchors drawn by ``select_anchors`` from ``anchor_gen``."""
    micro = []
    for batch in source.next_rows():
        anchors = select_anchors(batch.loss_mask, max_anchors, block_size, anchor_gen)
        micro.append(step_inputs(batch, anchors, torch.device(device)))
    return micro


def anchor_generator(seed: int, rank: int = 0) -> torch.Generator:
    """The seeded CPU generator that draws a rank's anchors."""
    return torch.Generator().manual_seed(seed * 1_000_003 + 7919 * rank)


def build_drafter(candidate: Any, config: Any, verifier_model: Any, seed: int,
                  vocab_rows: Any = None) -> DFlashDrafter:
    """The candidate's drafter for ``config``: seeded initialization, draft vocabulary from
    ``vocab_rows`` token counts when ``config`` has one, frozen verifier-owned weights.

    Raises:
        TrainError: the candidate cannot build a trainable drafter.
    """
    from dflash_audit.train.vocab import draft_vocab, token_counts

    if not hasattr(candidate, "build"):
        raise TrainError(f"candidate {type(candidate).__name__} has no build(config); training "
                         "needs a drafter module (DrafterCandidate or a subclass)")
    torch.manual_seed(seed)
    model = candidate.build(config)
    if not isinstance(model, DFlashDrafter):
        raise TrainError(f"candidate built a {type(model).__name__}; training (checkpoints in "
                         "the reference format) needs a DFlashDrafter or a subclass")
    model = model.float()
    if config.uses_draft_vocab:
        counts = token_counts(vocab_rows or [], config.vocab_size)
        t2d, d2t = draft_vocab(counts, config.effective_draft_vocab_size)
        model.t2d.copy_(t2d)
        model.d2t.copy_(d2t)
    load_verifier_weights(model, verifier_model)
    return model


def make_source(cfg: TrainConfig, verifier: Any, profile: Any, env: DistEnv):
    """The run's data source and the conversations held out for evaluation (online; None
    offline, where evaluation excludes every conversation packed into a batch).

    Raises:
        TrainError: not exactly one of ``batches`` / ``data``, or batches that do not fit
            the verifier or the profile's target layers.
    """
    from dflash_audit.train.sources import OfflineSource, OnlineSource

    if (cfg.batches is None) == (cfg.data is None):
        raise TrainError("give exactly one of --batches DIR (batch files from `dflash-audit "
                         "data`) or --data SOURCE (online capture by the verifier)")
    if cfg.batches is not None:
        source = OfflineSource(cfg.batches, seed=cfg.seed, rank=env.rank,
                               world_size=env.world_size, rows_per_step=cfg.rows_per_step)
        if source.metadata["verifier"].get("config_hash") != verifier.identity.config_hash:
            raise TrainError(f"the batches in {cfg.batches} were captured with verifier "
                             f"{source.metadata['verifier'].get('name')!r}, not with "
                             f"{cfg.verifier!r} (config hashes differ)")
        wanted = profile.resolve_target_layer_ids(verifier.num_layers)
        if source.target_layer_ids != wanted:
            raise TrainError(f"the batches hold target layers {source.target_layer_ids}, the "
                             f"profile {profile.name} wants {wanted}; rebuild the batches with "
                             f"`dflash-audit data --target-layers {','.join(map(str, wanted))}`")
        return source, None
    from dflash_audit.data.conversations import load_conversations

    convs = load_conversations(cfg.data).conversations
    n_held = min(cfg.eval_conversations, max(0, len(convs) - 1))
    train_convs, held = convs[: len(convs) - n_held], convs[len(convs) - n_held:]
    source = OnlineSource(verifier, train_convs, cfg.data, cfg.seq_len,
                          profile.resolve_target_layer_ids(verifier.num_layers), None,
                          regenerate=cfg.regenerate, max_new_tokens=cfg.max_new_tokens,
                          max_turns=cfg.max_turns,
                          seed=cfg.seed, chunk_conversations=cfg.online_chunk, rank=env.rank,
                          world_size=env.world_size, rows_per_step=cfg.rows_per_step)
    return source, held


def eval_prompt_set(cfg: TrainConfig, source: Any, held: list[Any] | None, tokenizer: Any
                    ) -> tuple[list[list[int]], list[str]]:
    """Held-out prompts: online, from the held-out conversations; offline, from the
    training data's conversation source minus every conversation packed into a batch."""
    from dflash_audit.data.conversations import load_conversations
    from dflash_audit.train.evaluate import held_out_prompts

    if held is not None and cfg.eval_data is None:
        return held_out_prompts(tokenizer, held, cfg.eval_prompts)
    name = cfg.eval_data or getattr(source, "data_name", None)
    if not name:
        raise TrainError("no conversation source for the evaluation; pass --eval-data")
    convs = load_conversations(name).conversations
    return held_out_prompts(tokenizer, convs, cfg.eval_prompts, exclude_sources=source.sources)


def _evaluate(model: DFlashDrafter, verifier: Any, prompts: list[list[int]], cfg: TrainConfig,
              tracker: Tracker, step: int, name: str) -> dict[str, Any]:
    from dflash_audit.data.tokenize import end_of_turn_ids
    from dflash_audit.train.evaluate import evaluate_acceptance

    eos = end_of_turn_ids(verifier.tokenizer, getattr(verifier.model, "generation_config", None))
    tracker.message(f"evaluating the {name} drafter: speculative decoding on {len(prompts)} "
                    f"held-out prompts, up to {cfg.eval_max_new_tokens} tokens each ...")
    device = next(model.parameters()).device
    home = next(verifier.model.parameters()).device  # CPU: where online capture runs
    verifier.model.to(device)
    try:
        result = evaluate_acceptance(model, verifier.model, prompts, cfg.eval_max_new_tokens,
                                     sorted(eos)).to_dict()
    finally:
        verifier.model.to(home)
    tracker.log_eval(step, name, result)
    tracker.message(f"{name}: acceptance length {result['acceptance_length']:.3f} over "
                    f"{result['verify_steps']} verify steps ({result['wall_s']:.0f} s)")
    return result


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
    from dflash_audit.data.verifier import load_verifier
    from dflash_audit.profile import Profile

    start_wall = time.perf_counter()
    if cfg.steps < 1 or cfg.rows_per_step < 1 or cfg.save_every < 1:
        raise TrainError("--steps, --rows-per-step and --save-every must be >= 1")
    device = resolve_device(cfg.device, DistEnv())
    env = init_distributed(device.type)
    device = resolve_device(cfg.device, env)
    out = Path(cfg.out)
    try:
        profile = Profile.load(cfg.profile)
        candidate = load_candidate(cfg.candidate)
        if gate is None:
            expected = expected_for(candidate, cfg.candidate, profile, cfg.ref,
                                    reference_identity, Path(cfg.reports_dir), cfg.verifier)
            gate = check_gate(expected, Path(cfg.report) if cfg.report else None,
                              Path(cfg.reports_dir))
        optim_spec = cfg.optim_spec(profile.optimizer)

        verifier = load_verifier(cfg.verifier, progress=None if not env.is_main else
                                 (lambda m: print(m, flush=True)))
        source, held = make_source(cfg, verifier, profile, env)
        config = profile.to_drafter_config(verifier.model.config, source.mask_token_id,
                                           source.target_layer_ids)
        model = build_drafter(candidate, config, verifier.model, cfg.seed,
                              source.vocab_rows() if config.uses_draft_vocab else None)
        run = {k: getattr(cfg, k) for k in RUN_FIELDS}
        run.update(world_size=env.world_size, profile_fingerprint=profile.fingerprint(),
                   optimizer=optim_spec.optimizer)

        anchor_gen = anchor_generator(cfg.seed, env.rank)
        start_step = 0
        resumed = None
        if cfg.resume:
            path = ckpt.resolve_checkpoint(out, cfg.resume)
            resumed = ckpt.load_training_state(path)
            diffs = ckpt.run_differences(resumed["run"], run)
            if diffs:
                raise ckpt.ResumeError(f"--resume: {path} belongs to a different run:\n  "
                                       + "\n  ".join(diffs))
            ckpt.load_model_weights(path, model)
            start_step = int(resumed["step"])
        model.to(device).train()
        optimizers = build_optimizers(model, optim_spec)
        schedulers = build_schedulers(optimizers, optim_spec)
        if resumed is not None:
            for opt, sd in zip(optimizers, resumed["optimizers"], strict=True):
                opt.load_state_dict(sd)
            for sched, sd in zip(schedulers, resumed["schedulers"], strict=True):
                sched.load_state_dict(sd)
            mine = resumed["ranks"][env.rank]
            torch.set_rng_state(mine["torch_rng"])
            anchor_gen.set_state(mine["anchor_generator"])
            source.load_state_dict(mine["data"])

        ddp = None
        if env.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        forward = drafter_forward(ddp or model, profile.loss_spec(), config.block_size,
                                  config.sample_from_anchor)
        params = [p for p in model.parameters() if p.requires_grad]

        tracker = Tracker(out, cfg.steps, start_step, enabled=env.is_main,
                          tensorboard=cfg.tensorboard, progress=cfg.progress)
        try:
            summary = TrainSummary(out=str(out), step=start_step, checkpoint=None, stopped_by=None,
                                   report_fingerprint=gate.report_fingerprint)
            prompts: list[list[int]] = []
            if env.is_main and (cfg.eval_at_end or cfg.eval_untrained):
                prompts, _ = eval_prompt_set(cfg, source, held, verifier.tokenizer)
                if not prompts:
                    tracker.message("warning: no held-out prompt found; skipping evaluation")
            if env.is_main and cfg.eval_untrained and start_step == 0 and prompts:
                summary.eval["untrained"] = _evaluate(model, verifier, prompts, cfg, tracker, 0,
                                                      "untrained")
            if env.distributed:
                dist.barrier()
            tracker.message(f"training {config.num_hidden_layers}-layer drafter "
                            f"(B={config.block_size}, A={profile.max_anchors}, "
                            f"V_d={config.effective_draft_vocab_size}, {optim_spec.optimizer}, "
                            f"lr {optim_spec.lr:g}) from step {start_step} to {cfg.steps}; "
                            f"audit report {gate.report_path}")

            def save(step: int) -> Path | None:
                ranks = _gather(ckpt.RankState(torch.get_rng_state(), anchor_gen.get_state(),
                                               source.state_dict()), env)
                digests = _gather(ckpt.weights_digest(model), env)
                if len(set(digests)) > 1:
                    raise TrainError(f"data-parallel ranks hold different weights at step {step} "
                                     f"(digests {[d[:12] for d in digests]}); DDP lost sync")
                path = None
                if env.is_main:
                    path = ckpt.save_checkpoint(
                        out, step, model, optimizers, schedulers, ranks, run,
                        gate.report_fingerprint, gate.checkpoint_metadata(),
                        verifier.identity.path, list(getattr(verifier.model.config,
                                                             "architectures", None) or []),
                        keep=cfg.keep_checkpoints, extra={"weights_digests": digests})
                if env.distributed:
                    dist.barrier()
                return path

            with StopSignals() as signals:
                step = start_step
                while step < cfg.steps:
                    t0 = time.perf_counter()
                    micro = next_micro_batches(source, anchor_gen, profile.max_anchors,
                                               config.block_size, device)
                    result = train_step(forward, micro, params, optimizers, schedulers,
                                        optim_spec.grad_clip, ddp.no_sync if ddp else None, device)
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
            if env.is_main and summary.stopped_by is None and cfg.eval_at_end and prompts:
                summary.eval["trained"] = _evaluate(model, verifier, prompts, cfg, tracker, step,
                                                    "trained")
            summary.wall_s = time.perf_counter() - start_wall
            if env.is_main:
                summary.loss_curve = loss_curve(out / "metrics.jsonl")
                (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
            return summary
        finally:
            tracker.close()
    finally:
        if env.distributed and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()
