"""Property tests of the drafter's pieces (no reference needed): mask rules, anchors,
target shift, loss weights, config validation."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_audit.limits import limit_s
from dflash_audit.model.anchors import check_anchors, select_anchors
from dflash_audit.model.config import (
    ConfigError,
    DFlashConfig,
    default_target_layer_ids,
)
from dflash_audit.model.drafter import DFlashDrafter, block_indices
from dflash_audit.model.loss import (
    LossSpec,
    dflash_loss,
    dpace_weights,
    exp_decay_weights,
)
from dflash_audit.model.mask import dense_mask

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, num_hidden_layers=1, vocab_size=50, num_verifier_layers=4,
            target_layer_ids=(1, 3), mask_token_id=49)


@st.composite
def packed_rows(draw):
    """(document_ids [1,T], loss_mask [1,T], block_size, max_anchors, window)."""
    block_size = draw(st.integers(2, 8))
    lengths = draw(st.lists(st.integers(1, 24), min_size=1, max_size=4))
    pad = draw(st.integers(0, 6))
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    T = doc.numel()
    bits = draw(st.lists(st.booleans(), min_size=T, max_size=T))
    loss_mask = torch.tensor(bits, dtype=torch.long) * (doc >= 0)
    window = draw(st.one_of(st.none(), st.integers(1, 30)))
    return doc[None], loss_mask[None], block_size, draw(st.integers(1, 12)), window


@settings(max_examples=150, deadline=None)
@given(packed_rows(), st.booleans(), st.integers(0, 2**31 - 1))
def test_mask_rules(row, non_causal, seed):
    doc, loss_mask, B, A, W = row
    anchors, _ = select_anchors(loss_mask, A, B, torch.Generator().manual_seed(seed))
    mask = dense_mask(doc, anchors, B, W, non_causal)
    T, Q = doc.shape[1], A * B
    assert mask.shape == (Q, T + Q)
    causal = W is not None and not non_causal
    for q in range(Q):
        j, s, a = q // B, q % B, int(anchors[q // B])
        base, block = mask[q, :T], mask[q, T:]
        # its own block (causal: itself and earlier slots), never another block
        own = torch.zeros(Q, dtype=torch.bool)
        own[j * B: j * B + (s + 1 if causal else B)] = True
        assert torch.equal(block, own)
        seen = base.nonzero().flatten()
        if seen.numel():
            assert int(seen.max()) < a  # no base key at or after its anchor
            assert bool((doc[0, seen] == doc[0, a]).all())  # no key from another document
            assert int(doc[0, a]) != -1
            if W is not None:
                assert int(seen.min()) >= a - W  # the window bound
        # everything the rules allow is visible
        allowed = (doc[0] == doc[0, a]) & (doc[0, a] != -1) & (torch.arange(T) < a)
        if W is not None:
            allowed &= torch.arange(T) >= a - W
        assert torch.equal(base, allowed)


@settings(max_examples=60, deadline=None)
@given(packed_rows(), st.integers(0, 2**31 - 1), st.booleans())
def test_anchor_selection(row, seed, sample_from_anchor):
    doc, loss_mask, B, A, _ = row
    g = torch.Generator().manual_seed(seed)
    anchors, valid = select_anchors(loss_mask, A, B, g)
    T = loss_mask.shape[1]
    allowed = loss_mask[0].bool().clone()
    allowed[-B:] = False
    k = int(valid.sum())
    assert k == min(A, int(allowed.sum()))
    assert bool(valid[:k].all()) and not bool(valid[k:].any())
    assert bool(allowed[anchors[:k]].all())
    assert torch.equal(anchors[:k], anchors[:k].sort().values)
    assert anchors[:k].unique().numel() == k  # without replacement
    assert bool((anchors[k:] == 0).all())
    check_anchors(anchors, valid, loss_mask, B)  # accepted as injected anchors
    assert T >= 1
    # same generator seed, same anchors
    again, _ = select_anchors(loss_mask, A, B, torch.Generator().manual_seed(seed))
    assert torch.equal(anchors, again)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1), st.booleans())
def test_targets_are_shifted_by_exactly_one(block_size, seed, sample_from_anchor):
    """Slot s of the block at anchor a is taught by the verifier's output at a + s - 1
    (a + s with sample_from_anchor)."""
    config = DFlashConfig(**{**TINY, "block_size": block_size,
                             "sample_from_anchor": sample_from_anchor})
    torch.manual_seed(seed % 1000)
    model = DFlashDrafter(config)
    T = 20
    states = torch.randn(1, T, config.hidden_size)
    anchors = torch.randint(1, T - block_size, (3,))
    idx = block_indices(anchors, block_size)
    targets = model.targets(states, idx)
    shift = 0 if sample_from_anchor else 1
    for q, i in enumerate(idx.tolist()):
        expected = model.verifier_lm_head(model.verifier_norm(states[:, i - shift]))
        torch.testing.assert_close(targets[:, q], expected)


def test_decay_weights_gamma4_block8():
    w = exp_decay_weights(8, 4.0)
    expected = [0, 1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231]
    assert w.tolist() == pytest.approx(expected, abs=5e-5)
    assert exp_decay_weights(4, 4.0, sample_from_anchor=True).tolist() == pytest.approx(
        [1, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)])


def test_loss_denominator_counts_tokens_not_weights():
    """L = sum(l*m*w) / (sum(m) + 1e-5): with identical per-token losses l, L = l * mean(w)."""
    B = 4
    logits = torch.zeros(1, 2 * B, 5)
    targets = torch.zeros(1, 2 * B, 5)
    targets[..., 0] = 3.0  # same soft target everywhere -> same KL per slot
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.float)
    res = dflash_loss(logits, targets, mask, B, LossSpec("kl_div", gamma=4.0))
    per_token = float(res.terms["kl_div"]) / float(
        (exp_decay_weights(B, 4.0).repeat(2) * mask[0]).sum() / mask.sum())
    kl = float(torch.nn.functional.kl_div(torch.log_softmax(logits[0, 0], -1),
                                          torch.softmax(targets[0, 0], -1), reduction="sum"))
    assert per_token == pytest.approx(kl, rel=1e-4)


def test_dpace_weights_hand_computed():
    """One block of 4, slot 0 masked: c = (1-a) e^-l + a; w_s = sum_{t>=s} prod_{u<=t} c_u."""
    loss = torch.tensor([[0.0, math.log(2), 0.0, math.log(4)]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    w = dpace_weights(loss * mask, mask, 4, alpha=0.5)
    c1, c2, c3 = 0.5 * 0.5 + 0.5, 1.0, 0.5 * 0.25 + 0.5
    p1, p2, p3 = c1, c1 * c2, c1 * c2 * c3
    assert w[0].tolist() == pytest.approx([0.0, p1 + p2 + p3, p2 + p3, p3])


@pytest.mark.parametrize("change, field", [
    ({"target_layer_ids": ()}, "target_layer_ids"),
    ({"target_layer_ids": (1, 1)}, "target_layer_ids"),
    ({"target_layer_ids": (1, 9)}, "target_layer_ids"),
    ({"target_layer_ids": (-1, 2)}, "target_layer_ids"),
    ({"target_layer_ids": (3, 1)}, "target_layer_ids"),
    ({"block_size": 1}, "block_size"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"mask_token_id": 50}, "mask_token_id"),
    ({"draft_vocab_size": 60}, "draft_vocab_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"layer_types": ("sliding_attention",)}, "sliding_window"),
    ({"layer_types": ("full_attention", "full_attention")}, "layer_types"),
    ({"layer_types": ("local",)}, "layer_types"),
])
def test_invalid_config_names_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        DFlashConfig(**{**TINY, **change})


def test_default_target_layers():
    assert default_target_layer_ids(30, "speculators") == [2, 15, 27]
    ids = default_target_layer_ids(30, "zlab")
    assert ids == [2, 9, 15, 21, 28]  # z-lab [1, 8, 14, 20, 27], offset by one
    assert default_target_layer_ids(64, "zlab")[-1] == 62
    with pytest.raises(ConfigError):
        default_target_layer_ids(30, "nope")


def test_fc_reads_all_target_layers_and_rejects_a_subset():
    config = DFlashConfig(**{**TINY, "num_verifier_layers": 8, "target_layer_ids": (1, 3, 5, 7)})
    model = DFlashDrafter(config)
    assert (model.fc.in_features, model.fc.out_features) == (4 * 16, 16)
    with pytest.raises(ValueError, match="4 target layers"):
        model.context(torch.randn(1, 5, 3 * 16))


def test_frozen_and_trainable_parameters():
    model = DFlashDrafter(DFlashConfig(**{**TINY, "draft_vocab_size": 20}))
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                      "verifier_norm.weight"]
    assert model.lm_head.weight.shape == (20, 16) and model.t2d.shape == (50,)
    assert model.d2t.shape == (20,)


def test_a_replayed_drafter_is_the_drafter_holding_the_same_weights(monkeypatch):
    """The diagnosis's replays build our drafter on the meta device without its random
    initialisation (``initialize=False``: reset_parameters is never called), then take the
    case's weights: the same logits and the same trainable parameters as the drafter that
    holds those weights."""
    from dflash_audit.audit.replay.replay import drafter_with_weights

    config = DFlashConfig(**TINY, block_size=4)
    torch.manual_seed(0)
    model = DFlashDrafter(config)

    def initialised(*args, **kwargs):
        raise AssertionError("a replay's drafter was randomly initialised")

    monkeypatch.setattr(DFlashDrafter, "reset_parameters", initialised)
    replayed = drafter_with_weights(config, model.state_dict())
    assert set(replayed.trainable_parameters()) == set(model.trainable_parameters())
    assert not replayed.embed_tokens.weight.requires_grad
    torch.manual_seed(1)
    T = 12
    inputs = dict(hidden_states=torch.randn(1, T, 2 * 16), input_ids=torch.randint(0, 49, (1, T)),
                  loss_mask=torch.ones(1, T, dtype=torch.long),
                  verifier_last_hidden_states=torch.randn(1, T, 16),
                  document_ids=torch.zeros(1, T, dtype=torch.long),
                  position_ids=torch.arange(T)[None], anchor_positions=torch.tensor([2, 6]),
                  anchor_valid=torch.tensor([True, True]))
    with torch.no_grad():
        torch.testing.assert_close(replayed(**inputs).logits, model(**inputs).logits,
                                   rtol=0, atol=0)


def test_our_candidate_loads_the_case_weights_into_an_uninitialised_drafter(monkeypatch):
    """DrafterCandidate.run_case builds our drafter without its random draw (every weight is
    loaded next): the same outputs as a drafter built, initialised, then loaded; a subclass's
    own ``build`` is still what runs (the examples' bugs live there)."""
    from dflash_audit.audit.cases.synthetic import synthetic_case
    from dflash_audit.candidate import DrafterCandidate
    from dflash_audit.model.loss import LossSpec

    config = DFlashConfig(**TINY, block_size=4)
    case = synthetic_case("c", config, LossSpec(), seed=3, seq_len=24, max_anchors=3)
    built = []

    class Subclass(DrafterCandidate):
        def build(self, config):
            built.append(config)
            return super().build(config)

    def draw(*args, **kwargs):
        raise AssertionError("our candidate's drafter was randomly initialised")

    with monkeypatch.context() as m:
        m.setattr(DFlashDrafter, "reset_parameters", draw)
        ours = DrafterCandidate().run_case(case.config, case.loss, case.weights, case.inputs)
    theirs = Subclass().run_case(case.config, case.loss, case.weights, case.inputs)
    assert built == [case.config]
    instance = DrafterCandidate()  # a build set on the object (a factory's candidate) runs too
    instance.build = lambda config: built.append(config) or DFlashDrafter(config)
    instance.run_case(case.config, case.loss, case.weights, case.inputs)
    assert built == [case.config] * 2
    assert ours.tensors.keys() == theirs.tensors.keys()
    for name, tensor in ours.tensors.items():
        torch.testing.assert_close(tensor, theirs.tensors[name], rtol=0, atol=0, msg=name)
    assert ours.metrics == theirs.metrics


def test_a_replays_drafter_imports_neither_transformers_activations_nor_dynamo(tmp_path):
    """A silu drafter built on the meta device (as every replay is) imports neither
    transformers.activations nor torch._dynamo (~2 s of a failing audit's checks), and its
    RoPE frequencies, computed on the CPU, are the CPU-built drafter's (a fresh process: the
    suite has imported both long before)."""
    script = tmp_path / "build.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, torch
        from dflash_audit.model.config import DFlashConfig
        from dflash_audit.model.drafter import DFlashDrafter
        from dflash_audit.model.layers import RotaryEmbedding
        config = DFlashConfig(**{TINY!r}, block_size=4, hidden_act="silu")
        with torch.device("meta"):
            meta = DFlashDrafter(config, initialize=False)
        assert meta.rotary_emb.inv_freq.device.type == "meta"
        cpu = RotaryEmbedding(config).inv_freq
        assert meta.rotary_emb.inv_freq.shape == cpu.shape
        with torch.device("meta"):
            again = RotaryEmbedding(config)
        assert again.attention_scaling == RotaryEmbedding(config).attention_scaling
        print(sorted(m for m in ("transformers.activations", "torch._dynamo")
                     if m in sys.modules))
        """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=limit_s(120), cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["silu", "swish", "gelu_pytorch_tanh", "relu"])
def test_the_activation_is_transformers_one(name):
    """``silu`` / ``swish`` are built without importing transformers.activations, every other
    name through its ACT2FN: the same values as ACT2FN gives for each."""
    from transformers.activations import ACT2FN

    from dflash_audit.model.layers import activation

    x = torch.randn(64, dtype=torch.float64) * 4
    torch.testing.assert_close(activation(name)(x), ACT2FN[name](x), rtol=0, atol=0)
