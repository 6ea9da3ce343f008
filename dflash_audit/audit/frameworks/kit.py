"""The adapter kit: recorders a framework adapter needs to drive a framework's real code and
record what it computes, without recomputing it (DESIGN.md sec. 8).

* :func:`record_calls` -- wrap a module attribute or a method (a mask builder, a loss helper)
  and record every call's arguments and what it returned;
* :func:`record_outputs` -- a forward hook that records a module's outputs (the context after
  ``hidden_norm``, the logits of a head);
* :func:`slot_weights_from_losses` -- per-slot weights from a framework's weighted and
  unweighted per-token losses;
* :func:`inject_anchors` -- replace a sampler method that lives inside ``forward`` by one that
  returns the audit's anchors (in the framework's own format), recording its calls;
* :func:`seeded_global_rng` -- run a sampler that draws from torch's global RNG under a seed
  drawn from a ``torch.Generator``, leaving the global RNG as it was;
* :func:`state_dict_entries` -- the ``structure["state_dict"]`` summary of the framework's
  built drafter plus the frozen verifier tensors it uses.

Every recorder is a context manager that restores what it changed on exit, also when the
framework raises. ``examples/frameworks/toy_framework_adapter.py`` wraps a tiny framework with
them; :mod:`dflash_audit.audit.frameworks.zlab_adapter` uses them on z-lab's code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Call:
    """One recorded call: its positional and keyword arguments and what it returned."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any


@contextlib.contextmanager
def record_calls(owner: Any, name: str) -> Iterator[list[Call]]:
    """Inside the block, every call of ``owner.<name>`` runs the original and is recorded.

    ``owner`` is a module (a function the framework looks up by its global name at call time,
    e.g. ``dflash.model._attention_mask``), a class (every instance's method) or one object
    (its bound method only). The original is called with the same arguments and its result
    is returned unchanged, so the framework computes exactly what it computes without the kit.

    Yields:
        The list of :class:`Call` records, in call order (filled while the block runs).

    Raises:
        AttributeError: ``owner`` has no attribute ``name`` (the framework's API changed: the
            adapter must say which version it supports).
    """
    getattr(owner, name)  # AttributeError names the missing attribute
    own = hasattr(owner, "__dict__") and name in vars(owner)
    raw = vars(owner)[name] if own else None
    calls: list[Call] = []
    # on a class, wrap the raw attribute so that it stays what it was (a method binds self, a
    # staticmethod / classmethod keeps its kind); on a module or an object, the value read
    kind = type(raw) if isinstance(owner, type) and isinstance(
        raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if kind else getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(Call(args, kwargs, result))
        return result

    setattr(owner, name, kind(wrapper) if kind else wrapper)
    try:
        yield calls
    finally:
        if own:
            setattr(owner, name, raw)
        else:  # an inherited attribute: drop the shadowing wrapper
            delattr(owner, name)


@contextlib.contextmanager
def record_outputs(module: torch.nn.Module) -> Iterator[list[Any]]:
    """A forward hook on ``module`` for the block: every output it returns is recorded (as
    returned: a tensor, or the framework's tuple / ModelOutput). Use it for what a framework
    computes inside its ``forward`` and does not return, such as the context
    ``hidden_norm(fc(hidden_states))`` or the logits of an output head.

    Yields:
        The list of outputs, one per forward call of ``module``, in call order.
    """
    outputs: list[Any] = []
    handle = module.register_forward_hook(lambda _m, _args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()


def slot_weights_from_losses(weighted: torch.Tensor, unweighted: torch.Tensor,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-slot weights ``w = weighted / unweighted`` from a framework's per-token losses:
    ``weighted`` the terms it sums (``l * w``, or ``l * w * m``), ``unweighted`` the plain
    per-token loss ``l``; both [..., Q] in slot order (block j's slots at j*B .. j*B+B-1).

    Where ``mask`` (same shape, 0/1) is 0 or ``unweighted`` is 0 the weight cannot be told
    from the losses and is 0 (those slots are not trained, so the ``loss`` check never reads
    them). Computed in float64, returned float32 [1, Q].

    Raises:
        ValueError: the two tensors hold a different number of slots.
    """
    if weighted.numel() != unweighted.numel():
        raise ValueError(f"weighted has {weighted.numel()} slots, unweighted "
                         f"{unweighted.numel()}: give per-token losses of the same slots")
    w, loss = weighted.detach().double().reshape(-1), unweighted.detach().double().reshape(-1)
    keep = loss != 0
    if mask is not None:
        keep &= mask.reshape(-1).bool()
    out = torch.where(keep, w / torch.where(keep, loss, torch.ones_like(loss)),
                      torch.zeros_like(w))
    return out.float().reshape(1, -1)


@contextlib.contextmanager
def inject_anchors(owner: Any, name: str, result: Callable[..., Any]) -> Iterator[list[Call]]:
    """Replace the sampler ``owner.<name>`` (a method that lives inside the framework's
    ``forward``, e.g. SpecForge's ``_sample_anchor_positions``) by ``result`` for the block.

    ``result(*args, **kwargs)`` gets the framework's own arguments (so it can check the
    sequence length or device it is called with) and returns the audit's anchors in the
    framework's format (e.g. ``(anchors[None], keep[None])``). Set on an object, the
    replacement is an instance attribute (no ``self``); on a module, a module attribute.

    Yields:
        The list of :class:`Call` records (arguments and the anchors returned): an adapter
        asserts the framework called its sampler, else the injected anchors were not used.

    Raises:
        AttributeError: ``owner`` has no ``name`` (the framework's API changed).
    """
    getattr(owner, name)  # AttributeError names the missing sampler
    had_own = hasattr(owner, "__dict__") and name in vars(owner)
    before = vars(owner)[name] if had_own else None
    calls: list[Call] = []

    def sampler(*args, **kwargs):
        out = result(*args, **kwargs)
        calls.append(Call(args, kwargs, out))
        return out

    setattr(owner, name, sampler)
    try:
        yield calls
    finally:
        if had_own:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def seeded_global_rng(generator: torch.Generator) -> Iterator[int]:
    """Run a sampler that draws from torch's global RNG (``torch.rand``, ``torch.randperm``
    without a generator) reproducibly from ``generator``: the global CPU RNG is seeded with a
    seed drawn from ``generator`` (one ``torch.randint`` draw, so successive blocks draw
    different anchors) and restored on exit (``torch.random.fork_rng``), so the audit's own
    random stream is untouched.

    Yields:
        The seed used.
    """
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield seed


def state_dict_entries(module: torch.nn.Module, frozen: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "dtype", "trainable"}}`` of ``module``'s state dict (trainable: a
    parameter with ``requires_grad``; buffers are not) plus ``frozen`` -- the verifier tensors
    the framework uses under the reference's names (``embed_tokens.weight``,
    ``lm_head.weight``, ...), trainable as their ``requires_grad`` says: what the structure
    check compares (:func:`dflash_audit.candidate.side_outputs` writes ours the same way)."""
    params = dict(module.named_parameters())
    tensors = {k: (v, bool(params[k].requires_grad) if k in params else False)
               for k, v in module.state_dict().items()}
    tensors.update({k: (t, bool(t.requires_grad)) for k, t in (frozen or {}).items()})
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                "trainable": trainable} for k, (t, trainable) in tensors.items()}
