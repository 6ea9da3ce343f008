"""One training step (forward, backward, AdamW) of our drafter vs the reference's, on CPU.

SmolLM2-135M dimensions (H=576, 9 heads / 3 KV heads, head_dim 64, intermediate 1536,
vocab 49152), 2 draft layers, T=2048, A=128, B=8, fp32, kl_div + fixed-exp-decay. Each
side runs in its own process (the reference from its resolved source, eager attention and
eager losses as on any CPU) on identical weights, batch and anchors. Prints ms/step and
the peak resident-memory growth of the step for each side, and the ratios.

    python benchmarks/bench_step.py [--ref speculators==0.9.0] [--steps 3] [--layout full|sliding]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from step_sides import build_side, run_sides

T, A = 2048, 128


def config(layout: str):
    from dflash_audit.model.config import DFlashConfig

    sliding = layout == "sliding"
    return DFlashConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, num_hidden_layers=2, vocab_size=49152, num_verifier_layers=30,
        target_layer_ids=(2, 9, 15, 21, 28), mask_token_id=49151, block_size=8,
        rope_theta=100000.0, rms_norm_eps=1e-5,
        layer_types=("sliding_attention",) * 2 if sliding else None,
        sliding_window=2048 if sliding else None)


def rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(side: str, layout: str, steps: int, out: Path) -> None:
    from dflash_audit.audit.cases.synthetic import synthetic_case
    from dflash_audit.model.loss import LossSpec

    torch.set_num_threads(2)
    case = synthetic_case("bench", config(layout), LossSpec(), seed=0, seq_len=T,
                          num_documents=4, pad=16, max_anchors=A)
    inputs = case.inputs
    model, loss_fn = build_side(side, case, inputs, block_size=8, max_anchors=A,
                                workdir=out.parent)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()  # warm-up: allocator, optimizer state
    base = rss_mb()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    out.write_text(json.dumps({"ms_per_step": 1000 * sorted(times)[len(times) // 2],
                               "peak_step_mb": peak_mb() - base, "peak_rss_mb": peak_mb(),
                               "losses": losses}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default=None, help="reference spec (default: the lock)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layout", choices=("full", "sliding"), default="full")
    p.add_argument("--worker", choices=("ours", "reference"))
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.layout, args.steps, Path(args.out))
        return

    identity, results = run_sides(__file__, args.ref,
                                  ["--steps", str(args.steps), "--layout", args.layout])
    o, r = results["ours"], results["reference"]
    print(f"one training step, CPU fp32, H=576, 2 draft layers ({args.layout}), T={T}, A={A}, "
          f"B=8, V=49152; reference {identity.spec} ({identity.short_id})")
    print(f"{'side':<10} {'ms/step':>10} {'peak step MiB':>14} {'peak RSS MiB':>13}  loss")
    for side, v in results.items():
        print(f"{side:<10} {v['ms_per_step']:>10.0f} {v['peak_step_mb']:>14.0f} "
              f"{v['peak_rss_mb']:>13.0f}  {v['losses'][0]:.6f}")
    print(f"ratio ours/reference: time {o['ms_per_step'] / r['ms_per_step']:.2f}x, "
          f"step memory {o['peak_step_mb'] / max(r['peak_step_mb'], 1e-9):.2f}x "
          f"(target <= 1.0x for both)")


if __name__ == "__main__":
    main()
