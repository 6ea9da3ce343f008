"""Weights of a real audit case: a seeded random trainable part + the verifier's real frozen
weights (embedding, LM head, final norm), under the reference's state-dict keys.

The frozen part is :func:`dflash_audit.model.verifier_weights.verifier_state` of the verifier
(what the reference loads from it: ``embed_tokens``, ``lm_head`` / ``verifier_lm_head`` with
the rows of the draft vocabulary, ``verifier_norm``). The draft vocabulary, when the profile
has one, is the most frequent supervised tokens of the audited rows
(:mod:`dflash_audit.model.vocab`). The trainable part (fc, hidden_norm, layers, norm) is drawn
from a seeded generator with norm gains spread around their identity, so a norm applied twice
or not at all changes the numbers (:func:`dflash_audit.audit.cases.synthetic.synthetic_weights`),
then briefly fitted to the verifier's targets (:func:`fit_to_targets`) so that loss terms that
coincide at random initialisation (lk_hybrid and kl_div at overlap 0) differ on real data.

The frozen weights are cached with the captured batches (:mod:`.real_inputs`), so a warm
audit does not load the verifier: :func:`save_frozen` / :func:`load_frozen` store the full
vocabulary tensors once (a tied or duplicated head is not stored twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_audit.atomic import save_safetensors
from dflash_audit.audit.cases.synthetic import synthetic_weights
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.verifier_weights import verifier_state
from dflash_audit.model.vocab import draft_vocab, token_counts

FROZEN_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
               "verifier_norm.weight")
_SAME_AS = {"lm_head.weight": "embed_tokens.weight", "verifier_lm_head.weight": "lm_head.weight"}


class VerifierWeightsError(ValueError):
    """The verifier's frozen weights do not fit the drafter config (or cannot be found)."""


def verifier_frozen_weights(model: Any) -> dict[str, torch.Tensor]:
    """The frozen, full-vocabulary weights of a loaded HF causal LM (reference keys).

    Raises:
        VerifierWeightsError: the verifier has no recognisable final norm.
    """
    try:
        return verifier_state(model)
    except ValueError as exc:
        raise VerifierWeightsError(str(exc)) from None


def save_frozen(weights: dict[str, torch.Tensor], path: Path) -> Path:
    """Save :func:`verifier_frozen_weights` output; a head equal to the tensor it would
    duplicate (tied embedding, verifier head = head) is stored once."""
    tensors, aliases = {}, {}
    for key in FROZEN_KEYS:
        same = _SAME_AS.get(key)
        while same is not None and same in aliases:
            same = aliases[same]
        if same is not None and torch.equal(weights[key], weights[same]):
            aliases[key] = same
        else:
            tensors[key] = weights[key].contiguous()
    save_safetensors(tensors, path, metadata={f"alias:{k}": v for k, v in aliases.items()})
    return path


def load_frozen(path: Path) -> dict[str, torch.Tensor]:
    """Inverse of :func:`save_frozen`."""
    from safetensors import safe_open

    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        aliases = {k[len("alias:"):]: v for k, v in (f.metadata() or {}).items()
                   if k.startswith("alias:")}
    for key in FROZEN_KEYS:
        if key not in tensors:
            tensors[key] = tensors[aliases[key]]
    return tensors


