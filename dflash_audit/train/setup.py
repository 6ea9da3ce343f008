"""Building a run: its error type, the drafter, the data source, anchors and micro-batches,
and the held-out evaluation prompts (used by :mod:`dflash_audit.train.loop`)."""

from __future__ import annotations

from typing import Any

import torch

from dflash_audit.model.anchors import select_anchors
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.verifier_weights import load_verifier_weights
from dflash_audit.train.step import MODEL_INPUTS


class TrainError(Exception):
    """The run cannot start or continue; the message says why and what to do."""


def step_inputs(batch: Any, anchors: tuple[torch.Tensor, torch.Tensor], device: torch.device
                ) -> dict[str, torch.Tensor]:
    """A batch's tensors plus the anchors, on ``device`` (the drafter's forward inputs).
    Inference-mode tensors (online capture) are cloned so autograd may save them."""
    tensors = {k: v.clone() if v.is_inference() else v
               for k, v in ((k, v.to(device)) for k, v in batch.tensors().items())}
    tensors["anchor_positions"], tensors["anchor_valid"] = (a.to(device) for a in anchors)
    return {k: tensors[k] for k in MODEL_INPUTS}


def next_micro_batches(source: Any, seed: int, max_anchors: int, block_size: int,
                       device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The next step's micro-batches: the source's rows for this rank, each with up to
    ``max_anchors`` anchors drawn by ``select_anchors`` from the row's own generator
    (:func:`anchor_generator` of ``seed`` and the row's key), so a row gets the same anchors
    on whichever rank, in whichever world size, and after any resume."""
    micro = []
    for key, batch in source.next_rows():
        anchors = select_anchors(batch.loss_mask, max_anchors, block_size,
                                 anchor_generator(seed, key))
        micro.append(step_inputs(batch, anchors, torch.device(device)))
    return micro


def anchor_generator(seed: int, row_key: int = 0) -> torch.Generator:
    """The seeded CPU generator that draws the anchors of the row with key ``row_key`` (the
    source's global row index: :mod:`dflash_audit.train.sources`)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + 7919 * row_key) % (1 << 63))


def build_drafter(candidate: Any, config: Any, verifier_model: Any, seed: int,
                  vocab_rows: Any = None) -> DFlashDrafter:
    """The candidate's drafter for ``config``: seeded initialization, draft vocabulary from
    ``vocab_rows`` token counts when ``config`` has one, frozen verifier-owned weights from
    ``verifier_model`` (None: left as built, for a caller that loads every weight itself).

    Raises:
        TrainError: the candidate cannot build a trainable drafter.
    """
    from dflash_audit.model.vocab import draft_vocab, token_counts

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
    if verifier_model is not None:
        load_verifier_weights(model, verifier_model)
    return model


def make_source(cfg: Any, verifier: Any, profile: Any, env: Any):
    """The run's data source and the conversations held out for evaluation (online; None
    offline, where evaluation excludes every conversation packed into a batch).

    Raises:
        TrainError: not exactly one of ``batches`` / ``data``, or batches that do not fit
            the verifier (its config, its vocabulary) or the profile's target layers.
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
        from dflash_audit.data.batch import token_id_problem

        for path, (ids, _) in zip(source.files, source.vocab_rows()):
            problem = token_id_problem(ids, verifier.embedding_rows)
            if problem:
                raise TrainError(f"{path}: {problem}")
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


def eval_prompt_set(cfg: Any, source: Any, held: list[Any] | None, tokenizer: Any
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


def evaluate_drafter(model: DFlashDrafter, verifier: Any, prompts: list[list[int]], cfg: Any,
              tracker: Any, step: int, name: str) -> dict[str, Any]:
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
                                     sorted(eos), progress=tracker.eval_progress(name)
                                     ).to_dict()
    finally:
        verifier.model.to(home)
    tracker.log_eval(step, name, result)
    tracker.message(f"{name}: acceptance length {result['acceptance_length']:.3f} over "
                    f"{result['verify_steps']} verify steps ({result['wall_s']:.0f} s)")
    return result
