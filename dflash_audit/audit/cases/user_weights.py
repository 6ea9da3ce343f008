"""A user's drafter checkpoint weights in the audit: ``--weights DIR``.

The real cases then run on the user's trained weights instead of seeded random ones (the
verifier-owned part still comes from the verifier). ``DIR`` holds ``*.safetensors`` in the
speculators layout (``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.…``, ``norm.weight``,
and ``lm_head.weight`` / ``t2d`` / ``d2t`` for a draft vocabulary) or z-lab's (the same names,
possibly under a ``model.`` prefix); keys are mapped to the reference's names by dropping
those prefixes. Every trained weight the reference's state dict has must be present with its
shape; anything else is an error that names the keys (exit 2), never a silent partial load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_audit.user_input import loads_json

#: Verifier-owned weights the audit takes from the verifier, never from a drafter checkpoint.
VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: Prefixes other layouts put before the reference's key names.
PREFIXES = ("draft_model.", "model.")


class UserWeightsError(ValueError):
    """The checkpoint cannot be used: no files, or keys / shapes that do not match."""


def _names(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit
                                      else "")


def load_user_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder/*.safetensors``, keys mapped to the reference's names.

    Raises:
        UserWeightsError: no folder / no safetensors file (a pickle ``.bin`` named) /
            an unreadable file / a shard its index names missing / two files with one key /
            non-finite values.
    """
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
        hint = (f"; {', '.join(pickles)} is a pickle file, which is never loaded (it can run "
                "code): save the state dict with safetensors.torch.save_file") if pickles else ""
        where = ("no *.safetensors file there" if folder.is_dir() else "not a folder"
                 if folder.exists() else "does not exist")
        raise UserWeightsError(f"--weights {folder}: {where} (give the "
                               f"folder of a speculators or z-lab DFlash checkpoint){hint}")
    _check_index(folder)
    out: dict[str, torch.Tensor] = {}
    from safetensors import SafetensorError

    for file in files:
        try:
            tensors = load_file(file)
        except (SafetensorError, OSError) as exc:
            raise UserWeightsError(f"--weights {folder}: {file.name} is not a readable "
                                   f"safetensors file (truncated or corrupt? {exc})") from None
        for key, tensor in tensors.items():
            name = next((key[len(p):] for p in PREFIXES if key.startswith(p)), key)
            if name in out:
                raise UserWeightsError(f"--weights {folder}: key {name} appears twice")
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
            if tensor.is_floating_point() and not bool(out[name].isfinite().all()):
                bad = int((~out[name].isfinite()).sum())
                raise UserWeightsError(f"--weights {folder}: {key} in {file.name} holds {bad} "
                                       "non-finite values (NaN / inf); the checkpoint is "
                                       "damaged, audit a finite one")
    return out


def _check_index(folder: Path) -> None:
    """Every shard a ``*.safetensors.index.json`` names exists in ``folder``.

    Raises:
        UserWeightsError: an unreadable index, or shards missing (named).
    """
    for index in folder.glob("*.safetensors.index.json"):
        try:
            shards = set(loads_json(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserWeightsError(f"--weights {folder}: {index.name} is not a readable "
                                   f"safetensors index ({type(exc).__name__}: {exc})") from None
        missing = sorted(str(s) for s in shards if not (folder / str(s)).is_file())
        if missing:
            raise UserWeightsError(f"--weights {folder}: {index.name} names shards that are "
                                   f"not there: {_names(missing)}; copy the whole checkpoint")


def apply_user_weights(weights: dict[str, torch.Tensor], user: dict[str, torch.Tensor],
                       source: str, verifier_head: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """``weights`` (a case's full state dict, reference keys) with its trained part replaced
    by ``user``'s. With a draft vocabulary, ``verifier_lm_head`` becomes the rows of the
    verifier's full ``verifier_head`` [V, H] that the checkpoint's own ``t2d`` selects.

    Raises:
        UserWeightsError: keys the reference's drafter does not have, trained weights the
            checkpoint lacks, shapes that differ, or integer tensors where the reference's
            are floating point (or the reverse) (each named).
    """
    draft_vocab = "t2d" in weights
    trained = [k for k in weights if k not in VERIFIER_OWNED
               and (draft_vocab or k not in ("lm_head.weight", "t2d", "d2t"))]
    unknown = sorted(k for k in user if k not in weights)
    missing = sorted(k for k in trained if k not in user)
    shapes = sorted(f"{k} {list(user[k].shape)} (reference {list(weights[k].shape)})"
                    for k in user if k in weights and user[k].shape != weights[k].shape)
    dtypes = sorted(f"{k} {user[k].dtype} (reference {weights[k].dtype})" for k in user
                    if k in weights and user[k].is_floating_point()
                    != weights[k].is_floating_point())
    problems = []
    if unknown:
        problems.append(f"keys the reference's drafter does not have: {_names(unknown)}")
    if missing:
        problems.append(f"trained weights missing: {_names(missing)}")
    if shapes:
        problems.append(f"shapes differ: {_names(shapes, 4)}")
    if dtypes:
        problems.append(f"integer where floating point is expected, or the reverse: "
                        f"{_names(dtypes, 4)}")
    if problems:
        raise UserWeightsError(f"--weights {source} does not fit this audit's drafter: "
                               + "; ".join(problems) + " (is the profile the checkpoint's "
                               "config.json and the verifier the one it was trained for?)")
    out = dict(weights)
    out.update({k: v.clone() for k, v in user.items() if k not in VERIFIER_OWNED})
    if draft_vocab and verifier_head is not None:
        out["verifier_lm_head.weight"] = verifier_head[user["t2d"].bool()].clone()
    return out
