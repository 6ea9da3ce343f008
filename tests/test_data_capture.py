"""Hook capture vs Hugging Face ``output_hidden_states``: layer-id convention, pre-norm last
layer (the double-norm trap), per-document isolation, and layer-id validation."""

from __future__ import annotations

import pytest
import torch
from data_support import make_tiny_verifier, smollm2

from dflash_audit.data.capture import capture_row
from dflash_audit.data.errors import LayerIdError
from dflash_audit.data.verifier import load_verifier
from dflash_audit.model.layer_ids import resolve_target_layer_ids


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_verifier(tmp_path_factory.mktemp(f"tiny-{request.param}"),
                                family=request.param, layers=6)
    return load_verifier(str(folder))


@pytest.fixture(scope="session")
def smol():
    return smollm2()


def _hf_states(model, ids: torch.Tensor, tie_last: bool = True) -> tuple[torch.Tensor, ...]:
    """HF hidden states of one un-packed sequence; with ``tie_last=False`` the last entry is
    the last layer's output before the final norm (HF's own switch, independent of our hooks)."""
    had, old = hasattr(model.config, "tie_last_hidden_states"), getattr(
        model.config, "tie_last_hidden_states", None)
    model.config.tie_last_hidden_states = tie_last
    try:
        with torch.no_grad():
            return model(ids, output_hidden_states=True).hidden_states
    finally:  # leave the (shared) config exactly as it was
        if had:
            model.config.tie_last_hidden_states = old
        else:
            delattr(model.config, "tie_last_hidden_states")


def _check_against_hf(verifier, ids: torch.Tensor, layer_ids: list[int]) -> None:
    """One document: every captured slice equals HF ``hidden_states[L]``; the last state equals
    HF's pre-norm last layer, and HF's default ``hidden_states[-1]`` is norm(last)."""
    T, H, N = ids.shape[1], verifier.hidden_size, verifier.num_layers
    document_ids = torch.zeros(1, T, dtype=torch.long)
    hidden, last = capture_row(verifier.model, ids, document_ids, layer_ids)
    assert hidden.shape == (1, T, len(layer_ids) * H) and hidden.dtype == torch.float32
    assert last.shape == (1, T, H) and last.dtype == torch.float32
    hf = _hf_states(verifier.model, ids)
    assert len(hf) == N + 1
    for j, layer in enumerate(layer_ids):
        torch.testing.assert_close(hidden[..., j * H:(j + 1) * H], hf[layer], rtol=0, atol=0)
    pre_norm = _hf_states(verifier.model, ids, tie_last=False)[-1]
    torch.testing.assert_close(last, pre_norm, rtol=0, atol=0)
    # the double-norm trap: HF's hidden_states[-1] is AFTER the final norm
    final_norm = verifier.model.get_decoder().norm
    with torch.no_grad():
        torch.testing.assert_close(hf[-1], final_norm(last), rtol=1e-6, atol=1e-6)
    assert (hf[-1] - last).abs().max() > 1e-2, "post-norm and pre-norm states must differ"


def test_tiny_capture_matches_hf_for_every_layer(tiny):
    N = tiny.num_layers
    ids = torch.randint(4, 260, (1, 37), generator=torch.Generator().manual_seed(1))
    _check_against_hf(tiny, ids, list(range(N)))  # every id 0..N-1, embeddings included


def test_smollm2_capture_matches_hf(smol):
    ids = smol.tokenizer("<|im_start|>user\nHow are you doing today?<|im_end|>\n",
                         add_special_tokens=False, return_tensors="pt")["input_ids"]
    layer_ids = sorted({0, 1, 2, 15, 27, 29} | set(resolve_target_layer_ids(30)))
    _check_against_hf(smol, ids, layer_ids)
    assert smol.num_layers == 30 and smol.hidden_size == 576


def test_packed_documents_are_isolated(tiny):
    """A packed row = each document run alone with positions from 0; padding stays zero."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(4, 260, (1, 11), generator=g), torch.randint(4, 260, (1, 7), generator=g)
    T, H = 24, tiny.hidden_size
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[0, :11], ids[0, 11:18] = a[0], b[0]
    docs = torch.tensor([[0] * 11 + [1] * 7 + [-1] * 6])
    layer_ids = [1, 3]
    hidden, last = capture_row(tiny.model, ids, docs, layer_ids)
    for doc, (s, e) in ((a, (0, 11)), (b, (11, 18))):
        hf = _hf_states(tiny.model, doc)
        for j, layer in enumerate(layer_ids):
            torch.testing.assert_close(hidden[0, s:e, j * H:(j + 1) * H], hf[layer][0],
                                       rtol=0, atol=0)
        torch.testing.assert_close(last[0, s:e], _hf_states(tiny.model, doc, False)[-1][0],
                                   rtol=0, atol=0)
    assert hidden[0, 18:].abs().sum() == 0 and last[0, 18:].abs().sum() == 0
    # sensitivity: a forward over the concatenation (cross-document attention) differs
    joint = _hf_states(tiny.model, ids[:, :18])
    assert (joint[3][0, 11:18] - hidden[0, 11:18, H:2 * H]).abs().max() > 1e-3


def test_default_and_named_layer_ids():
    assert resolve_target_layer_ids(30, "speculators") == [2, 15, 27]
    zlab = resolve_target_layer_ids(30)
    assert zlab == resolve_target_layer_ids(30, "zlab") and len(zlab) == 5
    assert zlab == sorted(zlab) and max(zlab) < 30
    assert resolve_target_layer_ids(30, "1, 5,9") == [1, 5, 9]
    assert resolve_target_layer_ids(30, [9, 1, 5]) == [1, 5, 9]  # ascending


def test_zlab_ids_are_shifted_by_one():
    assert resolve_target_layer_ids(30, [1, 8, 15], zlab_ids=True) == [2, 9, 16]
    assert resolve_target_layer_ids(30, "0,28", zlab_ids=True) == [1, 29]
    # z-lab 29 becomes 30 = the last layer's output before the final norm, which the
    # reference accepts (ids in [0, N]); 30 becomes 31, which no verifier layer gives
    assert resolve_target_layer_ids(30, [29], zlab_ids=True) == [30]
    with pytest.raises(LayerIdError, match="z-lab ids"):
        resolve_target_layer_ids(30, [30], zlab_ids=True)
    with pytest.raises(LayerIdError, match="explicit ids only"):
        resolve_target_layer_ids(30, "zlab", zlab_ids=True)


@pytest.mark.parametrize("ids, message", [
    ([-1, 3], "negative"),
    ([1, 31], "out of range"),
    ([1, 31], r"\[0, 30\]"),
    ([2, 2, 5], "duplicated"),
    ([], "empty"),
    ("1,x", "comma list"),
    ("deepest", "comma list"),
])
def test_invalid_layer_ids_raise(ids, message):
    with pytest.raises(LayerIdError, match=message):
        resolve_target_layer_ids(30, ids)
