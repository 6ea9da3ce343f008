"""Optimizers, LR schedules, draft vocabulary and metric summaries of the training loop."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.model.vocab import coverage, draft_vocab, token_counts
from dflash_audit.train.optim import (
    OptimConfigError,
    OptimSpec,
    build_optimizers,
    build_schedulers,
    lr_factor,
    muon_available,
    split_for_muon,
)
from dflash_audit.train.step import train_step
from dflash_audit.train.track import describe, summarize

CONFIG = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=2, vocab_size=50,
                      num_verifier_layers=4, target_layer_ids=(1, 2, 3), mask_token_id=49,
                      block_size=4)


def test_warmup_then_cosine_and_linear_decay():
    spec = OptimSpec(warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
    f = lr_factor(spec)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # 0.55
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    lin = lr_factor(OptimSpec(warmup_steps=2, total_steps=12, schedule="linear", min_lr_ratio=0.0))
    assert [round(lin(s), 6) for s in (0, 1, 2, 7, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert lr_factor(OptimSpec(warmup_steps=0, schedule="constant"))(50) == 1.0


def test_schedulers_drive_each_optimizer_from_its_base_lr():
    model = DFlashDrafter(CONFIG)
    spec = OptimSpec(optimizer="adamw", lr=1e-3, warmup_steps=2, total_steps=4)
    opts = build_optimizers(model, spec)
    scheds = build_schedulers(opts, spec)
    seen = []
    for _ in range(4):
        seen.append(opts[0].param_groups[0]["lr"])
        opts[0].step()
        scheds[0].step()
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * (0.1 + 0.9 * 0.5)])


def test_adamw_covers_exactly_the_trainable_parameters():
    model = DFlashDrafter(CONFIG)
    (opt,) = build_optimizers(model, OptimSpec(optimizer="adamw"))
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert ids == {id(p) for p in model.trainable_parameters().values()}
    frozen = {id(p) for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and not ids & frozen


def test_muon_split_matrices_vs_rest():
    model = DFlashDrafter(CONFIG)
    muon, adamw = split_for_muon(model.named_parameters())
    muon_names = {n for n, _ in muon}
    assert "fc.weight" in muon_names and "layers.0.self_attn.q_proj.weight" in muon_names
    assert "layers.1.mlp.down_proj.weight" in muon_names
    assert all(p.ndim == 2 for _, p in muon)
    assert {n for n, _ in adamw} == {n for n, p in model.trainable_parameters().items()
                                     if p.ndim == 1}
    assert not muon_names & {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}


@pytest.mark.skipif(not muon_available(), reason="torch.optim.Muon not in this torch")
def test_muon_optimizer_steps():
    model = DFlashDrafter(CONFIG)
    spec = OptimSpec(optimizer="muon", lr=1e-3, muon_lr=2e-2, warmup_steps=0, total_steps=3)
    opts = build_optimizers(model, spec)
    assert [type(o).__name__ for o in opts] == ["Muon", "AdamW"]
    assert opts[0].param_groups[0]["lr"] == 2e-2 and opts[1].param_groups[0]["lr"] == 1e-3
    before = model.fc.weight.detach().clone()
    params = list(model.trainable_parameters().values())

    def forward(_inputs):
        loss = sum((p.float() ** 2).sum() for p in params)
        return loss, {"loss_sum": float(loss.detach()), "loss_total": 1.0}

    res = train_step(forward, [{}], params, opts, build_schedulers(opts, spec), grad_clip=1.0)
    assert res.grad_norm > 1.0  # clipped to 1.0 before the step
    assert not torch.equal(before, model.fc.weight)


def test_bad_settings_name_the_field():
    with pytest.raises(OptimConfigError, match="optimizer"):
        OptimSpec(optimizer="sgd")
    with pytest.raises(OptimConfigError, match="schedule"):
        OptimSpec(schedule="step")
    with pytest.raises(OptimConfigError, match="min_lr_ratio"):
        OptimSpec(min_lr_ratio=2.0)


def test_train_step_clips_and_accumulates():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = torch.optim.SGD([w], lr=1.0)

    def forward(inputs):
        loss = (w * inputs["x"]).sum()
        return loss, {"loss_sum": float(loss.detach()), "loss_total": 1.0}

    res = train_step(forward, [{"x": torch.tensor([3.0, 0.0])}, {"x": torch.tensor([0.0, 4.0])}],
                     [w], [opt], grad_clip=1.0)
    # grad = mean of [3,0] and [0,4] = [1.5, 2]; norm 2.5 clipped to 1 -> [0.6, 0.8]
    assert res.grad_norm == pytest.approx(2.5)
    assert w.detach().tolist() == pytest.approx([2.4, 3.2])
    assert res.loss == pytest.approx((9.0 + 16.0) / 2)
    assert res.metrics == {"loss_sum": 25.0, "loss_total": 2.0}
    with pytest.raises(ValueError, match="non-finite"):
        train_step(lambda _i: (w.sum() * float("nan"), {}), [{}], [w], [opt])


def test_draft_vocab_most_frequent_supervised_tokens():
    ids = torch.tensor([[5, 5, 5, 2, 2, 9, 9, 9, 9, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0, 0, 1]])  # the 9s are not supervised
    counts = token_counts([(ids, mask)], vocab_size=12)
    assert counts[5] == 3 and counts[2] == 2 and counts[7] == 1 and counts[9] == 0
    t2d, d2t = draft_vocab(counts, 4)
    # 5, 2, 7, then the smallest unseen id 0 (ties by ascending id)
    assert t2d.nonzero().flatten().tolist() == [0, 2, 5, 7]
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 5, 7]
    assert coverage(counts, t2d) == 1.0
    with pytest.raises(ValueError):
        draft_vocab(counts, 13)


def test_summarize_pools_slots_and_recomputes_eal_product():
    raw = {"loss_sum": 3.0, "loss_total": 2.0, "position_1_acc_sum": 8.0,
           "position_1_acc_total": 10.0, "position_2_acc_sum": 5.0, "position_2_acc_total": 10.0,
           "position_3_acc_sum": 0.0, "position_3_acc_total": 0.0, "full_acc_sum": 13.0,
           "full_acc_total": 20.0, "eal_sum": 30.0, "eal_total": 20.0, "eal_product": 99.0}
    s = summarize(raw)
    assert s["loss"] == 1.5 and s["acc_1"] == 0.8 and s["acc_2"] == 0.5
    assert math.isnan(s["acc_3"])
    assert s["eal_product"] == pytest.approx(0.8 + 0.8 * 0.5)
    assert s["full_acc"] == 0.65 and s["eal"] == 1.5 and s["supervised"] == 20.0
    assert describe(s) == "loss 1.500 | acc 0.800 0.500 nan | eal 1.500"
