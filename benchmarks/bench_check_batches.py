"""Time to check a 16-row batch folder with ``check-batches`` beside the time to capture it.

Builds a folder of ``--rows`` packed chitchat rows (``--seq-len`` tokens) with the verifier
(``build_batches``: tokenize, pack, one forward per document with hooks = the capture), then
runs :func:`run_check_batches` twice: on every row (``--rows-to-check`` = all), and on the
default sample (2 rows). The check recomputes each checked row in the files' precision
(float32 here) with every layer kept, re-tokenizes its documents for the loss mask, and once
per run measures the bf16-vs-fp32 noise on 128 tokens (bf16 on CPU is slow: that one-time
cost is printed separately). Torch uses ``--threads`` intra-op threads (default 2).

    python benchmarks/bench_check_batches.py [--verifier smollm2-135m] [--rows 16]
                                             [--seq-len 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from dflash_audit.batch_audit.run import run_check_batches
    from dflash_audit.batch_audit.recompute import Recomputer
    from dflash_audit.data.pipeline import build_batches, write_batches
    from dflash_audit.data.verifier import load_verifier

    torch.set_num_threads(args.threads)
    verifier = load_verifier(args.verifier)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "batches"
        t0 = time.perf_counter()
        batches = build_batches(verifier, "chitchat", seq_len=args.seq_len, rows=args.rows,
                                progress=False)
        write_batches(batches, folder)
        capture_s = time.perf_counter() - t0
        row = batches[0]
        docs = [(int(i.min()), int(i.max()) + 1) for i in
                [(row.document_ids[0] == k).nonzero() for k in range(row.num_documents)]]
        t0 = time.perf_counter()
        Recomputer(verifier).measure_noise(row.input_ids[0], docs, torch.float32)
        noise_s = time.perf_counter() - t0
        timings = {}
        for k in (len(batches), 2):
            t0 = time.perf_counter()
            report = run_check_batches(folder, verifier, rows_to_check=k, progress=False)
            timings[k] = (time.perf_counter() - t0, report.verdict)
    n = len(batches)
    print(f"verifier {args.verifier}, {n} rows x {args.seq_len} tokens, {args.threads} threads")
    print(f"capture (dflash-audit data: tokenize + pack + hooks): {capture_s:7.1f} s")
    print(f"noise measurement (once per run, 128 tokens fp32+bf16): {noise_s:7.1f} s")
    for k, (s, verdict) in timings.items():
        print(f"check-batches --rows-to-check {k:2d} (noise already measured): {s:7.1f} s "
              f"({s / capture_s:.2f} x capture, verdict {verdict})")


if __name__ == "__main__":
    main()
