"""The ``dflash-audit train`` and ``dflash-audit eval`` commands (typer), wired in ``cli.py``.

Exit codes of ``train``: 0 finished (or stopped at ``--stop-at``); 1 the audit of this
candidate/profile/reference failed; 2 no matching passing audit report, or a usage / setup
error (bad option, data, profile, checkpoint); 130 / 143 stopped by SIGINT / SIGTERM after
writing a checkpoint (resume with ``--resume``).

Exit codes of ``eval``: 0 done, 2 usage / setup error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

from dflash_audit.user_input import loads_json

import typer

Opt = typer.Option


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _fail(message: str, code: int) -> None:
    from dflash_audit.command_errors import fail

    fail(message, code)


def train_command(
    out: Annotated[Path, Opt(help="Run folder: checkpoints/, metrics.jsonl, tensorboard/, "
                                  "summary.json.")] = Path("runs/train"),
    verifier: Annotated[str, Opt(help="'smollm2-135m', a local HF causal-LM folder, "
                                      "family:NAME or path/to/config.json (a proxy, as in "
                                      "compare).")] = "smollm2-135m",
    batches: Annotated[Path | None, Opt(
        help="Offline: directory of batch files from `dflash-audit data`.")] = None,
    data: Annotated[str | None, Opt(
        help="Online: 'chitchat' or a .jsonl file; the verifier captures hidden states in "
             "the loop.")] = None,
    profile: Annotated[str, Opt(help="Built-in profile, a TOML file or a drafter config.json "
                                     "(the audited one).")] = "reference-model",
    candidate: Annotated[str | None, Opt(
        help="module:attr or file.py:attr of a DrafterCandidate subclass (default: ours); "
             "not a framework:NAME (a framework is audited, not trained here).")
    ] = None,
    ref: Annotated[str | None, Opt(
        help="Reference the audit ran against (default: reference/speculators.lock).")] = None,
    report: Annotated[Path | None, Opt(
        help="An explicit report.json (default: newest matching one in --reports-dir).")
    ] = None,
    reports_dir: Annotated[Path, Opt(help="Where `dflash-audit compare` writes reports.")
                           ] = Path("reports"),
    steps: Annotated[int, Opt(help="Optimizer steps in total.")] = 300,
    rows_per_step: Annotated[int, Opt(help="Packed rows per step (gradient accumulation).")
                             ] = 1,
    seq_len: Annotated[int, Opt(help="Online: tokens per packed row.")] = 1024,
    regenerate: Annotated[bool, Opt(help="Online: train on the verifier's own greedy replies "
                                         "(cached).")] = False,
    max_new_tokens: Annotated[int, Opt(help="Online --regenerate: tokens per reply.")] = 64,
    max_turns: Annotated[int | None, Opt(
        help="Online --regenerate: keep the first N assistant turns.", min=1)] = None,
    online_chunk: Annotated[int, Opt(help="Online: conversations captured together.")] = 32,
    seed: Annotated[int, Opt(help="Seeds the initial weights, data order and anchors.")] = 0,
    optimizer: Annotated[str | None, Opt(
        help="adamw | muon (default: the profile's optimizer, else adamw).")] = None,
    lr: Annotated[float, Opt(help="AdamW learning rate (and Muon's unless --muon-lr).")
                  ] = 6e-4,
    muon_lr: Annotated[float | None, Opt(help="Muon group learning rate.")] = None,
    weight_decay: Annotated[float, Opt(help="AdamW weight decay.")] = 0.01,
    schedule: Annotated[str, Opt(help="Decay after warmup: cosine | linear | constant.")
                        ] = "cosine",
    warmup_steps: Annotated[int, Opt(help="Linear warmup steps.")] = 20,
    min_lr_ratio: Annotated[float, Opt(help="Final LR as a fraction of the base LR.")] = 0.1,
    grad_clip: Annotated[float, Opt(help="Max gradient L2 norm.")] = 1.0,
    save_every: Annotated[int, Opt(help="Checkpoint every K steps (and at the end).")] = 100,
    keep_checkpoints: Annotated[int, Opt(help="Checkpoints kept (0 = all).")] = 2,
    eval_data: Annotated[str | None, Opt(
        help="Conversations for the held-out evaluation (default: the training data's).")
    ] = None,
    eval_conversations: Annotated[int, Opt(help="Online: conversations held out of training.")
                                  ] = 40,
    eval_prompts: Annotated[int, Opt(help="Held-out prompts evaluated.")] = 32,
    eval_max_new_tokens: Annotated[int, Opt(help="Tokens generated per prompt.")] = 64,
    evaluate: Annotated[bool, Opt("--eval/--no-eval",
                                  help="Measure acceptance length at the end.")] = True,
    eval_untrained: Annotated[bool, Opt(help="Also measure the untrained drafter first.")
                              ] = False,
    tensorboard: Annotated[bool, Opt(help="Write TensorBoard scalars.")] = True,
    progress: Annotated[bool, Opt(help="Show a progress bar.")] = True,
    device: Annotated[str, Opt(help="auto | cpu | cuda.")] = "auto",
    fsdp: Annotated[bool, Opt(help="Under torchrun: shard the drafter with FSDP2 (fully_shard "
                                   "per draft layer; bf16 compute on CUDA) instead of DDP.")
                    ] = False,
    stop_at: Annotated[int | None, Opt(
        help="Stop after this global step (with a checkpoint); resume later.")] = None,
    resume: Annotated[bool, Opt(help="Continue from OUT/checkpoints/latest.")] = False,
    resume_from: Annotated[Path | None, Opt(help="Continue from this checkpoint folder.")
                           ] = None,
    overwrite: Annotated[bool, Opt(help="Start fresh in an --out that already holds a run, "
                                        "deleting its checkpoints and metrics.")] = False,
) -> None:
    """Train a drafter - only after `dflash-audit compare` passed for the same candidate,
    profile and reference. An --out that holds a run needs --resume or --overwrite. Exit
    codes: 0 done, 1 audit failed, 2 no matching report, bad input or environment (an
    existing run, unwritable or full --out, damaged checkpoint), 130/143 interrupted
    (checkpoint written)."""
    from dflash_audit.audit.frameworks.registry import is_framework_spec

    if is_framework_spec(candidate):  # before anything is loaded: exit 2, one line
        _fail(f"--candidate {candidate}: train trains our drafter or your own candidate; a "
              "framework is audited, not trained here: train with the framework itself", 2)
    from dflash_audit.train.gate import GateError
    from dflash_audit.train.loop import TrainConfig, train

    cfg = TrainConfig(
        out=str(out), verifier=verifier, batches=str(batches) if batches else None, data=data,
        profile=profile, candidate=candidate, ref=ref, report=str(report) if report else None,
        reports_dir=str(reports_dir), steps=steps, rows_per_step=rows_per_step, seq_len=seq_len,
        regenerate=regenerate, max_new_tokens=max_new_tokens, max_turns=max_turns,
        online_chunk=online_chunk,
        seed=seed, optimizer=optimizer, lr=lr, muon_lr=muon_lr, weight_decay=weight_decay,
        schedule=schedule, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
        grad_clip=grad_clip, save_every=save_every, keep_checkpoints=keep_checkpoints,
        eval_data=eval_data, eval_conversations=eval_conversations, eval_prompts=eval_prompts,
        eval_max_new_tokens=eval_max_new_tokens, eval_at_end=evaluate,
        eval_untrained=eval_untrained, tensorboard=tensorboard, progress=progress,
        device=device, fsdp=fsdp, stop_at=stop_at,
        resume=str(resume_from) if resume_from else ("latest" if resume else None),
        overwrite=overwrite)
    try:
        summary = train(cfg)
    except GateError as exc:
        _fail(f"training refused: {exc}", exc.exit_code)
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports the run
        raise typer.Exit(summary.exit_code)
    console = _console()
    ev = summary.eval
    if "untrained" in ev or "trained" in ev:
        parts = [f"{k} {v['acceptance_length']:.3f}" for k, v in ev.items()]
        console.print(f"acceptance length (held-out, speculative decoding): {', '.join(parts)}",
                      markup=False, highlight=False)
    if summary.loss_curve:
        curve = "  ".join(f"{w['first_step']}-{w['last_step']}: {w['loss']:.3f}"
                          for w in summary.loss_curve)
        console.print(f"training loss (mean per step range): {curve}", markup=False,
                      highlight=False)
    if summary.plot:
        console.print(f"loss and acceptance length over the steps: {summary.plot}",
                      markup=False, highlight=False)
    how = f" ({summary.stopped_by}; resume with --resume)" if summary.stopped_by else ""
    console.print(f"step {summary.step}/{steps}{how}; checkpoint {summary.checkpoint}; "
                  f"{summary.wall_s:.0f} s", markup=False, highlight=False)
    if summary.checkpoint:
        console.print("next, check how an engine will serve it: dflash-audit serve-check "
                      f"{summary.checkpoint} --engine vllm (or sglang, zlab)", markup=False,
                      highlight=False, soft_wrap=True)
    if summary.exit_code:
        raise typer.Exit(summary.exit_code)


def eval_command(
    checkpoint: Annotated[Path | None, Opt(
        help="Drafter checkpoint folder (config.json + model.safetensors), or a run's "
             "checkpoints/latest pointer, or the run folder (its latest checkpoint).")] = None,
    untrained: Annotated[bool, Opt(help="Evaluate a freshly initialized drafter of --profile "
                                        "instead (the baseline).")] = False,
    profile: Annotated[str, Opt(help="Profile for --untrained.")] = "reference-model",
    seed: Annotated[int, Opt(help="Initialization seed for --untrained.")] = 0,
    verifier: Annotated[str | None, Opt(
        help="Verifier (default: the one named in the checkpoint, else smollm2-135m).")] = None,
    data: Annotated[str, Opt(help="Conversations to take held-out prompts from.")
                    ] = "chitchat",
    exclude_batches: Annotated[Path | None, Opt(
        help="Batch directory whose conversations are excluded (the training data).")] = None,
    prompts: Annotated[int, Opt(help="Number of prompts.")] = 32,
    max_new_tokens: Annotated[int, Opt(help="Tokens generated per prompt.")] = 64,
    out: Annotated[Path | None, Opt(help="Write the result as JSON here.")] = None,
) -> None:
    """Measure a drafter's mean acceptance length with real speculative decoding (greedy;
    accepted drafts + 1 per verify step) on held-out conversations. Exit codes: 0 done,
    2 bad input or environment (checkpoint damaged or against the reference's config rules,
    unwritable --out)."""
    from dflash_audit.atomic import ensure_writable_dir

    if out is not None:
        if out.is_dir():
            _fail(f"--out {out} is a folder; give a file path for the JSON result", 2)
        ensure_writable_dir(out.parent, "--out's folder")
    result = run_eval(checkpoint, untrained, profile, seed, verifier, data,
                      exclude_batches, prompts, max_new_tokens)
    if out is not None:
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out)
    hist = " ".join(f"{k + 1}:{n}" for k, n in enumerate(result["histogram"]))
    _console().print(
        f"acceptance length {result['acceptance_length']:.3f} over {result['verify_steps']} "
        f"verify steps, {result['prompts']} prompts, {result['generated_tokens']} tokens "
        f"({result['wall_s']:.0f} s); tokens per step histogram {hist}",
        markup=False, highlight=False)


def run_eval(checkpoint: Path | None, untrained: bool, profile: str, seed: int,
             verifier: str | None, data: str, exclude_batches: Path | None, prompts: int,
             max_new_tokens: int) -> dict[str, Any]:
    """What ``eval`` does, as a function: load (or initialize) the drafter, pick held-out
    prompts, run speculative decoding. Returns the :class:`EvalResult` dict plus
    ``drafter`` and ``prompt_sources``.

    Raises:
        TrainError: neither or both of ``checkpoint`` / ``untrained``.
    """
    from dflash_audit.candidate import load_candidate
    from dflash_audit.data.conversations import load_conversations
    from dflash_audit.data.tokenize import choose_mask_token_id, end_of_turn_ids
    from dflash_audit.data.verifier import load_verifier
    from dflash_audit.model.checkpoint import load_pretrained
    from dflash_audit.profile import Profile
    from dflash_audit.train.evaluate import evaluate_acceptance, held_out_prompts
    from dflash_audit.train.loop import TrainError, build_drafter
    from dflash_audit.train.sources import OfflineSource
    from dflash_audit.train.state import follow_latest

    if (checkpoint is None) == (not untrained):
        raise TrainError("give exactly one of --checkpoint DIR or --untrained")
    source = OfflineSource(exclude_batches) if exclude_batches else None
    if checkpoint is not None:
        checkpoint = follow_latest(checkpoint)
    if verifier is None and checkpoint is not None:
        from dflash_audit.model.checkpoint import CheckpointError

        try:
            cfg = loads_json((Path(checkpoint) / "config.json").read_text()) \
                if (Path(checkpoint) / "config.json").is_file() else {}
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint}/config.json is not JSON ({exc})") from exc
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}
                    ).get("name_or_path")
    v = load_verifier(verifier or "smollm2-135m")
    if checkpoint is not None:
        drafter = load_pretrained(checkpoint, verifier=v.model)
        what = str(checkpoint)
    else:
        prof = Profile.load(profile)
        mask = source.mask_token_id if source else choose_mask_token_id(
            v.tokenizer, v.embedding_rows).id
        config = prof.to_drafter_config(v.model.config, mask,
                                        source.target_layer_ids if source else None)
        drafter = build_drafter(load_candidate(None), config, v.model, seed,
                                source.vocab_rows() if source else None)
        what = f"untrained ({prof.name}, seed {seed})"
    convs = load_conversations(data).conversations
    prompt_ids, used = held_out_prompts(v.tokenizer, convs, prompts,
                                        exclude_sources=source.sources if source else ())
    if not prompt_ids:
        raise TrainError(f"no held-out prompt found in {data!r}")
    eos = sorted(end_of_turn_ids(v.tokenizer, getattr(v.model, "generation_config", None)))
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    from dflash_audit.progress import progress_display

    with progress_display((TextColumn("eval"), BarColumn(), MofNCompleteColumn(),
                           TimeRemainingColumn(), TextColumn("{task.fields[info]}"))) as shown:
        task = shown.add_task("eval: tokens", total=len(prompt_ids) * max_new_tokens, info="")
        result = evaluate_acceptance(
            drafter, v.model, prompt_ids, max_new_tokens, eos,
            progress=lambda p: shown.update(task, completed=p.tokens, info=p.describe())
        ).to_dict()
    result.update(drafter=what, prompt_sources=used)
    return result
