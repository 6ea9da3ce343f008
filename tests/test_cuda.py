"""CUDA: the flex-attention path, ``compare --device cuda``, bf16 training steps, DDP (NCCL) and
FSDP2. Every test is skipped on a machine where torch sees no GPU."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.precision import in_dtype, outputs_on_cpu
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.limits import limit_s
from dflash_audit.model.config import FULL_ATTENTION, SLIDING_ATTENTION, DFlashConfig
from dflash_audit.model.loss import LossSpec
from dflash_audit.model.mask import dense_mask, flex_block_mask, materialise_block_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "candidates" / "loss_softmax_bf16.py"
CONFIG = DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=96,
                      num_verifier_layers=12, target_layer_ids=(2, 6, 9), mask_token_id=95,
                      block_size=8, sliding_window=24,
                      layer_types=(FULL_ATTENTION, SLIDING_ATTENTION))
# Q = 19 * 8 = 152 queries and T + Q = 357 keys: both padded by flex attention (block 128)
@functools.cache
def padded():
    """The padded case, built on first use (not at collection, where every test here may be
    skipped: its drafter imports transformers)."""
    return synthetic_case("flexpad", CONFIG, LossSpec(), seed=3, seq_len=205, num_documents=3,
                          pad=5, max_anchors=19)


@pytest.mark.parametrize("window,non_causal", [(None, False), (24, False), (24, True)])
def test_flex_block_mask_on_cuda_is_the_dense_rule(window, non_causal):
    doc = padded().inputs["document_ids"].cuda()
    anchors = padded().inputs["anchor_positions"].cuda()
    bm = flex_block_mask(doc, anchors, 8, window, non_causal)
    assert torch.equal(materialise_block_mask(bm).cpu(),
                       dense_mask(doc.cpu(), anchors.cpu(), 8, window, non_causal))
    from torch.nn.attention.flex_attention import flex_attention

    dense = dense_mask(doc, anchors, 8, window, non_causal)
    q = torch.randn(1, 4, dense.shape[0], 16, device="cuda")
    k, v = (torch.randn(1, 4, dense.shape[1], 16, device="cuda") for _ in range(2))
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    rows = dense.any(-1)
    torch.testing.assert_close(out[:, :, rows], ref[:, :, rows], atol=2e-3, rtol=2e-3)


def _run_on(case, device: str):
    cuda = in_dtype(case, case.dtype, device)
    inputs = {k: v.to(device) for k, v in cuda.inputs.items()}
    weights = {k: v.to(device) for k, v in cuda.weights.items()}
    out = DrafterCandidate().run_case(case.config, case.loss, weights, inputs)
    return outputs_on_cpu(out.tensors)


def test_our_drafter_flex_on_cuda_matches_dense_on_cpu():
    cpu, gpu = _run_on(padded(), "cpu"), _run_on(padded(), "cuda")
    for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
        assert torch.equal(gpu[f"mask.{kind}"], cpu[f"mask.{kind}"]), kind
    for key in ("context", "logits", "loss"):
        torch.testing.assert_close(gpu[key], cpu[key], atol=1e-3, rtol=1e-3)


@pytest.mark.reference
@pytest.mark.parametrize("candidate,exit_code", [(None, 0), (f"{EXAMPLE}:candidate", 1)])
def test_compare_on_cuda_in_bf16(tmp_path, reference_identity, candidate, exit_code):
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.audit.options import CompareOptions

    outcome = run_compare(CompareOptions(ref="speculators==0.9.0", candidate=candidate, rows=0,
                                         cases=3, dtype="bf16", device="cuda", out=tmp_path,
                                         cache_dir=tmp_path / "cache", progress=False))
    assert outcome.exit_code == exit_code, [
        (r.case, r.name, r.summary) for r in outcome.report.results if r.status == "fail"]
    assert any(c.name.startswith("syn-flexpad") for c in outcome.report.cases)


def test_bf16_autocast_training_step_on_cuda():
    from dflash_audit.model.drafter import DFlashDrafter
    from dflash_audit.train.step import drafter_forward, train_step

    model = DFlashDrafter(CONFIG).cuda().train()
    model.load_state_dict({k: v.cuda() for k, v in padded().weights.items()})
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3)
    inputs = {k: v.cuda() for k, v in padded().inputs.items()}
    forward = drafter_forward(model, LossSpec(), CONFIG.block_size)
    result = train_step(forward, [inputs], params, [opt], device="cuda")
    assert torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0
    assert all(p.dtype == torch.float32 for p in params)  # fp32 master weights
    assert any(not torch.equal(a, b) for a, b in zip(before, params))


FSDP_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_cuda import CONFIG, padded
    from dflash_audit.model.drafter import DFlashDrafter
    from dflash_audit.model.loss import LossSpec
    from dflash_audit.train.fsdp import (full_model_state, full_optimizer_state,
                                         load_full_state, shard_drafter)
    from dflash_audit.train.step import drafter_forward, train_step

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    PADDED = padded()
    inputs = {{k: v.cuda() for k, v in PADDED.inputs.items()}}

    def build():
        model = DFlashDrafter(CONFIG).cuda().train()
        model.load_state_dict({{k: v.cuda() for k, v in PADDED.weights.items()}})
        shard_drafter(model)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, params, torch.optim.AdamW(params, lr=1e-3)

    def step(model, params, opt):
        fwd = drafter_forward(model, LossSpec(), CONFIG.block_size)
        return train_step(fwd, [inputs], params, [opt], device="cuda").loss

    model, params, opt = build()
    step(model, params, opt)
    saved = full_model_state(model), full_optimizer_state(model, opt)
    after = step(model, params, opt)
    again, params2, opt2 = build()
    load_full_state(again, opt2, *saved)
    resumed = step(again, params2, opt2)
    assert after == resumed, (after, resumed)  # exact resume
    if rank == 0:
        print("FSDP-OK", after)
    dist.destroy_process_group()
""")


def test_fsdp2_step_and_exact_resume_under_torchrun(tmp_path):
    script = tmp_path / "fsdp_run.py"
    script.write_text(FSDP_SCRIPT.format(tests=str(ROOT / "tests")))
    nproc = min(2, torch.cuda.device_count())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", str(script)], check=False,
                          capture_output=True, text=True, timeout=limit_s(600),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FSDP-OK" in proc.stdout
