"""The dtype and device an audit runs in.

``--dtype bf16`` runs both sides as the reference trains in bf16 (speculators
``train/trainer.py``: fp32 master weights, the forward under ``torch.autocast(device,
bfloat16)``; ``train/config/schema.py`` ``hidden_states_dtype``: the dataloader hands the
verifier's hidden states over in bf16). The divergence softmaxes stay fp32 because the
reference asks for it (``losses/eager.py``: ``log_softmax(..., dtype=torch.float32)``).
The tolerances of a dtype other than fp32 are measured: :mod:`dflash_audit.audit.replay.noise`.

A bf16 case's weights are bf16 values held in fp32 (:func:`representable_weights`): bf16
training has two conforming layouts, fp32 parameters under autocast (the reference) and bf16
module parameters whose optimizer keeps an fp32 master copy (FSDP ``MixedPrecision(param_dtype=
bfloat16)``, Megatron / DeepSpeed bf16 optimizers), and the second forwards the master rounded to
bf16. From weights that rounding leaves unchanged both start from identical values, so the
measured noise (the reference against itself on these same weights) covers both; from
arbitrary fp32 weights the second differed by the rounding of every weight (norm gains included),
a difference no tolerance derived from the reference's own noise contains.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from dflash_audit.audit.case import Case

#: Audit dtypes (``--dtype``, profile field ``dtype``) -> the autocast compute dtype.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Inputs the reference's dataloader hands over in the training dtype (train/data.py).
HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")
DEVICES = ("cpu", "cuda")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (the names of :data:`DTYPES`; else torch's name)."""
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def representable_weights(weights: dict[str, torch.Tensor], dtype: torch.dtype
                          ) -> dict[str, torch.Tensor]:
    """``weights`` with every floating tensor finer than ``dtype`` rounded to ``dtype``
    (round to nearest even) and held in its own dtype again: fp32 master weights whose ``dtype``
    copy is exact. Integer / bool tensors (``t2d``, ``d2t``) and tensors already in ``dtype``
    are the same objects; nothing is changed in place."""
    return {k: v.to(dtype).to(v.dtype) if coarser(dtype, v.dtype) else v
            for k, v in weights.items()}


def in_dtype(case: Case, dtype: str, device: str = "cpu",
             rounded: dict[int, dict[str, torch.Tensor]] | None = None) -> Case:
    """The case run in ``dtype`` on ``device``: the hidden states cast to the dtype as the
    reference's dataloader does; the weights stay fp32 (master weights), with values the dtype
    represents (:func:`representable_weights`; see the module docstring). ``rounded``: a memo
    ``{id(fp32 weights): rounded weights}`` so cases that share one weights dict (the real
    cases) still share one after rounding.

    Raises:
        ValueError: an unknown dtype or device.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {list(DTYPES)}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use one of {list(DEVICES)}")
    inputs = {k: v.to(DTYPES[dtype]) if k in HIDDEN_KEYS else v for k, v in case.inputs.items()}
    weights = case.weights
    if DTYPES[dtype] != torch.float32:
        rounded = {} if rounded is None else rounded
        if id(case.weights) not in rounded:
            rounded[id(case.weights)] = representable_weights(case.weights, DTYPES[dtype])
        weights = rounded[id(case.weights)]
    return dataclasses.replace(case, inputs=inputs, weights=weights, dtype=dtype, device=device)


def autocast(case: Case) -> contextlib.AbstractContextManager:
    """The autocast context a training step of the case runs under (none in fp32)."""
    if case.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(case.device, dtype=DTYPES[case.dtype])


def outputs_on_cpu(tensors: dict[str, Any]) -> dict[str, Any]:
    """A side's output tensors on the CPU; a flex ``BlockMask`` (the CUDA path's mask) as the
    dense bool [Q, T+Q] it applies (:func:`dflash_audit.model.mask.materialise_block_mask`)."""
    from dflash_audit.model.mask import materialise_block_mask

    out = {}
    for k, v in tensors.items():
        if hasattr(v, "mask_mod") and hasattr(v, "kv_indices"):
            v = materialise_block_mask(v)
        out[k] = v.cpu() if isinstance(v, torch.Tensor) else v
    return out


def check_device_and_dtype(device: str, dtype: str | None) -> None:
    """Validate ``--device`` / ``--dtype``.

    Raises:
        ValueError: an unknown name, or ``cuda`` on a machine where torch sees no GPU.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU on this machine "
                         f"(torch {torch.__version__}, built with CUDA "
                         f"{torch.version.cuda or 'no'}); run on a GPU machine or use "
                         "--device cpu")




#: Structure field a candidate reports the dtype of the copy its optimizer updates in:
#: one dtype name for every trainable parameter (``"float32"``) or ``{parameter: dtype}``.
MASTER_WEIGHTS = "master_weights"


def torch_dtype(name: Any) -> torch.dtype | None:
    """``"bfloat16"`` / ``"torch.float32"`` / ``"fp32"`` -> the torch dtype; None otherwise."""
    if not isinstance(name, str):
        return None
    name = name.replace("torch.", "")
    found = DTYPES.get(name, getattr(torch, name, None))
    return found if isinstance(found, torch.dtype) else None


def coarser(dtype: torch.dtype | None, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` holds fewer mantissa bits than floating ``than``."""
    return dtype is not None and dtype.is_floating_point and than.is_floating_point and \
        torch.finfo(dtype).eps > torch.finfo(than).eps


def unmastered_parameters(cand: dict[str, Any], ref: dict[str, Any]) -> dict[str, str]:
    """Trainable parameters the candidate holds in a coarser dtype than the reference's
    (bf16 where the reference trains fp32) without a master copy of the reference's precision
    reported in its structure's :data:`MASTER_WEIGHTS`: {name: its dtype}. ``cand`` / ``ref``
    are structure summaries (``state_dict``: {name: {"dtype", "trainable", ...}})."""
    master = cand.get(MASTER_WEIGHTS)
    ref_sd, out = ref.get("state_dict") or {}, {}
    for name, entry in (cand.get("state_dict") or {}).items():
        if not isinstance(entry, dict) or not entry.get("trainable"):
            continue
        want = torch_dtype((ref_sd.get(name) or {}).get("dtype")) or torch.float32
        own = torch_dtype(entry.get("dtype"))
        copy = torch_dtype(master.get(name) if isinstance(master, dict) else master)
        if coarser(own, want) and (copy is None or coarser(copy, want)):
            out[name] = str(entry["dtype"]).replace("torch.", "")
    return out


def lost_update_floor(weight: torch.Tensor, dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype`` at the median nonzero |entry| of ``weight``: an update
    below it leaves that entry unchanged when applied in ``dtype`` (round to nearest). 0.0 for
    an all-zero weight."""
    w = weight.detach().float().abs().flatten()
    w = w[w > 0]
    if not w.numel():
        return 0.0
    return float(torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(w.median())) / 2)
