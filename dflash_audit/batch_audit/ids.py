"""The mask token and the target layer ids, against the drafter that will read the files.

``mask_token_id`` (named by the files' metadata and/or the drafter config) must be a row of
the verifier's embedding, never pad / eos / bos / unk / an end-of-turn token, never occur in
the data (``input_ids`` of every row), and not be written by the chat template.

``target_layer_ids``: what the drafter reads slice j as (speculators convention, id L = HF
``hidden_states[L]``) comes from ``--drafter-config``, read by the very function
``compare --profile config.json`` reads it with
(:func:`dflash_audit.profile_import.drafter_layer_ids`: ``aux_hidden_state_layer_ids``:
speculators ids; a z-lab config's ``target_layer_ids``: z-lab ids, read as ``hidden_states[id
+ 1]`` by z-lab, so ours = z-lab + 1; a z-lab config naming none: z-lab's
``build_target_layer_ids(num_target_layers, num_hidden_layers)`` + 1, said as computed, not
read), or from ``--profile`` (its ``target_layers`` for this verifier). It is compared with
the layers the slices actually equal (:mod:`~dflash_audit.batch_audit.layers`). Findings:
``zlab ids read as speculators ids`` (every slice one layer early: the capture used z-lab ids
as HF indices), ``speculators ids read as zlab ids`` (one layer late), ``count collision``
(same number of slices, other ids: shapes match, so training runs silently on the wrong
layers) and ``count mismatch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_audit.batch_audit.result import FAIL, PASS, SKIP, Check
from dflash_audit.data.errors import DataError
from dflash_audit.data.tokenize import _forbidden_ids


def find_key(config: Any, key: str) -> Any:
    """``config[key]`` at the top level or in any nested dict (first found)."""
    if isinstance(config, dict):
        if key in config:
            return config[key]
        for value in config.values():
            found = find_key(value, key)
            if found is not None:
                return found
    return None


def read_drafter_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The drafter's ``config.json`` (a file, or a folder holding one) and the file read.

    Raises:
        DataError: missing, not JSON, or not a JSON object.
    """
    from dflash_audit.profile_import import read_config_json

    try:
        return read_config_json(path)
    except ValueError as exc:
        raise DataError(f"--drafter-config: {exc}") from None


def drafter_layer_ids(config: dict[str, Any] | None, profile: Any, num_layers: int,
                      source: str = "drafter config") -> tuple[list[int] | None, str, bool]:
    """The ids the drafter reads (speculators convention), where they come from (one line),
    and whether they were computed by a rule from a config that names none.

    A drafter config is read as ``compare --profile config.json`` reads it
    (:func:`dflash_audit.profile_import.drafter_layer_ids`: a z-lab config naming no
    ``target_layer_ids`` gets z-lab's ``build_target_layer_ids``, and the origin begins with
    "computed, not read"); a config of neither format falls back to a ``target_layer_ids``
    anywhere in it, in ``--profile``'s convention (z-lab + 1 under ``zlab``). Without a config,
    ``--profile``'s ids for this verifier (its origin when it was read from a config).

    Raises:
        DataError: a config whose ids cannot be read (not integers; a z-lab config z-lab would
            refuse), in :func:`~dflash_audit.profile_import.drafter_layer_ids`'s words.
    """
    from dflash_audit.profile_import import drafter_layer_ids as read_ids
    from dflash_audit.profile_import import ids_computed

    if config is not None:
        try:
            found = read_ids(config, source)
        except ValueError as exc:
            message = str(exc) if str(exc).startswith(source) else f"{source}: {exc}"
            raise DataError(f"--drafter-config {message}") from None
        if found is not None:
            return found.ids, found.origin, found.computed
        if (ids := find_key(config, "target_layer_ids")) is not None:
            zlab = profile is not None and profile.name == "zlab"
            return ([int(i) + int(zlab) for i in ids],
                    f"{source} target_layer_ids{' (z-lab ids, +1)' if zlab else ''}", False)
    if profile is not None:
        ids = profile.resolve_target_layer_ids(num_layers)
        origin = profile.target_layers_origin
        if origin:
            return ids, f"profile {profile.name}: {origin}", ids_computed(origin)
        if isinstance(profile.target_layers, str):
            return ids, (f"profile {profile.name}: target_layers = {profile.target_layers!r} "
                         f"for {num_layers} verifier layers"), False
        return ids, f"profile {profile.name}", False
    if config is not None:
        return None, (f"{source} names no target layer ids (no aux_hidden_state_layer_ids, not "
                      "a z-lab dflash_config) and no --profile says them"), False
    return None, "no --drafter-config or --profile", False


