"""One bf16 training step on a GPU, our drafter beside the reference's, in the same run.

A realistic size: a Llama-3-8B-like verifier (H=4096, 32 heads / 8 KV heads, head_dim 128,
intermediate 14336, vocabulary 128256, draft vocabulary 32000), 5 target layers, T=4096 context
tokens, A=512 anchors, block size B=16 (Q = 8192 draft queries), kl_div + fixed-exp-decay.
Each side runs in its own process on identical weights, batch and anchors, with fp32 master
weights under ``torch.autocast("cuda", bfloat16)`` and its flex-attention path (ours:
``flex_block_mask``; the reference: ``simple_flex_attention``). Prints per side: median
ms/step (forward, backward, AdamW), peak GPU memory, context tokens/s, model FLOP utilisation
(MFU: the step's matmul + visible-attention FLOPs over the GPU's dense bf16 peak), and the
ratios. Without CUDA it prints that no GPU is available and exits 0.

    python benchmarks/bench_gpu.py [--ref speculators==0.9.0] [--steps 5] [--draft-layers 1]
        [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from step_sides import build_side, run_sides

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
V, V_DRAFT, TARGET_LAYERS = 128256, 32000, (1, 9, 17, 25, 29)
T, A, B = 4096, 512, 16
#: Dense bf16 peak of common GPUs in FLOP/s (vendor data sheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def config(draft_layers: int):
    from dflash_audit.model.config import DFlashConfig

    return DFlashConfig(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=draft_layers,
        vocab_size=V, draft_vocab_size=V_DRAFT, num_verifier_layers=32,
        target_layer_ids=TARGET_LAYERS, mask_token_id=V - 1, block_size=B,
        rope_theta=500000.0, rms_norm_eps=1e-5)


def step_flops(draft_layers: int, visible_pairs: int) -> float:
    """FLOPs of one step: 3x forward for trainable matmuls (forward + input and weight
    gradients), 2x for the frozen LM head (no weight gradient), 1x for the targets head, and
    4 * H * visible (query, key) pairs per layer for attention, tripled for the backward."""
    Q = A * B
    kv = KV_HEADS * HEAD_DIM
    fc = 2 * T * len(TARGET_LAYERS) * H * H
    per_layer = 2 * (Q * H * H * 2 + (T + Q) * H * kv * 2 + 3 * Q * H * INTER)
    attention = 4 * HEADS * HEAD_DIM * visible_pairs
    head = 2 * Q * H * V_DRAFT
    return 3 * (fc + draft_layers * (per_layer + attention)) + 2 * head + head


def worker(side: str, draft_layers: int, steps: int, out: Path) -> None:
    from dflash_audit.audit.cases.synthetic import synthetic_case
    from dflash_audit.model.loss import LossSpec
    from dflash_audit.model.mask import dense_mask

    case = synthetic_case("bench", config(draft_layers), LossSpec(), seed=0, seq_len=T,
                          num_documents=4, pad=16, max_anchors=A)
    visible = int(dense_mask(case.inputs["document_ids"], case.inputs["anchor_positions"],
                             B).sum())
    inputs = {k: v.cuda() for k, v in case.inputs.items()}
    for k in ("hidden_states", "verifier_last_hidden_states"):  # the dataloader's dtype
        inputs[k] = inputs[k].to(torch.bfloat16)
    model, loss_fn = build_side(side, case, inputs, block_size=B, max_anchors=A,
                                workdir=out.parent,
                                attn_implementation="simple_flex_attention")
    model.float().cuda().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()  # warm-up: compilation of the flex kernels, allocator, optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out.write_text(json.dumps({"s_per_step": sorted(times)[len(times) // 2],
                               "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                               "visible_pairs": visible, "losses": losses}))


def peak_flops(override: float | None) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name()
    if override:
        return override * 1e12, name
    return next((v for k, v in PEAK_BF16.items() if k in name), None), name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default=None, help="reference spec (default: the lock)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the GPU (default: from its name)")
    p.add_argument("--worker", choices=("ours", "reference"))
    p.add_argument("--out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA GPU available (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda or 'not built'}); nothing measured")
        return 0
    if args.worker:
        worker(args.worker, args.draft_layers, args.steps, Path(args.out))
        return 0

    identity, results = run_sides(
        __file__, args.ref, ["--steps", str(args.steps), "--draft-layers", str(args.draft_layers)])
    peak, gpu = peak_flops(args.peak_tflops)
    print(f"one bf16 training step on {gpu}: H={H}, {len(TARGET_LAYERS)} target layers, "
          f"{args.draft_layers} draft layer(s), T={T}, A={A}, B={B}, V_d={V_DRAFT}; "
          f"reference {identity.spec} ({identity.short_id})")
    print(f"{'side':<10} {'ms/step':>9} {'peak GiB':>9} {'tokens/s':>10} {'MFU':>7}  loss")
    for side, v in results.items():
        flops = step_flops(args.draft_layers, v["visible_pairs"])
        mfu = f"{flops / v['s_per_step'] / peak:.1%}" if peak else "n/a"
        print(f"{side:<10} {1000 * v['s_per_step']:>9.1f} {v['peak_gib']:>9.2f} "
              f"{T / v['s_per_step']:>10.0f} {mfu:>7}  {v['losses'][0]:.6f}")
    o, r = results["ours"], results["reference"]
    print(f"ratio ours/reference: time {o['s_per_step'] / r['s_per_step']:.2f}x, peak memory "
          f"{o['peak_gib'] / r['peak_gib']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