def real_case_weights(config: DFlashConfig, frozen: dict[str, torch.Tensor], seed: int,
                      rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                      ) -> dict[str, torch.Tensor]:
    """A full drafter state dict (reference keys): trainable part from ``seed``, frozen part
    from the verifier (see the module docstring).

    Args:
        config: the drafter config (dimensions must match the verifier's).
        frozen: :func:`verifier_frozen_weights` (or :func:`load_frozen`) of the verifier.
        seed: seeds the trainable part.
        rows: ``(input_ids, loss_mask)`` of the audited rows; they pick the draft
            vocabulary when ``config.uses_draft_vocab``.

    Raises:
        VerifierWeightsError: the frozen weights do not have the config's shapes.
    """
    V, H = config.vocab_size, config.hidden_size
    expected = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H),
                "verifier_lm_head.weight": (V, H), "verifier_norm.weight": (H,)}
    bad = {k: tuple(frozen[k].shape) for k, shape in expected.items()
           if tuple(frozen[k].shape) != shape}
    if bad:
        raise VerifierWeightsError(f"verifier weights {bad} do not match the drafter config "
                                   f"(V={V}, H={H}): is this the drafter's verifier?")
    weights = synthetic_weights(config, torch.Generator().manual_seed(seed))
    head, verifier_head = frozen["lm_head.weight"], frozen["verifier_lm_head.weight"]
    if config.uses_draft_vocab:
        t2d, d2t = draft_vocab(token_counts(rows or [], V), config.effective_draft_vocab_size)
        weights["t2d"], weights["d2t"] = t2d, d2t
        head, verifier_head = head[t2d], verifier_head[t2d]
    # distinct storage per key: safetensors refuses to save tensors that share memory
    weights["embed_tokens.weight"] = frozen["embed_tokens.weight"]
    weights["lm_head.weight"] = head.clone()
    weights["verifier_lm_head.weight"] = verifier_head.clone()
    weights["verifier_norm.weight"] = frozen["verifier_norm.weight"].clone()
    return weights


#: The brief fit of a real case's trainable weights (:func:`fit_to_targets`): Adam steps,
#: learning rate, anchors of the first row used (a few blocks keep it cheap on a real
#: vocabulary). Measured on the default real case (SmolLM2, V = 49152, T = 256, B = 8): the
#: overlap goes from 0.000 to 0.07 and lk_hybrid differs from kl_div by 10 % (4.9e-6 before).
FIT_STEPS, FIT_LR, FIT_ANCHORS = 2, 3e-2, 2
#: The loss the fit minimises: the reference's own default divergence.
FIT_LOSS = "kl_div"


def fit_to_targets(config: DFlashConfig, weights: dict[str, torch.Tensor],
                   inputs: dict[str, torch.Tensor], steps: int = FIT_STEPS, lr: float = FIT_LR,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights after a brief, seeded fit of our drafter's trainable part to the verifier's
    targets on one row, so that the drafter's and the verifier's distributions overlap.

    At random initialisation the overlap ``sum_v min(p_v, q_v)`` is about 0, where loss terms
    built on it coincide (``lk_hybrid`` = ``kl_div`` exactly at overlap 0, ``tv`` = 1): a real
    case could not tell them apart. Fitted, each loss term gives its own value.

    Args:
        config: the drafter config; weights: a full state dict (reference keys), not changed.
        inputs: one case's inputs (``input_ids`` [1,T], ``hidden_states`` [1,T,n*H], ...,
            ``anchor_positions`` [A], ``anchor_valid`` [A]); the first FIT_ANCHORS anchors are
            used.
        steps, lr: Adam steps and learning rate; seed: seeds torch during the fit.

    Returns:
        A new state dict: the fitted trainable tensors, the frozen ones shared with ``weights``.
    """
    from dflash_audit.model.drafter import DFlashDrafter
    from dflash_audit.model.loss import LossSpec, dflash_loss

    keys = ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
            "document_ids", "position_ids")
    # clones: captured batches may be inference tensors, which autograd cannot save
    row = {k: inputs[k].clone() for k in keys}
    row["anchor_positions"] = inputs["anchor_positions"][:FIT_ANCHORS].clone()
    row["anchor_valid"] = inputs["anchor_valid"][:FIT_ANCHORS].clone()
    if not bool(row["anchor_valid"].any()):
        return dict(weights)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DFlashDrafter(config).float()
        model.load_state_dict(weights, strict=True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(trainable, lr=lr)
        for _ in range(steps):
            out = model(**row)
            loss = dflash_loss(out.logits, out.targets, out.aligned_loss_mask, config.block_size,
                               LossSpec(FIT_LOSS), config.sample_from_anchor).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    fitted = {k: v.detach().clone().to(weights[k].dtype) for k, v in model.state_dict().items()
              if k in names}
    return {**weights, **fitted}
