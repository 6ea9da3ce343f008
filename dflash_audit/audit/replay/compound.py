"""Compound causes: the smallest set of replay hypotheses that together reproduce a candidate.

Real implementations differ from the reference in two or three places at once (a framework's
mask AND its positions, DESIGN.md sec. 8), and a search that tries one cause at a time
explains none of them. :func:`compound_search` first tries every hypothesis alone on top of
what is already established upstream (the candidate's own masks / context); where none
reproduces the candidate, it keeps the hypotheses that bring the replay closest (mean |diff|
at most :data:`IMPROVE` x the baseline's) and tries each of them together with every other
hypothesis (the closest alone first): greedy, capped at :data:`MAX_CAUSES` causes and
:data:`SEEDS` seeds per level, so its cost is at most ``1 + SEEDS`` passes over the
hypotheses. The causes found on the audit's earlier cases (``known``) are tried first, alone
and then together (:data:`KNOWN` of them at most): a bug that shows on every case is confirmed
in a few replays, not a full pass on each.

Hypotheses are ``(label, kwargs)`` with the kwargs of
:func:`dflash_audit.audit.replay.replay.replay`; :func:`combine` merges two of them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

#: A partial hypothesis is kept as a seed when it brings the replay's mean |diff| to at most
#: IMPROVE x the baseline's.
IMPROVE = 0.5
#: Seeds tried per level, and the most causes one compound hypothesis holds.
SEEDS, MAX_CAUSES = 2, 2
#: The most causes found on earlier cases that are combined before the search.
KNOWN = 6

Hypothesis = tuple[str, dict[str, Any]]


def _config_changes(config: Any, base: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(base, f.name)}


def combine(a: dict[str, Any], b: dict[str, Any], base_config: Any) -> dict[str, Any] | None:
    """Replay kwargs ``a`` and ``b`` as one, or None when they conflict: module edits compose,
    ``inputs`` / ``masks`` merge when they replace different tensors, two configs merge when
    they change different fields of ``base_config`` (the case's); two position transforms,
    weight layouts or RoPE frequency sets conflict."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif key == "edit":
            first = out[key]
            out[key] = lambda model, f=first, g=value: (f(model), g(model))
        elif key in ("inputs", "masks"):
            if set(out[key]) & set(value):
                return None
            out[key] = {**out[key], **value}
        elif key == "config":
            mine, theirs = (_config_changes(c, base_config) for c in (out[key], value))
            if set(mine) & set(theirs):
                return None
            out[key] = out[key].replace(**theirs)
        else:
            return None
    return out


@dataclasses.dataclass
class CompoundOutcome:
    """What a compound search found: the labels of the causes (empty: nothing reproduced), the
    merged replay kwargs that reproduce the candidate, and how many hypotheses it tried."""

    labels: list[str]
    kwargs: dict[str, Any] | None
    tried: list[str]
    replays: int


def compound_search(hypotheses: Iterable[Hypothesis], base: dict[str, Any], base_config: Any,
                    probe: Callable[[dict[str, Any]], tuple[bool, float]],
                    confirm: Callable[[dict[str, Any]], bool],
                    max_causes: int = MAX_CAUSES, seeds: int = SEEDS,
                    baseline: float | None = None,
                    known: Iterable[str] = ()) -> CompoundOutcome:
    """The fewest hypotheses that, on top of ``base``, reproduce the candidate.

    Args:
        hypotheses: ``(label, kwargs)``, likeliest first.
        base: replay kwargs already established (e.g. the candidate's own masks), may be {}.
        base_config: the case's config (:func:`combine` merges config changes against it).
        probe: ``kwargs -> (matches on the cheap sample, mean |diff| there)``.
        confirm: ``kwargs -> matches on the confirmation sample``.
        max_causes: the most hypotheses combined; seeds: partial hypotheses extended per level.
        baseline: ``probe(base)``'s mean |diff| when the caller has it (saves a replay).
        known: labels that reproduced earlier cases (likeliest first); the first
            :data:`KNOWN` of them among ``hypotheses`` are tried before the search, alone, then
            in combinations of up to ``max_causes`` (the fewest causes first).

    Returns:
        :class:`CompoundOutcome` (``labels`` [] when nothing reproduced).
    """
    hyps = list(hypotheses)
    replays, kwargs_of, tried = 0, dict(hyps), [h[0] for h in hyps]
    for labels in _known_subsets(known, kwargs_of, max_causes):
        merged: dict[str, Any] | None = base
        for label in labels:
            merged = None if merged is None else combine(merged, kwargs_of[label], base_config)
        if merged is None:
            continue
        ok, _err = probe(merged)
        replays += 1
        if ok and confirm(merged):
            return CompoundOutcome(list(labels), merged, tried, replays)
    if baseline is None:
        _, baseline = probe(base)
        replays += 1
    level: list[tuple[list[str], dict[str, Any], float]] = [([], base, baseline)]
    for _depth in range(max_causes):
        scored: list[tuple[float, list[str], dict[str, Any]]] = []
        for chosen, kwargs, _err in level:
            for label, kw in hyps:
                if label in chosen:
                    continue
                merged = combine(kwargs, kw, base_config)
                if merged is None:
                    continue
                ok, err = probe(merged)
                replays += 1
                if ok and confirm(merged):
                    return CompoundOutcome(chosen + [label], merged, tried, replays)
                scored.append((err, chosen + [label], merged))
        best = sorted((s for s in scored if s[0] <= IMPROVE * baseline), key=lambda s: s[0])
        level = [(labels, kw, err) for err, labels, kw in best[:seeds]]
        if not _depth:  # partners closest alone first: two real causes each bring it closer
            alone = {labels[-1]: err for err, labels, _kw in scored}
            hyps = sorted(hyps, key=lambda h: alone.get(h[0], float("inf")))
        if not level:
            break
    return CompoundOutcome([], None, tried, replays)


def _known_subsets(known: Iterable[str], hyps: dict[str, Any], max_causes: int
                   ) -> list[tuple[str, ...]]:
    """The combinations of 1 to ``max_causes`` of the first :data:`KNOWN` labels of
    ``known`` that are in ``hyps``, fewer first."""
    usable = [label for label in dict.fromkeys(known) if label in hyps][:KNOWN]
    return [s for n in range(1, max_causes + 1) for s in itertools.combinations(usable, n)]


#: Families of logit hypotheses by a word their labels start with (for "tried and ruled out").
FAMILIES = (("position ids", "position conventions"),
            ("attention ", "mask misuses by the attention"),
            ("noise block", "noise-block tokens"), ("mask_token_id", "mask-token fallbacks"),
            ("hidden_states", "input shifts"), ("RoPE", "RoPE variants"),
            ("RMSNorm", "norm eps"), ("MLP", "MLP variants"))


def tried_families(labels: Iterable[str]) -> str:
    """``"12 position conventions, 5 mask misuses by the attention, ..., 9 other draft-layer
    slips"`` for the labels of the hypotheses a search tried."""
    counts: dict[str, int] = {}
    for label in labels:
        family = next((name for prefix, name in FAMILIES if label.startswith(prefix)),
                      "masks" if " mask: " in label else "other draft-layer slips")
        counts[family] = counts.get(family, 0) + 1
    return ", ".join(f"{n} {family}" for family, n in counts.items())
