"""DFlash training loss: per-position divergences, per-slot weights, masked reduction.

``L = sum_k c_k * sum_q l_k(q) * m(q) * w(q) / (sum_q m(q) + 1e-5)`` over loss terms k
with mix coefficients c_k, aligned mask m and per-slot weights w. The denominator counts
supervised tokens, not weights (speculators ``losses/utils.py: loss_function``).

Per-slot weights:
* ``none``: ``w_0 = 0``, ``w_s = 1`` for s >= 1 (every slot 1 with ``sample_from_anchor``):
  SpecForge's default ``loss_decay_gamma=None`` (specforge 0.2.0
  ``algorithms/common/dflash_family_model.py:350-360``); the reference has no such weighting
  and runs ``fixed-exp-decay`` with ``gamma = inf`` instead, whose weights are the same
  (``reference/adapter.py: reference_loss_spec``);
* ``fixed-exp-decay`` (DFlash paper, arXiv 2602.06036 sec. 3.3): ``w_0 = 0``,
  ``w_s = exp(-(s-1)/gamma)`` for s >= 1; with ``sample_from_anchor`` ``w_s = exp(-s/gamma)``.
* ``dpace``: confidence-weighted suffix sums inside each block (D-PACE):
  ``c_s = (1-alpha) exp(-l_s) + alpha`` on supervised slots (1 elsewhere),
  ``P_s = prod_{t<=s} c_t``, ``w_s = m_s * sum_{t>=s} P_t m_t`` (no gradient through w).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_audit.user_input import JSONNestingError, loads_json, shorten

LOSS_REDUCTION_EPS = 1e-5
NLA_EPS = 1e-5
LK_HYBRID_ETA = 3.0
WEIGHTINGS = ("fixed-exp-decay", "dpace", "none")


#: dtype the divergences' softmaxes run in: float32, as the reference (speculators
#: losses/eager.py ``log_softmax(..., dtype=torch.float32)``); :func:`softmax_dtype` changes it
#: to reproduce an implementation that computes them in bf16 (speculators PR 788).
_SOFTMAX_DTYPE: list[torch.dtype] = [torch.float32]


@contextlib.contextmanager
def softmax_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Inside the block the divergences compute their softmaxes (and what follows) in
    ``dtype`` instead of float32: the audit's model of a low-precision loss softmax."""
    _SOFTMAX_DTYPE.append(dtype)
    try:
        yield
    finally:
        _SOFTMAX_DTYPE.pop()


def _log_probs(logits: torch.Tensor, targets: torch.Tensor):
    dtype = _SOFTMAX_DTYPE[-1]
    if dtype != torch.float32:  # CUDA autocast would run log_softmax in fp32: switch it off
        with torch.autocast(logits.device.type, enabled=False):
            return (F.log_softmax(logits.to(dtype), dim=-1),
                    F.log_softmax(targets.to(dtype), dim=-1))
    return (F.log_softmax(logits, dim=-1, dtype=torch.float32),
            F.log_softmax(targets, dim=-1, dtype=torch.float32))


def kl_div(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q), p = softmax(targets), q = softmax(logits). [1,Q,V] x2 -> [1,Q] fp32."""
    log_q, log_p = _log_probs(logits, targets)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reverse KL(q || p). [1,Q,V] x2 -> [1,Q] fp32."""
    log_q, log_p = _log_probs(logits, targets)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def js_div(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence 0.5 KL(p||m) + 0.5 KL(q||m), m = (p+q)/2 (Lin 1991)."""
    log_q, log_p = _log_probs(logits, targets)
    log_m = torch.logaddexp(log_q, log_p) - math.log(2.0)
    return 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))


def hard_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the hard label argmax(targets). [1,Q,V] x2 -> [1,Q] fp32."""
    labels = targets.argmax(-1)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none"
                           ).view(labels.shape)


def _overlap(logits, targets):
    log_q, log_p = _log_probs(logits, targets)
    return torch.minimum(log_q.exp(), log_p.exp()).sum(-1)


