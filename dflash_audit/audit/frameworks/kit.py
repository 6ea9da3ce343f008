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
  built drafter plus the frozen verifier tensors it uses;
* :func:`record_locals` -- the named locals of a framework function, read from its own frame
  when it returns (a loss helper's per-token weights that it never returns);
* :func:`framework_structure` -- the structure check's summary of the drafter the framework
  built, from the framework's own facts (never the profile's: a framework whose layers all
  share one windowed, always-bidirectional mask must say so, not echo the profile);
* :func:`packing_metadata` -- a packed row's ``document_ids`` as the packing metadata
  frameworks take (``seq_lens``, ``cu_seqlens``, ``doc_remaining``);
* :func:`qwen3_draft_config` -- the case's drafter geometry as the ``Qwen3Config`` most
  frameworks build their draft from;
* :func:`.light_import.skip_package_inits` -- import a framework's DFlash modules without the heavy
  ``__init__`` of the packages around them (NeMo's ``speculative.dflash`` imports every
  drafter family, models and distributed code);
* :class:`NotSupported` / :func:`refuse_unsupported` -- "not supported by NAME VERSION: ..."
  for a case (``run_case``) or a verifier (``derive_config``: the derivation check reports it
  as a warning, not a failure) the framework cannot express.

For ``derive_config``, :func:`derivation_record` gives the record of a framework's draft
config; :mod:`dflash_audit.model.derivation` has its builders:
``architecture_fields(cfg)`` (head geometry, eps, activation, bias, positions of any config
object), ``rope_fields(rope_parameters, rotary_module)`` (theta, type, partial factor, scaling,
the rotary dim and attention scaling the module really applies) and ``SAVED_KEYS`` (the
``saved.<key>`` fields: what the framework writes into the drafter's ``config.json``).

Every recorder is a context manager that restores what it changed on exit, also when the
framework raises. ``examples/frameworks/toy_framework_adapter.py`` wraps a tiny framework with
them; :mod:`dflash_audit.audit.frameworks.zlab_adapter` uses them on z-lab's code.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# the kit's builders of a framework's inputs live in kit_build (kit's line budget); one import
from dflash_audit.audit.frameworks.kit_build import (  # noqa: F401
    frozen_embedding_and_head,
    packing_metadata,
    qwen3_draft_config,
)


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


class NotSupported(ValueError):
    """A case or verifier the framework cannot express (its message starts "not supported by
    NAME VERSION:" and says why). Raised by ``derive_config`` it makes the derivation check a
    warning naming the limit, not a failure; raised by ``run_case`` it guards a case given to
    the adapter directly (the planner never sends one outside ``CAPABILITIES``)."""


def refuse_unsupported(capabilities: dict[str, Any], label: str, config: Any,
                       inputs: dict[str, torch.Tensor], loss: Any = None,
                       dtype: str = "fp32") -> None:
    """Raise :class:`NotSupported` when a case is outside an adapter's ``CAPABILITIES`` (the
    planner's own rule, :meth:`.capabilities.Capabilities.unsupported`).

    Raises:
        NotSupported: "not supported by <label>: <reasons>".
    """
    from types import SimpleNamespace

    from dflash_audit.audit.frameworks.capabilities import Capabilities

    case = SimpleNamespace(config=config, inputs=inputs, weights={}, dtype=dtype,
                           loss=loss or SimpleNamespace(loss="ce-data", weighting="none"))
    why = Capabilities.from_dict(capabilities).unsupported(case)
    if why:
        raise NotSupported(f"not supported by {label}: {'; '.join(why)}")


@contextlib.contextmanager
def record_locals(function: Any, names: Iterable[str]) -> Iterator[list[dict[str, Any]]]:
    """Inside the block, every time ``function`` (a function, method or code object) returns,
    its locals named in ``names`` are recorded as they are at its return (``sys.setprofile``
    on this thread; the function is not changed, the previous profiler is restored on exit).
    Use it for what a framework computes inside a function and does not return (the per-token
    weights a loss helper multiplies with, ModelOpt's ``_compute_loss`` teacher logits).

    Yields:
        The list of records, one ``{name: value}`` per return (a name the frame does not hold
        is absent), in call order.
    """
    code = getattr(getattr(function, "__func__", function), "__code__", function)
    wanted, records = tuple(names), []
    previous = sys.getprofile()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is code:
            local = frame.f_locals
            records.append({k: local[k] for k in wanted if k in local})

    sys.setprofile(profile)
    try:
        yield records
    finally:
        sys.setprofile(previous)


