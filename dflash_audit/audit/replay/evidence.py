"""What every diagnosis shares: the case's :class:`Evidence`, the hypothesis search (a cheap
sample first, then a confirmation), which checks a check's values depend on (``follows from the
X difference``) and the fallback "unexplained difference".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.hard_labels import DATA_TOKENS_CAUSE, data_token_slots, data_tokens
from dflash_audit.audit.result import CheckResult
from dflash_audit.audit.slots import supervised_rows, supervised_slots
from dflash_audit.audit.tolerance import closeness, tolerance
from dflash_audit.model.drafter import block_indices

#: A hypothesis search first compares on SEARCH_SAMPLE slots / positions (and SEARCH_VOCAB
#: vocabulary columns), then confirms a match on up to CONFIRM_SAMPLE slots, every column:
#: cheap on real verifiers (V = 49152) and still exact where it matters.
SEARCH_SAMPLE, SEARCH_VOCAB, CONFIRM_SAMPLE = 8, 256, 512
#: The most hypotheses one check's search tries (the budget of a failing audit's diagnosis).
MAX_HYPOTHESES = 96
#: Replays of the drafter one audit's diagnoses may spend on searches (a three-cause candidate
#: needs a few hundred on the default audit); once spent, later searches try only the
#: hypotheses that reproduced on earlier cases, and say so (:class:`SearchMemo`).
MAX_REPLAYS = 3000
#: A recomputation under a hypothesis matches the candidate within the check's tolerance or,
#: for a quantity of large magnitude, within MATCH_REL x max|prediction|: fp32 rounding of a
#: K-term reduction grows with the magnitude of its terms (real SmolLM2 targets reach |6500|,
#: where the fixed fp32 atol 1e-5 is 1.5e-9 relative, below fp32's resolution of 1.2e-7).
#: 1e-5 is ~84 ulps of the largest value; distinct hypotheses differ by >= 1e-3 relative.
MATCH_REL = 1e-5
#: Which checks a check's values depend on.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "logits": ("structure", "context", "mask"),
    "loss": ("structure", "context", "mask", "targets", "logits"),
    "gradients": ("structure", "context", "mask", "targets", "logits", "loss"),
    "metrics": ("targets", "logits", "loss"),
}


@dataclass
class SearchMemo:
    """What the costly hypothesis searches (replays of the drafter) found on one audit's
    earlier cases, so that a failing audit stays within a small factor of a passing one.

    Labels that reproduced a case are tried first on every later case (a cause found on one
    case is tried on all), alone and in pairs before any search (:meth:`known`); a search
    that found nothing does not stop the full search on the next case. Only once the audit
    has spent MAX_REPLAYS replays do later searches try just the labels that reproduced
    somewhere (deterministic: it depends on the case order only).
    Keys are ``(check, ...)``.
    """

    found: dict[str, dict[str, int]] = field(default_factory=dict)
    unexplained: dict[tuple, list[str]] = field(default_factory=dict)
    replays: int = 0
    budget: int = MAX_REPLAYS

    def order(self, key: tuple, hypotheses: list) -> list:
        """``(label, ...)`` hypotheses, those that reproduced before first (most often first);
        only those once the audit's replay budget is spent (:meth:`exhausted`)."""
        seen = self.found.get(key[0], {})
        ranked = sorted(hypotheses, key=lambda h: -seen.get(h[0], 0))
        return [h for h in ranked if h[0] in seen] if self.exhausted(key) else ranked

    def known(self, key: tuple) -> list[str]:
        """The labels that reproduced earlier cases, alone or with others (most often first),
        for :func:`dflash_audit.audit.replay.compound.compound_search` to try first."""
        seen = self.found.get(key[0], {})
        return sorted(seen, key=lambda label: -seen[label])

    def exhausted(self, key: tuple) -> list[str]:
        """The cases whose full search found nothing, once the replay budget is spent (then
        later searches are not full); [] while it lasts."""
        return self.unexplained.get(key, []) if self.replays >= self.budget else []

    def spend(self, n: int = 1) -> None:
        """Count ``n`` replays against the audit's budget."""
        self.replays += n

    def record(self, key: tuple, case: str, label: str | list[str] | None, full: bool) -> None:
        """One search's outcome: the label(s) that reproduced, or none after a full search."""
        for one in ([label] if isinstance(label, str) else label or []):
            counts = self.found.setdefault(key[0], {})
            counts[one] = counts.get(one, 0) + 1
        if not label and full:
            self.unexplained.setdefault(key, []).append(case)