def check_target_layer_ids(measured: list[int | None], files_ids: list[int] | None,
                           drafter_ids: list[int] | None, source: str) -> Check:
    """Compare the layers the slices equal with the ids the drafter reads (module docstring)."""
    name = "target_layer_ids"
    details = {"measured": measured, "files": files_ids, "drafter": drafter_ids,
               "drafter_source": source}
    if drafter_ids is None:
        return Check(name, SKIP, f"{source}: the ids the drafter reads are unknown (the slices "
                     f"equal layers {measured})", details=details)
    if list(measured) == list(drafter_ids):
        return Check(name, PASS, f"the slices equal layers {measured}, which the drafter reads "
                     f"({source})", details=details)
    if len(measured) != len(drafter_ids):
        return Check(name, FAIL, f"the drafter reads {len(drafter_ids)} target layers "
                     f"{drafter_ids} ({source}); the files hold {len(measured)} slices "
                     f"(layers {measured})", finding="count mismatch", details=details)
    offsets = {(d - m) if m is not None else None for m, d in zip(measured, drafter_ids)}
    if offsets == {1}:
        return Check(name, FAIL, f"zlab ids read as speculators ids: the slices equal layers "
                     f"{measured}, the drafter reads them as {drafter_ids} ({source}); z-lab "
                     "id k is hidden_states[k+1], every slice is one layer early",
                     finding="zlab ids read as speculators ids", details=details)
    if offsets == {-1}:
        return Check(name, FAIL, f"speculators ids read as zlab ids: the slices equal layers "
                     f"{measured}, the drafter reads them as {drafter_ids} ({source}); every "
                     "slice is one layer late", finding="speculators ids read as zlab ids",
                     details=details)
    return Check(name, FAIL, f"count collision: {len(measured)} slices as the drafter expects, "
                 f"but they equal layers {measured}, not {drafter_ids} ({source}); the shapes "
                 "match, so training would run silently on the wrong layers",
                 finding="count collision", details=details)


def check_mask_token(files_id: int | None, drafter_id: int | None, tokenizer: Any,
                     embedding_rows: int, all_input_ids: list[torch.Tensor]) -> Check:
    """Check the mask token the files / drafter config name (module docstring)."""
    name = "mask_token_id"
    named = {k: v for k, v in (("files", files_id), ("drafter config", drafter_id))
             if v is not None}
    if not named:
        return Check(name, SKIP, "neither the files nor a drafter config name a mask token")
    if len(set(named.values())) > 1:
        return Check(name, FAIL, f"the files say mask_token_id {files_id}, the drafter config "
                     f"{drafter_id}", finding="mask token disagrees", details=named)
    mid = int(next(iter(named.values())))
    forbidden = _forbidden_ids(tokenizer)
    if not 0 <= mid < embedding_rows:
        return Check(name, FAIL, f"mask_token_id {mid} is outside the verifier's embedding "
                     f"[0, {embedding_rows})", finding="mask token out of range", details=named)
    if mid in forbidden:
        return Check(name, FAIL, f"mask_token_id {mid} is the {forbidden[mid]} token: it occurs "
                     "in the data and would be confused with the noise block's mask",
                     finding=f"mask token is {forbidden[mid]}", details=named)
    uses = sum(int((ids == mid).sum()) for ids in all_input_ids)
    if uses:
        return Check(name, FAIL, f"mask_token_id {mid} occurs {uses} times in the rows' "
                     "input_ids; it must be reserved and unused", finding="mask token in data",
                     details=named)
    text = tokenizer.convert_ids_to_tokens(mid) if mid < len(tokenizer) else None
    if text and text in str(getattr(tokenizer, "chat_template", "") or ""):
        return Check(name, FAIL, f"mask_token_id {mid} ({text!r}) is written by the chat "
                     "template", finding="mask token in template", details=named)
    return Check(name, PASS, f"mask_token_id {mid} ({text!r}) is not pad/eos/bos/end-of-turn, "
                 f"within the embedding and unused in {len(all_input_ids)} rows", details=named)
