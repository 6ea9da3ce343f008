"""Hard labels: a trainer that teaches each slot one token (``target_ids`` [1, Q] long, verifier
vocabulary) instead of a distribution, compared with the token the reference's targets put
first (the argmax of its ``targets`` on the slots it trains).

The reference's targets are the verifier's own prediction (``verifier_lm_head(verifier_norm(
verifier_last_hidden_states[a + s - 1]))``, speculators ``models/dflash/core.py:436-453``);
its hard-label loss ``ce`` takes their argmax (``losses/eager.py``). A trainer whose labels are
the data tokens ``input_ids[a + s]`` (SpecForge 0.2.0, ``dflash_family_model.py``) teaches the
drafter the text, not the verifier: named by :func:`data_token_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_audit.audit.case import Case, SideOutputs
from dflash_audit.audit.slots import supervised_slots
from dflash_audit.model.drafter import block_indices
from dflash_audit.model.loss import data_target_ids

#: The one wording of "the candidate is taught the data tokens" (targets check, loss check,
#: the diagnosis that a loss difference follows from it).
DATA_TOKENS_CAUSE = ("targets are the data tokens input_ids[a+s], not the verifier's "
                     "prediction")


def reference_label_ids(case: Case, ref: SideOutputs) -> torch.Tensor:
    """[Q] long: the verifier-vocabulary token the reference's targets rank first per slot
    (argmax over V_d mapped through ``d2t`` offsets, target id = i + d2t[i], when the case
    uses a draft vocabulary).

    Raises:
        KeyError: the reference returned no ``targets``.
    """
    ids = ref.tensors["targets"][0].float().argmax(-1)
    if case.config.uses_draft_vocab and "d2t" in case.weights:
        ids = ids + case.weights["d2t"].long()[ids]
    return ids.long()


def data_tokens(case: Case) -> torch.Tensor:
    """[Q] long: the data token each slot of ``case`` is taught, ``input_ids[a + s]``
    (``a + s + 1`` with ``sample_from_anchor``; position wrapped into the row): what ``ce-data``
    trains on and a data-token trainer returns as ``target_ids``
    (:func:`dflash_audit.model.loss.data_target_ids`)."""
    idx = block_indices(case.inputs["anchor_positions"].long(), case.config.block_size)
    return data_target_ids(case.inputs["input_ids"], idx, case.config.sample_from_anchor)[0]


@dataclass
class HardLabelComparison:
    """``target_ids`` against the reference's argmax on its supervised slots: ``compared``
    slots, ``differ`` [Q] bool (True where they differ, only supervised slots), and how many
    of the differing ones equal the data token ``input_ids[a+s]`` (``data_token``)."""

    compared: int
    differ: torch.Tensor
    data_token: int

    @property
    def ok(self) -> bool:
        return not bool(self.differ.any())


def compare_hard_labels(case: Case, cand: SideOutputs, ref: SideOutputs) -> HardLabelComparison:
    """Compare the candidate's ``target_ids`` [1, Q] with :func:`reference_label_ids` on the
    slots the reference trains (exact: token ids).

    Raises:
        KeyError: the candidate has no ``target_ids`` or the reference no ``targets``.
        ValueError: ``target_ids`` is not [1, Q].
    """
    sup = supervised_slots(case, ref)
    got = cand.tensors["target_ids"].reshape(-1).long()
    if got.numel() != sup.numel():
        raise ValueError(f"target_ids has {got.numel()} slots, the case has Q={sup.numel()}")
    differ = (got != reference_label_ids(case, ref)) & sup
    data = int((differ & (got == data_tokens(case))).sum())
    return HardLabelComparison(int(sup.sum()), differ, data)


def data_token_slots(case: Case, cand: SideOutputs, ref: SideOutputs) -> bool:
    """Whether the candidate's ``target_ids`` differ from the reference's argmax and, where
    they differ, are the data tokens ``input_ids[a+s]`` (most of those slots)."""
    if "target_ids" not in cand.tensors or "targets" not in ref.tensors:
        return False
    try:
        c = compare_hard_labels(case, cand, ref)
    except ValueError:
        return False
    bad = int(c.differ.sum())
    return bad > 0 and c.data_token >= max(1, bad // 2)
