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
        UserWeightsError: no folder / no safetensors file / two files with one key.
    """
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise UserWeightsError(f"--weights {folder}: no *.safetensors file there (give the "
                               "folder of a speculators or z-lab DFlash checkpoint)")
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
    return out


def apply_user_weights(weights: dict[str, torch.Tensor], user: dict[str, torch.Tensor],
                       source: str, verifier_head: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """``weights`` (a case's full state dict, reference keys) with its trained part replaced
    by ``user``'s. With a draft vocabulary, ``verifier_lm_head`` becomes the rows of the
    verifier's full ``verifier_head`` [V, H] that the checkpoint's own ``t2d`` selects.

    Raises:
        UserWeightsError: keys the reference's drafter does not have, trained weights the
            checkpoint lacks, or shapes that differ (each named).
    """
    draft_vocab = "t2d" in weights
    trained = [k for k in weights if k not in VERIFIER_OWNED
               and (draft_vocab or k not in ("lm_head.weight", "t2d", "d2t"))]
    unknown = sorted(k for k in user if k not in weights)
    missing = sorted(k for k in trained if k not in user)
    shapes = sorted(f"{k} {list(user[k].shape)} (reference {list(weights[k].shape)})"
                    for k in user if k in weights and user[k].shape != weights[k].shape)
    problems = []
    if unknown:
        problems.append(f"keys the reference's drafter does not have: {_names(unknown)}")
    if missing:
        problems.append(f"trained weights missing: {_names(missing)}")
    if shapes:
        problems.append(f"shapes differ: {_names(shapes, 4)}")
    if problems:
        raise UserWeightsError(f"--weights {source} does not fit this audit's drafter: "
                               + "; ".join(problems) + " (is the profile the checkpoint's "
                               "config.json and the verifier the one it was trained for?)")
    out = dict(weights)
    out.update({k: v.clone() for k, v in user.items() if k not in VERIFIER_OWNED})
    if draft_vocab and verifier_head is not None:
        out["verifier_lm_head.weight"] = verifier_head[user["t2d"].bool()].clone()
    return out
