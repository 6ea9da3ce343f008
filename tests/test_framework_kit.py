"""The adapter kit (dflash_audit.audit.frameworks.kit): each recorder on real torch modules and
functions, restored afterwards; and the worked example that wraps a toy framework with it."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dflash_audit.audit.frameworks.kit import (
    inject_anchors,
    record_calls,
    record_outputs,
    seeded_global_rng,
    slot_weights_from_losses,
)
from dflash_audit.limits import limit_s

ROOT = Path(__file__).resolve().parents[1]


def _framework_module():
    """A module whose forward looks its mask builder up by global name at call time."""
    mod = types.ModuleType("toy_fw")
    exec(  # noqa: S102 - a tiny framework defined for the test
        "import torch\n"
        "def build_mask(n):\n    return torch.ones(n, n).tril().bool()\n"
        "def forward(n):\n    return build_mask(n).sum()\n", mod.__dict__)
    return mod


def test_record_calls_on_a_module_function_records_and_restores():
    mod = _framework_module()
    original = mod.build_mask
    with record_calls(mod, "build_mask") as calls:
        total = mod.forward(3)
    assert int(total) == 6  # the framework computed what it computes without the kit
    assert len(calls) == 1 and calls[0].args == (3,)
    assert torch.equal(calls[0].result, torch.ones(3, 3).tril().bool())
    assert mod.build_mask is original
    mod.forward(2)
    assert len(calls) == 1  # nothing recorded after the block


class Sampler:
    offset = 10

    def draw(self, n):
        return torch.arange(n) + self.offset

    @staticmethod
    def helper(x):
        return x * 2


def test_record_calls_on_a_class_keeps_methods_bound_and_static_methods_static():
    s = Sampler()
    with record_calls(Sampler, "draw") as draws, record_calls(Sampler, "helper") as helps:
        assert s.draw(2).tolist() == [10, 11]
        assert Sampler.helper(3) == 6 and s.helper(4) == 8
    assert [c.result.tolist() for c in draws] == [[10, 11]] and draws[0].args[0] is s
    assert [c.result for c in helps] == [6, 8]
    assert isinstance(vars(Sampler)["helper"], staticmethod)
    assert vars(Sampler)["draw"] is Sampler.__dict__["draw"] and s.draw(1).tolist() == [10]


def test_record_calls_on_one_object_and_a_missing_attribute():
    s, other = Sampler(), Sampler()
    with record_calls(s, "draw") as calls:
        s.draw(1)
        other.draw(1)
    assert len(calls) == 1 and "draw" not in vars(s)
    with pytest.raises(AttributeError, match="no_such_sampler"):
        with record_calls(s, "no_such_sampler"):
            pass


def test_record_outputs_hooks_a_module_and_removes_the_hook():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with record_outputs(lin) as outs:
        y = lin(x)
        lin(x[:1])
    assert len(outs) == 2 and torch.equal(outs[0], y) and outs[1].shape == (1, 3)
    lin(x)
    assert len(outs) == 2 and not lin._forward_hooks  # noqa: SLF001


def test_slot_weights_from_losses_divides_where_defined():
    loss = torch.tensor([[2.0, 4.0, 0.0, 1.0]])
    w = torch.tensor([[0.0, 1.0, 0.5, 0.25]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = slot_weights_from_losses(loss * w, loss, mask)
    # slot 2 has zero loss (weight unknowable), slot 3 is masked: both 0
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0]] and out.dtype == torch.float32
    assert slot_weights_from_losses((loss * w).reshape(2, 2), loss).tolist() == [
        [0.0, 1.0, 0.0, 0.25]]
    with pytest.raises(ValueError, match="same slots"):
        slot_weights_from_losses(torch.ones(3), torch.ones(4))


class Trainer:
    """A framework whose sampler lives inside forward (SpecForge style)."""

    def _sample_anchor_positions(self, seq_len, loss_mask):
        keep = loss_mask.bool()
        return torch.randperm(seq_len)[:2], keep[:2]

    def forward(self, loss_mask):
        anchors, keep = self._sample_anchor_positions(loss_mask.numel(), loss_mask)
        return anchors[keep].sum()


def test_inject_anchors_replaces_the_sampler_inside_forward():
    t, lm = Trainer(), torch.tensor([1, 1, 0, 1, 1])
    anchors, keep = torch.tensor([3, 1]), torch.tensor([True, True])
    with inject_anchors(t, "_sample_anchor_positions",
                        lambda seq_len, loss_mask: (anchors, keep)) as calls:
        assert int(t.forward(lm)) == 4
    assert len(calls) == 1 and calls[0].args[0] == 5 and torch.equal(calls[0].result[0], anchors)
    assert "_sample_anchor_positions" not in vars(t)  # the class's sampler is back
    with pytest.raises(AttributeError):
        with inject_anchors(t, "_no_sampler", lambda: None):
            pass


def test_seeded_global_rng_is_reproducible_and_leaves_the_global_stream_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        with seeded_global_rng(g) as seed:
            draws.append((seed, torch.randperm(10).tolist()))
    assert draws[0] == draws[1]  # same generator state -> same draw
    assert torch.equal(torch.rand(3), expected_next)  # global stream untouched
    g = torch.Generator().manual_seed(7)
    with seeded_global_rng(g) as first:
        pass
    with seeded_global_rng(g) as second:
        pass
    assert first != second  # successive blocks draw differently from one generator


def test_toy_framework_example_runs_and_its_adapter_is_short():
    example = ROOT / "examples" / "frameworks" / "toy_framework_adapter.py"
    text = example.read_text()
    adapter = text.split("# --- the adapter", 1)[1]
    lines = [ln for ln in adapter.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert len(lines) < 100, len(lines)
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=limit_s(120), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "anchors injected: [2, 5]" in out.stdout
    assert "mask recorded: [8, 24] bool" in out.stdout
