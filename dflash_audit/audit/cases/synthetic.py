"""Synthetic audit cases: random packed rows, anchors and weights for a drafter config.

Real batches come from the data pipeline; these complement them with layouts real data
rarely hits (many short documents, padding, anchors near document starts, windows
smaller than a document, draft vocabularies). Everything is drawn from one seeded
``torch.Generator``, so a case is reproducible from (config, seed).
"""

from __future__ import annotations

import torch

from dflash_audit.audit.case import Case
from dflash_audit.model.anchors import select_anchors
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.loss import LossSpec


#: A document's assistant span at least this long gets an unsupervised user turn inside it
#: (from a third of the span on, a sixth of it long): real chats are multi-turn, and a rule
#: that looks at ``loss_mask[a+1]`` only differs where a supervised token precedes an
#: unsupervised one inside the row.
MULTI_TURN_SPAN = 24


def synthetic_batch(config: DFlashConfig, seq_len: int, num_documents: int, pad: int,
                    generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One packed row [1, seq_len] with ``num_documents`` documents then ``pad`` padding; each
    document's second part, roughly, is supervised (``loss_mask``), with a user turn inside
    a long one (:data:`MULTI_TURN_SPAN`).

    Returns the batch tensors with the reference's names; ``hidden_states`` and
    ``verifier_last_hidden_states`` are standard normal fp32.
    """
    T, H, g = seq_len, config.hidden_size, generator
    used = T - pad
    if num_documents < 1 or used < num_documents:
        raise ValueError(f"cannot pack {num_documents} documents into {used} tokens")
    cuts = torch.randperm(used - 1, generator=g)[: num_documents - 1].sort().values + 1
    bounds = [0, *cuts.tolist(), used]
    document_ids = torch.full((1, T), -1, dtype=torch.long)
    position_ids = torch.zeros((1, T), dtype=torch.long)
    loss_mask = torch.zeros((1, T), dtype=torch.long)
    for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        document_ids[0, s:e] = d
        position_ids[0, s:e] = torch.arange(e - s)
        # an assistant span: the second half of each document, roughly
        start = s + int(torch.randint(0, max(1, (e - s) // 2 + 1), (1,), generator=g))
        loss_mask[0, start:e] = 1
        span = e - start
        if span >= MULTI_TURN_SPAN:  # a multi-turn chat: a user turn inside the span
            gap = start + span // 3
            loss_mask[0, gap:gap + max(2, span // 6)] = 0
    return {
        "hidden_states": torch.randn(1, T, config.num_target_layers * H, generator=g),
        "verifier_last_hidden_states": torch.randn(1, T, H, generator=g),
        "input_ids": torch.randint(0, config.vocab_size, (1, T), generator=g)
        * (document_ids >= 0),
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "document_ids": document_ids,
    }


def synthetic_weights(config: DFlashConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A full state dict (reference key names) with random trainable and verifier weights.

    Norm gains are drawn around their identity so a norm applied twice or not at all
    changes the numbers; ``t2d`` / ``d2t`` describe a random draft vocabulary; ``lm_head``
    and ``verifier_lm_head`` are equal, as they are in training.
    """
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        model = DFlashDrafter(config)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                with torch.no_grad():
                    p.copy_(torch.rand_like(p) * 0.5 + (0.0 if getattr(
                        model.get_submodule(name.rsplit(".", 1)[0]), "one_plus_weight", False)
                        else 0.75))
        if config.uses_draft_vocab:
            V, Vd = config.vocab_size, config.effective_draft_vocab_size
            ids = torch.randperm(V)[:Vd].sort().values
            model.t2d.zero_()
            model.t2d[ids] = True
            model.d2t.copy_(ids - torch.arange(Vd))
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    # both heads are frozen copies of the verifier's lm_head in the reference (speculators
    # model.py load_verifier_weights): a state in which they differ never trains
    weights["verifier_lm_head.weight"] = weights["lm_head.weight"].clone()
    return weights


def synthetic_case(name: str, config: DFlashConfig, loss: LossSpec, seed: int, seq_len: int = 64,
                   num_documents: int = 2, pad: int = 4, max_anchors: int = 6) -> Case:
    """A complete case: batch, anchors drawn as in training, weights."""
    g = torch.Generator().manual_seed(seed)
    batch = synthetic_batch(config, seq_len, num_documents, pad, g)
    anchors, valid = select_anchors(batch["loss_mask"], max_anchors, config.block_size, g)
    return Case(name=name, config=config, loss=loss,
                inputs={**batch, "anchor_positions": anchors, "anchor_valid": valid},
                weights=synthetic_weights(config, g),
                description=f"synthetic seed={seed} T={seq_len} docs={num_documents} pad={pad} "
                            f"A={max_anchors}")


def plant_hits(case: Case) -> int:
    """Make the drafter's predictions right on some supervised slots of a synthetic ``case``
    (in place), so that accuracy and acceptance-length definitions give different numbers: at
    random weights the draft's argmax almost never equals either label, and every definition
    reads 0 hits. Our drafter (the reference's computation) runs once on the case; then for
    each valid anchor j, slots 1..ceil((B-1)/2) become a leading run of hits: against the
    verifier's argmax target on even j (``verifier_last_hidden_states`` at a+s-1 set to the
    draft's argmax row of ``verifier_lm_head``, divided by the ``verifier_norm`` gain), against
    the data token ``input_ids[a+s]`` on odd j (never at an anchor position: the drafter's
    own inputs stay as they were). Where that run meets an unsupervised slot u inside the
    block (slots 1..u-1 supervised, u <= ceil((B-1)/2) + 1: a user turn, or the next
    document's prompt after a document's end; u = 1 too: no hit before it), the first
    supervised slot after u becomes a hit too, against both labels (after every block's run
    is set; not at an anchor position): so an acceptance length that lets an unsupervised slot
    not end the accepted run reads a different number whichever label it takes. A position that another block already set keeps its first value. Not
    applied with ``sample_from_anchor`` (slot 0 is trained there).

    Returns:
        The number of supervised slots whose label was set (0: nothing changed).
    """
    config, inputs, B = case.config, case.inputs, case.config.block_size
    if config.sample_from_anchor or B < 2:
        return 0
    model = DFlashDrafter(config).float()
    model.load_state_dict(case.weights)
    keys = ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
            "document_ids", "position_ids", "anchor_positions", "anchor_valid")
    with torch.no_grad():
        out = model(**{k: inputs[k] for k in keys})
        gain = model.verifier_norm(torch.ones(1, config.hidden_size))[0]
    draft = out.logits[0].argmax(-1)  # [Q] draft-vocabulary ids
    token = draft + model.d2t[draft] if config.uses_draft_vocab else draft
    head = case.weights["verifier_lm_head.weight"].float()
    anchors = inputs["anchor_positions"].tolist()
    trained = out.aligned_loss_mask[0].bool()
    states = inputs["verifier_last_hidden_states"].clone()
    ids = inputs["input_ids"].clone()
    taken: set[int] = set()
    planted = 0

    def plant(j: int, s: int, both: bool = False) -> None:
        nonlocal planted
        q, t = j * B + s, anchors[j] + s
        if not trained[q] or t in taken or ((j % 2 or both) and t in anchors):
            return
        taken.add(t)
        if j % 2 or both:
            ids[0, t] = token[q]
        if not j % 2 or both:
            states[0, t - 1] = head[draft[q]] / gain
        planted += 1

    valid = inputs["anchor_valid"].tolist()
    for j in (j for j, ok in enumerate(valid) if ok):
        for s in range(1, 1 + B // 2):
            plant(j, s)
    for j in (j for j, ok in enumerate(valid) if ok):  # a hit past the run's unsupervised slot
        block = trained[j * B + 1:(j + 1) * B].tolist()
        u = block.index(False) + 1 if False in block else B
        after = [s for s in range(u + 1, B) if block[s - 1]]
        if u <= B // 2 + 1 and after and not any(block[s - 1] for s in range(u + 1, 1 + B // 2)):
            plant(j, after[0], both=True)
    inputs["verifier_last_hidden_states"], inputs["input_ids"] = states, ids
    return planted