@dataclass
class Evidence:
    """One case's inputs and both sides' outputs, with the derived quantities diagnoses share
    (and the audit's :class:`SearchMemo`, when it shares one across cases)."""

    case: Case
    cand: SideOutputs
    ref: SideOutputs
    failing: set[str] = field(default_factory=set)
    memo: SearchMemo | None = None

    @cached_property
    def tol(self) -> dict[str, float]:
        return tolerance(self.case)

    @cached_property
    def sup(self) -> torch.Tensor:  # [Q] bool
        return supervised_slots(self.case, self.ref)

    @cached_property
    def rows(self) -> torch.Tensor:  # [Q] bool
        return supervised_rows(self.case, self.ref)

    @property
    def config(self):
        return self.case.config

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return self.case.inputs

    @cached_property
    def block_idx(self) -> torch.Tensor:  # [Q] a_j + s
        return block_indices(self.inputs["anchor_positions"].long(), self.config.block_size)

    @cached_property
    def data_labels(self) -> torch.Tensor:  # [Q] int64
        """The data token each slot is taught, ``input_ids[a + s]`` (what SpecForge and
        ModelOpt without KD train against; :func:`dflash_audit.audit.hard_labels.data_tokens`),
        as a draft-vocabulary index (-1 where the token is not in the draft vocabulary)."""
        tokens = data_tokens(self.case)
        if "d2t" not in self.case.weights:
            return tokens
        d2t = self.case.weights["d2t"].long()
        inverse = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        inverse[torch.arange(d2t.numel()) + d2t] = torch.arange(d2t.numel())
        return inverse[tokens]

    def close(self, cand: torch.Tensor, predicted: torch.Tensor,
              tol: dict[str, float] | None = None) -> bool:
        """Whether a hypothesis' prediction reproduces the candidate's values: within
        ``tol`` (default the case's), its atol raised to the prediction's own scale
        (:func:`match_tolerance`)."""
        return cand.shape == predicted.shape and closeness(
            cand, predicted, **match_tolerance(tol or self.tol, predicted)).ok


def match_tolerance(tol: dict[str, float], predicted: torch.Tensor) -> dict[str, float]:
    """``tol`` with ``atol = max(atol, MATCH_REL * max|predicted|)`` over finite values."""
    p = predicted.detach()
    scale = float(p.abs().max()) if p.numel() else 0.0
    if not math.isfinite(scale):  # rare: leave the non-finite values out
        finite = p[torch.isfinite(p)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
    return {"atol": max(float(tol["atol"]), MATCH_REL * scale), "rtol": float(tol["rtol"])}


def sample(indices: torch.Tensor, k: int = SEARCH_SAMPLE) -> torch.Tensor:
    """Up to k evenly spread entries of a 1-D index tensor."""
    if indices.numel() <= k:
        return indices
    return indices[torch.linspace(0, indices.numel() - 1, k).round().long()]


def comma_list(items) -> str:
    """``a, b, c``."""
    return ", ".join(str(i) for i in items)


def and_list(items) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def follows_from(check: str, ev: Evidence) -> str | None:
    """"follows from the X and Y difference" for the failing checks upstream of ``check``."""
    upstream = [u for u in UPSTREAM.get(check, ()) if u in ev.failing]
    return f"follows from the {and_list(upstream)} difference" if upstream else None


def data_token_consequence(ev: Evidence) -> str | None:
    """"follows from the targets difference (targets are the data tokens ...)" when the
    candidate's own labels (``target_ids``) are the data tokens and the targets check failed
    on them (it names :data:`~dflash_audit.audit.hard_labels.DATA_TOKENS_CAUSE`); else None.
    A loss or metric difference that only restates those labels is this consequence, not a
    cause of its own."""
    if "targets" not in ev.failing or not data_token_slots(ev.case, ev.cand, ev.ref):
        return None
    return f"follows from the targets difference ({DATA_TOKENS_CAUSE})"


def search_hypotheses(ev: Evidence, hypotheses,
                      predict: Callable[[Any, Any], torch.Tensor],
                      observed: Callable[[Any], torch.Tensor], stages: list,
                      first: bool = True, cap: int = MAX_HYPOTHESES) -> list:
    """Hypotheses whose prediction ``predict(h, selection)`` matches ``observed(selection)``
    within tolerance at every stage (cheap selections first). The search is budgeted: it stops
    at the first match (``first``) and after ``cap`` hypotheses (hypothesis families list the
    likeliest members first), so a failing audit stays within a small factor of a passing one."""
    found = []
    for i, h in enumerate(hypotheses):
        if i >= cap:
            break
        if all(ev.close(observed(sel), predict(h, sel)) for sel in stages):
            found.append(h)
            if first:
                break
    return found


def shifted(x: torch.Tensor, d: int, dim: int = 1) -> torch.Tensor:
    """``x`` with ``out[:, p] = x[:, p + d]`` along ``dim`` (zeros where p + d is outside):
    ``d = 1`` is an EAGLE-3-style left shift."""
    out = torch.zeros_like(x)
    n = x.shape[dim]
    if abs(d) >= n:
        return out
    if d >= 0:
        out.narrow(dim, 0, n - d).copy_(x.narrow(dim, d, n - d))
    else:
        out.narrow(dim, -d, n + d).copy_(x.narrow(dim, 0, n + d))
    return out


def vocab_sample(size: int, k: int = SEARCH_VOCAB) -> torch.Tensor | None:
    """k evenly spread vocabulary columns, or None (all) for a small vocabulary."""
    return None if size <= k else torch.linspace(0, size - 1, k).round().long()


def unexplained(result: CheckResult) -> str:
    """The fallback cause, with the numbers."""
    nums = []
    if result.max_abs_diff is not None:
        nums.append(f"max abs {result.max_abs_diff:.3g}")
    if result.max_rel_diff is not None:
        nums.append(f"max rel {result.max_rel_diff:.3g}")
    if result.first_diff:
        nums.append("first at " + ", ".join(f"{k} {v}" for k, v in result.first_diff.items()))
    return (f"unexplained difference in {result.name}: no tested hypothesis reproduces the "
            f"candidate ({'; '.join(nums) or result.summary})")