def total_variation(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TV distance 1 - sum_v min(p_v, q_v) (= 1 - acceptance rate). -> [1,Q] fp32."""
    return 1.0 - _overlap(logits, targets)


def neg_log_acceptance(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log(max(sum_v min(p_v, q_v), 1e-5)) (LK loss, Samarin et al., arXiv 2602.23881)."""
    return -torch.log(_overlap(logits, targets).clamp_min(NLA_EPS))


def lk_hybrid(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """lambda KL + (1 - lambda) TV with lambda = exp(-3 * stopgrad(overlap)) (arXiv 2602.23881)."""
    overlap = _overlap(logits, targets)
    lam = torch.exp(-LK_HYBRID_ETA * overlap.detach())
    return lam * kl_div(logits, targets) + (1.0 - lam) * (1.0 - overlap)


def data_ce(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the data tokens (hard labels): ``target_ids`` [1,Q] int64 holds
    ``input_ids[a+s]``, the token slot s is taught (``a+s+1`` with ``sample_from_anchor``),
    as SpecForge 0.2.0 trains (``algorithms/common/dflash_family_model.py:406-416``,
    ``F.cross_entropy(lm_head(hidden), target_ids)`` at ``:332-383``). [1,Q,V] x [1,Q] ->
    [1,Q] fp32. The reference has no such loss (it runs ``ce`` against argmax of the
    verifier's logits instead)."""
    return F.cross_entropy(logits.float().flatten(0, 1), target_ids.long().flatten(),
                           reduction="none").view(target_ids.shape)


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl_div": kl_div, "rkl": reverse_kl, "jsd": js_div, "ce": hard_ce,
    "tv": total_variation, "nla": neg_log_acceptance, "lk_hybrid": lk_hybrid,
}
#: Losses against the data tokens (``target_ids``) instead of the verifier's logits.
LABEL_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ce-data": data_ce,
}
#: Every loss name a profile may give (alone or in a JSON mix).
LOSS_NAMES = (*LOSSES, *LABEL_LOSSES)


def term_loss(name: str, logits: torch.Tensor, targets: torch.Tensor | None,
              target_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The elementwise values [1,Q] fp32 of loss ``name``: a divergence of ``logits`` from
    ``targets`` [1,Q,V_d] (:data:`LOSSES`) or a loss against ``target_ids`` [1,Q]
    (:data:`LABEL_LOSSES`).

    Raises:
        ValueError: ``name`` is unknown, or a label loss gets no ``target_ids``.
    """
    if name in LABEL_LOSSES:
        if target_ids is None:
            raise ValueError(f"loss {name!r} needs target_ids (the data tokens input_ids[a+s])")
        return LABEL_LOSSES[name](logits, target_ids)
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; use {sorted(LOSS_NAMES)}")
    return LOSSES[name](logits, targets)


def uses_data_targets(spec: str) -> bool:
    """Whether the loss ``spec`` (a name or a JSON mix) trains on the data tokens."""
    return any(name in LABEL_LOSSES for name in parse_loss(spec))


def parse_loss(spec: str) -> dict[str, float]:
    """``"kl_div"`` or a JSON mix ``'{"ce": 0.1, "tv": 0.9}'`` -> {name: coefficient}.

    Raises:
        ValueError: unknown name, empty or malformed mix, non-numeric coefficient.
    """
    if spec in LOSS_NAMES:
        return {spec: 1.0}
    shown = shorten(spec)
    try:
        mix = loads_json(spec)
    except json.JSONDecodeError as exc:
        why = f" ({exc.msg})" if isinstance(exc, JSONNestingError) else ""
        raise ValueError(f"unknown loss {shown!r}{why}: use one of {sorted(LOSS_NAMES)} or a JSON "
                         "mix such as '{\"ce\": 0.1, \"tv\": 0.9}'") from None
    if not isinstance(mix, dict) or not mix:
        raise ValueError(f"a loss mix must be a non-empty JSON object, got {shown!r}")
    for name, coef in mix.items():
        if name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {name!r} in mix; use {sorted(LOSS_NAMES)}")
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(
                coef):
            raise ValueError(f"coefficient of {name!r} must be a finite number, got {coef!r}")
    return {name: float(coef) for name, coef in mix.items()}


@dataclass(frozen=True)
class LossSpec:
    """What the loss is: divergence(s), per-slot weighting, gamma, D-PACE alpha."""

    loss: str = "kl_div"
    weighting: str = "fixed-exp-decay"
    gamma: float = 4.0
    dpace_alpha: float = 0.5

    def __post_init__(self) -> None:
        parse_loss(self.loss)
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")


def uniform_weights(block_size: int, sample_from_anchor: bool = False) -> torch.Tensor:
    """Weighting ``none``: [B] fp32, 0 at slot 0 and 1 elsewhere (all 1 with
    ``sample_from_anchor``), SpecForge 0.2.0 with ``loss_decay_gamma=None``
    (``algorithms/common/dflash_family_model.py:350-360``)."""
    w = torch.ones(block_size, dtype=torch.float32)
    if not sample_from_anchor:
        w[0] = 0.0
    return w


def exp_decay_weights(block_size: int, gamma: float, sample_from_anchor: bool = False
                      ) -> torch.Tensor:
    """Fixed exponential decay per slot, [B] fp32 (see module docstring)."""
    s = torch.arange(block_size, dtype=torch.float32)
    if sample_from_anchor:
        return torch.exp(-s / gamma)
    w = torch.exp(-(s - 1) / gamma)
    w[0] = 0.0
    return w


@torch.no_grad()
def dpace_weights(elementwise_loss: torch.Tensor, mask: torch.Tensor, block_size: int,
                  alpha: float) -> torch.Tensor:
    """D-PACE weights [1,Q] from a masked per-position loss [1,Q] and the mask [1,Q]."""
    m = mask.float().reshape(-1, block_size)
    conf = (1.0 - alpha) * torch.exp(-elementwise_loss.float().reshape(-1, block_size)) + alpha
    conf = torch.where(m > 0, conf, torch.ones_like(conf))
    prefix = conf.cumprod(-1) * m
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)
    return (suffix * m).reshape(1, -1)


def slot_weights(spec: LossSpec, elementwise_loss: torch.Tensor, mask: torch.Tensor,
                 block_size: int, sample_from_anchor: bool = False) -> torch.Tensor:
    """Per-position weight w [1,Q] for one loss term."""
    if spec.weighting == "dpace":
        return dpace_weights(elementwise_loss, mask, block_size, spec.dpace_alpha)
    if spec.weighting == "none":
        w = uniform_weights(block_size, sample_from_anchor).to(mask.device)
        return w.repeat(mask.shape[1] // block_size)[None]
    w = exp_decay_weights(block_size, spec.gamma, sample_from_anchor).to(mask.device)
    return w.repeat(mask.shape[1] // block_size)[None]


@dataclass
class LossResult:
    loss: torch.Tensor  # [] fp32
    terms: dict[str, torch.Tensor]  # name -> unweighted term value [] (detached)
    weights: dict[str, torch.Tensor]  # name -> per-position weights [1,Q]


def dflash_loss(logits: torch.Tensor, targets: torch.Tensor, aligned_loss_mask: torch.Tensor,
                block_size: int, spec: LossSpec = LossSpec(),
                sample_from_anchor: bool = False,
                target_ids: torch.Tensor | None = None) -> LossResult:
    """Total DFlash loss.

    Args:
        logits, targets: [1,Q,V_d]; aligned_loss_mask: [1,Q] 0/1; Q a multiple of block_size.
        target_ids: [1,Q] int64 data tokens each slot is taught, needed by ``ce-data``
            (:func:`data_target_ids`).

    Raises:
        ValueError: a ``ce-data`` term without ``target_ids``.

    Returns:
        LossResult with the scalar loss (fp32, differentiable), each term's value and the
        per-position weights used.
    """
    m = aligned_loss_mask.float()
    denom = m.sum() + LOSS_REDUCTION_EPS
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    terms, weights = {}, {}
    for name, coef in parse_loss(spec.loss).items():
        elementwise = term_loss(name, logits, targets, target_ids) * m  # [1,Q]
        w = slot_weights(spec, elementwise, m, block_size, sample_from_anchor)
        term = (elementwise * w).sum() / denom
        terms[name], weights[name] = term.detach(), w
        total = total + coef * term
    return LossResult(total, terms, weights)


def data_target_ids(input_ids: torch.Tensor, indices: torch.Tensor,
                    sample_from_anchor: bool = False) -> torch.Tensor:
    """The data token each slot is taught: [1,T] ``input_ids``, [Q] block positions ``a+s`` ->
    [1,Q] int64 ``input_ids[a+s]`` (``a+s+1`` with ``sample_from_anchor``: the token the
    verifier's prediction at ``a+s`` is for), wrapping modulo T like the targets
    (SpecForge 0.2.0 ``algorithms/common/dflash_family_model.py:406-416``)."""
    T = input_ids.shape[1]
    return input_ids[:, (indices + int(sample_from_anchor)) % T].long()
