"""Capture the verifier's hidden states with forward hooks on its decoder layers.

Layer ids follow the reference (speculators / vLLM): id ``L < N`` is the residual stream
after L decoder layers = the input of decoder layer L = HF ``output_hidden_states[L]``
(id 0 = the embeddings output). The last layer's output *before* the final norm is captured
separately as ``verifier_last_hidden_states``; HF's ``hidden_states[-1]`` is after the final
norm, and using it would norm twice downstream. z-lab ids are offset by one (z-lab id k =
our id k+1).

Only the requested layers are kept (no ``output_hidden_states`` copy of every layer), and
the base decoder runs without the LM head. Packed documents never attend across each
other: each document is a separate forward with its own positions 0..len-1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflash_audit.data.errors import LayerIdError

CONVENTION = "speculators: id L = HF output_hidden_states[L] (0 = embeddings); " \
             "verifier_last_hidden_states = last layer output before the final norm"


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder-layer ModuleList of a HF causal LM (``model.model.layers`` for Llama/Qwen).

    Raises:
        LayerIdError: the model exposes no ``layers`` list on its decoder.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise LayerIdError(f"{type(model).__name__}: cannot find the decoder layers "
                           "(expected model.get_decoder().layers)")
    return layers


class LayerCapture:
    """Context manager: hooks that record the residual stream at ``target_layer_ids`` and
    the last decoder layer's output (pre final norm) during one forward.

    After a forward, ``captured[L]`` holds ``[B, t, H]`` for every target id L < N and
    ``captured["last"]`` the last layer's output, which is also target id N's (the reference
    accepts ids in [0, N]; speculators 0.9.0 ``models/utils.py:99-140``). Hooks are removed on
    exit.
    """

    def __init__(self, model: Any, target_layer_ids: Sequence[int]):
        self.layers = decoder_layers(model)
        self.target_layer_ids = list(target_layer_ids)
        self.captured: dict[int | str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def _pre_hook(self, layer_id: int):
        def hook(_module, args, kwargs):
            self.captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _last_hook(self, _module, _args, output):
        self.captured["last"] = output[0] if isinstance(output, tuple) else output

    def __enter__(self) -> LayerCapture:
        for layer_id in self.target_layer_ids:  # input of layer L = after L layers
            if layer_id == len(self.layers):  # id N: the last layer's output, hooked below
                continue
            self._handles.append(self.layers[layer_id].register_forward_pre_hook(
                self._pre_hook(layer_id), with_kwargs=True))
        self._handles.append(self.layers[-1].register_forward_hook(self._last_hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@torch.inference_mode()
def capture_row(model: Any, input_ids: torch.Tensor, document_ids: torch.Tensor,
                target_layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of one packed row, one forward per document (no cross-document
    attention; positions restart at 0 in each document).

    Args:
        model: HF causal LM (fp32, eval).
        input_ids: ``[1, T]`` int64.
        document_ids: ``[1, T]`` int64, 0..k-1 per document, -1 on padding.
        target_layer_ids: ascending ids in our convention, in [0, N] (see
            :func:`dflash_audit.model.layer_ids.resolve_target_layer_ids`; id N is the
            last layer's output before the final norm, the same plane as
            ``verifier_last_hidden_states``).

    Returns:
        ``hidden_states`` float32 ``[1, T, n*H]`` (target layers concatenated in ascending
        id) and ``verifier_last_hidden_states`` float32 ``[1, T, H]`` (last layer, pre-norm);
        zero on padding positions.
    """
    ids = list(target_layer_ids)
    hidden = int(model.get_input_embeddings().weight.shape[1])
    seq_len = int(input_ids.shape[1])
    hidden_states = torch.zeros(1, seq_len, len(ids) * hidden, dtype=torch.float32)
    last = torch.zeros(1, seq_len, hidden, dtype=torch.float32)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    docs = document_ids[0]
    with LayerCapture(model, ids) as cap:
        for k in torch.unique(docs[docs >= 0]).tolist():
            pos = (docs == k).nonzero().flatten()
            start, end = int(pos[0]), int(pos[-1]) + 1
            doc_ids = input_ids[:, start:end]
            decoder(input_ids=doc_ids, position_ids=torch.arange(end - start).unsqueeze(0),
                    use_cache=False)
            for j, layer_id in enumerate(ids):
                plane = cap.captured["last" if layer_id == len(cap.layers) else layer_id]
                hidden_states[0, start:end, j * hidden:(j + 1) * hidden] = plane[0]
            last[0, start:end] = cap.captured["last"][0]
            cap.captured.clear()
    return hidden_states, last
