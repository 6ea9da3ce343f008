"""Target layer ids: the styles (``zlab``, ``speculators``) and explicit lists, resolved to ids
in the speculators convention for an N-layer verifier.

Convention (speculators / vLLM): id L < N is the residual stream after L decoder layers, i.e.
Hugging Face ``output_hidden_states[L]`` (0 = embeddings); z-lab ids are offset by one (z-lab
id k = speculators id k+1).
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_audit.data.errors import LayerIdError
from dflash_audit.model.config import ConfigError, default_target_layer_ids

LAYER_STYLES = ("zlab", "speculators")


def resolve_target_layer_ids(num_layers: int,
                             target_layer_ids: None | str | Sequence[int] = None,
                             zlab_ids: bool = False) -> list[int]:
    """Target layer ids in our (speculators) convention, ascending.

    ``target_layer_ids``: ``None`` (= ``"zlab"``: 5 evenly spaced), ``"speculators"``
    (``[2, N//2, N-3]``), a comma list ``"1,5,9"`` or a sequence of ints. With
    ``zlab_ids=True`` explicit ids are read as z-lab ids and shifted by +1.

    Id N (the last layer's output before the final norm, the plane
    ``verifier_last_hidden_states`` also holds) is accepted, as the reference's
    ``resolve_target_layer_ids`` accepts ids in [0, N] (speculators 0.9.0
    ``models/utils.py:99-140``; its launch script's ``--include-last-layer``).

    Raises:
        LayerIdError: unknown style, unparsable list, negative / out-of-range (> N) /
            duplicate ids, or ``zlab_ids`` with a style name.
    """
    n = int(num_layers)
    if target_layer_ids is None or (isinstance(target_layer_ids, str)
                                    and target_layer_ids.strip() in LAYER_STYLES):
        # "per-draft-layer" needs the draft depth: a profile resolves it
        # (dflash_audit.profile.Profile.resolve_target_layer_ids)
        style = "zlab" if target_layer_ids is None else target_layer_ids.strip()
        if zlab_ids:
            raise LayerIdError(f"--zlab-ids converts explicit ids only; the {style!r} default "
                               "is already in the speculators convention")
        try:
            return default_target_layer_ids(n, style=style)
        except ConfigError as exc:
            raise LayerIdError(str(exc)) from exc
    if isinstance(target_layer_ids, str):
        try:
            ids = [int(x) for x in target_layer_ids.split(",") if x.strip()]
        except ValueError as exc:
            raise LayerIdError(
                f"target layers {target_layer_ids!r}: use 'zlab', 'speculators' or a comma "
                "list of integers like 1,5,9") from exc
    else:
        ids = [int(x) for x in target_layer_ids]
    if not ids:
        raise LayerIdError("target_layer_ids is empty: give at least one layer id")
    given = list(ids)
    if zlab_ids:
        ids = [i + 1 for i in ids]
    note = f" (z-lab ids {given} -> ours {ids})" if zlab_ids else ""
    negative = [i for i in ids if i < 0]
    if negative:
        raise LayerIdError(f"target layer ids {negative} are negative{note}; negative ids are "
                           "not wrapped, give ids in [0, N]")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise LayerIdError(f"target layer ids {dup} are duplicated in {ids}{note}")
    out = [i for i in ids if i > n]
    if out:
        raise LayerIdError(f"target layer ids {out} out of range [0, {n}] for a verifier "
                           f"with {n} layers{note} (id {n} = the last layer's output before "
                           "the final norm)")
    return sorted(ids)


def to_zlab_ids(ids: Sequence[int]) -> list[int]:
    """z-lab-convention ids (z-lab dflash, SpecForge, ModelOpt: id k reads HF
    ``output_hidden_states[k + 1]``, z-lab ``dflash/model.py:37-43``) of speculators-convention
    ``ids``: k = id - 1, order kept. Id 0 becomes -1 (a z-lab framework cannot name it: its
    adapter's CAPABILITIES say ``embedding_layer: False``)."""
    return [int(i) - 1 for i in ids]


def from_zlab_ids(ids: Sequence[int]) -> list[int]:
    """Speculators-convention ids of z-lab-convention ``ids``: id = k + 1, order kept (the
    inverse of :func:`to_zlab_ids`; the reference's own converter maps them so,
    speculators 0.9.0 ``convert/dflash/converter.py:110-126``)."""
    return [int(i) + 1 for i in ids]