def framework_structure(draft: torch.nn.Module, frozen: dict[str, torch.Tensor] | None, *,
                        target_layer_ids: list[int], block_size: int, mask_token_id: int | None,
                        layer_types: list[str], sliding_window: int | None,
                        sliding_window_non_causal: bool, sample_from_anchor: bool = False
                        ) -> dict[str, Any]:
    """The ``structure`` output for the drafter a framework built: ``fc`` in / out features
    and the state dict (:func:`state_dict_entries`) read from ``draft``, every other fact
    given by the adapter as the framework runs it -- ids in the speculators convention, the
    layer types and window its masks apply (all ``sliding_attention`` when one windowed mask
    serves every layer), and ``sliding_window_non_causal`` True where the block is
    bidirectional under a window. Keyword-only and without defaults from a profile, so an
    adapter cannot report the profile's layout for the framework's."""
    return {"fc_in_features": draft.fc.in_features, "fc_out_features": draft.fc.out_features,
            "target_layer_ids": [int(i) for i in target_layer_ids],
            "block_size": int(block_size), "mask_token_id": mask_token_id,
            "layer_types": list(layer_types), "sliding_window": sliding_window,
            "sliding_window_non_causal": bool(sliding_window_non_causal),
            "sample_from_anchor": bool(sample_from_anchor),
            "state_dict": state_dict_entries(draft, frozen)}


def sampled_anchors(sample: Callable[[], tuple[torch.Tensor, torch.Tensor]], max_anchors: int,
                    generator: torch.Generator, no_anchor: tuple[type, ...] | type = ()
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_anchors`` from a framework's own sampler: ``sample()`` (its method called on a
    stand-in ``self``) runs under :func:`seeded_global_rng` and returns its anchors and keep
    mask ([n] or [1, n]); an exception of ``no_anchor`` (its "no valid anchor" error) gives
    none. Returns (anchor_positions [A] long, anchor_valid [A] bool), A = ``max_anchors``:
    the framework's first min(n, A) slots, then padding (0, False)."""
    with seeded_global_rng(generator):
        try:
            anchors, keep = sample()
        except no_anchor:
            anchors, keep = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)
    positions = torch.zeros(max_anchors, dtype=torch.long, device=anchors.device)
    valid = torch.zeros(max_anchors, dtype=torch.bool, device=anchors.device)
    n = min(max_anchors, anchors.reshape(-1).numel())
    positions[:n], valid[:n] = anchors.reshape(-1)[:n].long(), keep.reshape(-1)[:n].bool()
    return positions, valid


def signature_defaults(function: Callable[..., Any], **names: str) -> dict[str, Any]:
    """``{key: default of parameter names[key]}`` of ``function``'s signature (a framework's
    own defaults for the ``defaults`` check: ``block_size="block_size", gamma="loss_gamma"``);
    with ``gamma`` also ``weighting`` (``none`` for a None gamma, else ``fixed-exp-decay``)."""
    import inspect

    params = inspect.signature(function).parameters
    out = {key: params[name].default for key, name in names.items()}
    if "gamma" in out:
        out["weighting"] = "none" if out["gamma"] is None else "fixed-exp-decay"
    return out


def derivation_record(cfg: Any, rotary: Any, saved: dict[str, Any] | None = None,
                      **fields: Any) -> dict[str, Any]:
    """The ``derive_config`` record of a framework's draft config ``cfg`` (a transformers
    config) and the rotary module its draft builds from it: the architecture fields, vocab,
    ``tie_word_embeddings``, ``layer_types`` and ``sliding_window`` (None without a sliding
    layer), the RoPE fields it really applies, ``saved.<key>`` for every key of
    :data:`~dflash_audit.model.derivation.SAVED_KEYS` in ``saved`` (what the framework writes
    into the drafter's ``config.json``), then ``fields`` (``default_target_layer_ids`` in
    the speculators convention, ``mask_token_id``, ...)."""
    from dflash_audit.model.derivation import SAVED_KEYS, architecture_fields, rope_fields

    types = list(getattr(cfg, "layer_types", None) or [])
    return {**architecture_fields(cfg), "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "layer_types": types, "sliding_window": getattr(cfg, "sliding_window", None)
            if "sliding_attention" in types else None,
            **rope_fields(dict(cfg.rope_parameters or {}), rotary),
            **({f"saved.{k}": saved.get(k) for k in SAVED_KEYS} if saved is not None else {}),
            **fields}
