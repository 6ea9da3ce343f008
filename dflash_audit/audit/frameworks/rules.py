"""Whose rule a named cause is. The checks name rules in neutral words (an anchor sampler that
admits a = T - B, accuracy against the data tokens, layer ids counted by decoder layer): a
report on a plain candidate, or on another framework whose code happens to give the same
numbers (SpecForge with block_size 2 admits a = T - 2 = T - B), names no framework. When the
audited framework is the one whose own code has the rule, the cause says so, right after the
rule's name: "anchors admitted at T-B: a <= T - block_size (NVIDIA ModelOpt 0.47.0's rule)".
"""

from __future__ import annotations

from typing import Any

from dflash_audit.audit.checks.anchors import (
    AT_T_MINUS_B,
    NEEDS_NEXT,
    NEEDS_OWN_DOCUMENT,
    ONE_FEWER,
)
from dflash_audit.audit.checks.metrics import DATA_TOKEN_ACCURACY, RUN_PAST_UNSUPERVISED
from dflash_audit.audit.checks.structure import DECODER_LAYER_IDS

#: A rule's neutral name -> (what it is, the framework keys whose own code has it).
OWNED_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    # modelopt 0.47.0 hf_dflash.py:617-620 (max_anchor = seq_len - bs, inclusive)
    # nemo 0.7.0 speculative/dflash/core.py:251-253 (max_anchor = seq_len - bs, inclusive)
    AT_T_MINUS_B: ("rule", ("modelopt", "nemo")),
    # modelopt 0.47.0 hf_dflash.py:622 (max_n = min(num_anchors, valid) - 1)
    ONE_FEWER: ("count", ("modelopt",)),
    # specforge 0.2.0 algorithms/common/dflash_family_model.py:184-187 (loss_mask[a] and
    # loss_mask[a+1])
    NEEDS_NEXT: ("rule", ("specforge",)),
    # nemo 0.7.0 speculative/dflash/core.py:258 (doc_remaining >= bs - 1 on packed rows)
    NEEDS_OWN_DOCUMENT: ("rule", ("nemo",)),
    # their train_acc against input_ids[a+s]
    DATA_TOKEN_ACCURACY: ("accuracy", ("specforge", "modelopt", "nemo")),
    # nemo 0.7.0 speculative/dflash/core.py:139-141 (compute_accept_len: invalid slots count
    # as correct in the cumprod)
    RUN_PAST_UNSUPERVISED: ("acceptance length", ("nemo",)),
    # z-lab dflash/model.py:37-43, SpecForge and ModelOpt read hidden_states[id + 1]
    # NeMo's target.py:175 hooks decoder layer i (= HF hidden_states[i + 1])
    DECODER_LAYER_IDS: ("convention", ("zlab", "specforge", "modelopt", "nemo")),
}


def attribute(text: str, key: str, label: str) -> str:
    """``text`` with every rule of framework ``key`` it names followed by "(<label>'s rule)"
    (or count, convention, ...); unchanged for a rule that is not that framework's."""
    for name, (kind, owners) in OWNED_RULES.items():
        if key in owners and name in text:
            text = text.replace(name, f"{name} ({label}'s {kind})")
    return text


def attribute_rules(results: list[Any], framework: dict[str, Any] | None) -> list[Any]:
    """In place, on every result of one case: the summary, the diagnosis and the causes a
    check recorded in ``details["causes"]`` name the audited framework (``{"key", "label"}``)
    after each of its own rules (:func:`attribute`); nothing for a plain candidate (None).
    Returns ``results``."""
    if not framework or not framework.get("key"):
        return results
    key, label = str(framework["key"]), str(framework.get("label") or framework["key"])
    for r in results:
        r.summary = attribute(r.summary, key, label)
        r.diagnosis = [attribute(d, key, label) for d in r.diagnosis or []]
        if isinstance((r.details or {}).get("causes"), list):
            r.details = {**r.details, "causes": [attribute(c, key, label) if isinstance(c, str)
                                                 else c for c in r.details["causes"]]}
    return results
