"""Recompute every verifier layer's output for a row, and the noise that sets the tolerances.

Layer ids (HF ``output_hidden_states`` semantics, speculators convention): id ``L < N`` is the
residual stream after L decoder layers (0 = embeddings), id ``N`` the last layer's output
*before* the final norm, and one more candidate, ``post-norm`` = ``norm(id N)`` = HF's
``hidden_states[-1]``. Each document is a separate forward with positions ``0..len-1`` (as
:func:`dflash_audit.data.capture.capture_row` and the reference's per-conversation samples):
the plan :data:`PER_DOCUMENT`. Two other plans recompute what a wrong capture computed, one
causal forward over the packed row's documents (:func:`forward_plan`): :data:`PACKED_CONTINUE`
(positions counting on across the row, a plain ``model(input_ids=row)``) and
:data:`PACKED_RESTART` (per-document positions, one causal mask over the row); both pass an
explicit all-ones ``attention_mask``, so transformers does not infer a per-document mask from
restarting positions (``masking_utils.find_packed_sequence_indices``).

Distance: the mean over tokens of ``||x_t - r_t|| / ||r_t||`` (per-token relative error, so the
first token's massive activations do not swamp the rest).

Tolerances (measured, not guessed): the files' precision ``p`` is the stored dtype, or
bfloat16 / float16 when every float32 value survives a round trip through it (a low-precision
capture saved as float32). Once per run, the first checked row (its first ``NOISE_TOKENS``
tokens) is recomputed in float32 and in bfloat16 (float16 for fp16 files); ``noise[L]`` =
distance(bf16 recompute, fp32 recompute) at layer L is the spread two correct captures can
have at that layer. The tolerance is
``NOISE_FACTOR * noise[L]`` (at least ``MIN_TOLERANCE``) and the files are compared with the
recompute in their own precision. A float32 file is held to the same bf16-derived tolerance:
TF32 matmuls or another attention kernel on a GPU stay well inside it, and a difference below
a bf16 capture's cannot change training more than a bf16 capture does. Measured on SmolLM2-135M
(30 layers, chitchat, T=256): noise 0.14 % (embeddings) to 2 % (last layer, post-norm), so
tolerances 0.6-8 %, while adjacent layers are >= 23 % apart (post-norm vs the last layer:
1800 %): the layer a slice equals is unambiguous.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_audit.data.capture import LayerCapture
from dflash_audit.data.verifier import Verifier

NOISE_FACTOR = 4.0
MIN_TOLERANCE = 1e-3
NOISE_TOKENS = 128
POST_NORM = "post-norm"
PER_DOCUMENT = "per document"
PACKED_CONTINUE = "packed row, positions counting on"
PACKED_RESTART = "packed row, positions restarting per document"


def forward_plan(documents: Sequence[tuple[int, int]], plan: str = PER_DOCUMENT
                 ) -> list[tuple[int, int, torch.Tensor, bool]]:
    """The forwards of a capture plan: ``(start, end, position_ids int64 [end - start], one
    causal mask over the span)`` each. The packed plans span the first document's start to
    the last one's end and need contiguous documents.

    Raises:
        ValueError: an unknown plan, or a packed plan over documents with gaps between them.
    """
    if plan == PER_DOCUMENT:
        return [(s, e, torch.arange(e - s), False) for s, e in documents]
    if plan not in (PACKED_CONTINUE, PACKED_RESTART):
        raise ValueError(f"unknown capture plan {plan!r}")
    if any(e != s for (_, e), (s, _) in zip(documents, documents[1:])):
        raise ValueError(f"documents {list(documents)} are not contiguous: no packed forward")
    start, end = documents[0][0], documents[-1][1]
    positions = torch.arange(end - start) if plan == PACKED_CONTINUE else torch.cat(
        [torch.arange(e - s) for s, e in documents])
    return [(start, end, positions, True)]


def file_precision(t: torch.Tensor) -> torch.dtype:
    """The precision a capture was made in: the stored dtype, or bfloat16 / float16 when a
    float32 tensor is exactly representable in it; float32 for a tensor that is not floating
    point (the layers check names its dtype)."""
    if not t.is_floating_point():
        return torch.float32
    if t.dtype != torch.float32:
        return t.dtype
    for low in (torch.bfloat16, torch.float16):
        if torch.equal(t.to(low).float(), t):
            return low
    return torch.float32


def token_distance(x: torch.Tensor, r: torch.Tensor) -> float:
    """Mean over tokens of ``||x_t - r_t|| / ||r_t||``; ``x``, ``r`` ``[t, H]`` (any float
    dtype, compared in float32). 0.0 for no tokens."""
    if x.shape[0] == 0:
        return 0.0
    x, r = x.float(), r.float()
    return float(((x - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)).mean())


@dataclass
class LayerStates:
    """``states`` float32 ``[N+2, T, H]``: ids 0..N then post-norm, recomputed in ``dtype``;
    ``tolerance[c]`` for each of the N+2 candidates; ``noise[c]`` the measured spread."""

    states: torch.Tensor
    dtype: torch.dtype
    noise: list[float]
    tolerance: list[float]

    @property
    def num_layers(self) -> int:
        """N."""
        return self.states.shape[0] - 2

    def label(self, c: int) -> str:
        """``"layer 12"`` or ``"post-norm"`` for candidate index ``c``."""
        return POST_NORM if c == self.num_layers + 1 else f"layer {c}"

    def closest(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[int, list[float]]:
        """Index of the candidate closest to ``x`` ``[T, H]`` on the bool ``tokens`` mask
        ``[T]``, and the distances (:func:`token_distance`) to all N+2 candidates."""
        dist = [token_distance(x[tokens], self.states[c][tokens])
                for c in range(self.states.shape[0])]
        return min(range(len(dist)), key=dist.__getitem__), dist


class Recomputer:
    """Recomputes layer states with a loaded :class:`Verifier` in float32 and low precision.

    The low-precision copy of the model and the measured noise are kept in the verifier's
    cache, so several runs with one loaded verifier pay for them once."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self._models: dict[torch.dtype, torch.nn.Module] = verifier._cache.setdefault(
            "batch_audit_models", {torch.float32: verifier.model})
        self._noise: dict[torch.dtype, list[float]] = verifier._cache.setdefault(
            "batch_audit_noise", {})

    def _model(self, dtype: torch.dtype) -> torch.nn.Module:
        if dtype not in self._models:
            self._models[dtype] = copy.deepcopy(self.verifier.model).to(dtype)
        return self._models[dtype]

    @torch.inference_mode()
    def states(self, input_ids: torch.Tensor, documents: Sequence[tuple[int, int]],
               dtype: torch.dtype, plan: str = PER_DOCUMENT) -> torch.Tensor:
        """float32 ``[N+2, T, H]`` of ``input_ids`` int64 ``[T]`` computed in ``dtype``;
        zero outside ``documents`` (``[start, end)`` each; one forward per document, or one
        over the row for a packed ``plan``, :func:`forward_plan`)."""
        model = self._model(dtype)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        n, h, T = self.verifier.num_layers, self.verifier.hidden_size, input_ids.numel()
        out = torch.zeros(n + 2, T, h)
        with LayerCapture(model, list(range(n))) as cap:
            for s, e, positions, one_mask in forward_plan(documents, plan):
                mask = {"attention_mask": torch.ones(1, e - s, dtype=torch.long)} if one_mask \
                    else {}
                decoder(input_ids=input_ids[s:e].unsqueeze(0),
                        position_ids=positions.unsqueeze(0), use_cache=False, **mask)
                for layer in range(n):
                    out[layer, s:e] = cap.captured[layer][0].float()
                last = cap.captured["last"]
                out[n, s:e] = last[0].float()
                out[n + 1, s:e] = decoder.norm(last)[0].float()
                cap.captured.clear()
        return out

    def measure_noise(self, input_ids: torch.Tensor, documents: Sequence[tuple[int, int]],
                      precision: torch.dtype) -> list[float]:
        """``noise[c]`` for each of the N+2 candidates: distance(low-precision recompute,
        float32 recompute) on the first ``NOISE_TOKENS`` tokens of ``documents`` (measured
        once per run and reused: it depends on the layer, not on the row)."""
        low = precision if precision in (torch.bfloat16, torch.float16) else torch.bfloat16
        if low not in self._noise:
            docs, left = [], NOISE_TOKENS
            for s, e in documents:
                if left > 0:
                    docs.append((s, min(e, s + left)))
                    left -= docs[-1][1] - s
            full = self.states(input_ids, docs, torch.float32)
            lowp = self.states(input_ids, docs, low)
            mask = token_mask(input_ids.numel(), docs)
            self._noise[low] = [token_distance(lowp[c][mask], full[c][mask])
                                for c in range(full.shape[0])]
        return self._noise[low]

    def layer_states(self, input_ids: torch.Tensor, documents: Sequence[tuple[int, int]],
                     precision: torch.dtype, plan: str = PER_DOCUMENT) -> LayerStates:
        """Recompute in ``precision`` (float32 for float32 files) under capture ``plan`` with
        the measured noise and tolerance per candidate (see the module docstring)."""
        noise = self.measure_noise(input_ids, documents, precision)
        dtype = precision if precision in (torch.bfloat16, torch.float16) else torch.float32
        return LayerStates(states=self.states(input_ids, documents, dtype, plan),
                           dtype=precision, noise=noise,
                           tolerance=[max(NOISE_FACTOR * x, MIN_TOLERANCE) for x in noise])


def token_mask(T: int, documents: Sequence[tuple[int, int]]) -> torch.Tensor:
    """bool ``[T]``: True on the tokens of ``documents`` (``[start, end)`` each)."""
    mask = torch.zeros(T, dtype=torch.bool)
    for s, e in documents:
        mask[s:e] = True
    return mask
