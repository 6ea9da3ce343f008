"""Capture throughput and peak memory: forward hooks vs ``output_hidden_states=True``.

Same packed rows (real chitchat conversations tokenized for the verifier, default
4 x 1024 tokens), same per-document forwards, three ways:

- ``hooks``: dflash_audit's capture (``capture_row``): hooks keep only the target layers and
  the last layer; the base decoder runs without the LM head.
- ``ohs-causal-lm``: the plain way, ``model(ids, output_hidden_states=True)`` on the causal
  LM (all N+1 layer states kept, plus logits), then the target slices concatenated.
- ``ohs-decoder``: ``model.model(ids, output_hidden_states=True)`` (all layers kept, no
  logits), to separate the two effects.

Each method runs in its own subprocess; peak memory is the peak RSS above the RSS right
before the timed run (sampled every 2 ms with psutil). Throughput is tokens / wall second of
the timed run (after a short warm-up forward); methods run interleaved ``--repeats`` times
and the best time / highest peak is reported (CPU machines shared with other jobs are noisy).

    python benchmarks/bench_capture.py [--verifier smollm2-135m] [--rows 4] [--seq-len 1024]
                                       [--threads N] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

METHODS = ("hooks", "ohs-causal-lm", "ohs-decoder")


def _rows(verifier, rows: int, seq_len: int):
    from dflash_audit.data.conversations import load_chitchat
    from dflash_audit.data.pack import pack_stream
    from dflash_audit.data.tokenize import tokenize_conversation

    def docs():
        for conv in load_chitchat().conversations:
            doc = tokenize_conversation(verifier.tokenizer, conv.messages, seq_len)
            if doc is not None:
                yield doc
    out = []
    for row in pack_stream(docs(), seq_len):
        out.append(row)
        if len(out) == rows:
            return out
    return out


class _PeakRss:
    """Samples this process's RSS in a thread; ``peak`` is the maximum seen (bytes)."""

    def __init__(self, interval_s: float = 0.002):
        import psutil
        self.proc, self.interval, self.peak = psutil.Process(), interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def worker(method: str, verifier_spec: str, rows: int, seq_len: int) -> dict:
    import gc

    import psutil
    import torch

    from dflash_audit.data.capture import capture_row
    from dflash_audit.data.pack import pack_row
    from dflash_audit.data.tokenize import TokenizedConversation
    from dflash_audit.data.verifier import load_verifier
    from dflash_audit.model.layer_ids import resolve_target_layer_ids

    verifier = load_verifier(verifier_spec, progress=None)
    model = verifier.model
    layer_ids = resolve_target_layer_ids(verifier.num_layers)
    packed = _rows(verifier, rows, seq_len)
    tokens = sum(sum(r.lengths) for r in packed)

    def ohs(row, causal_lm: bool):
        """The output_hidden_states way, per document, same outputs as capture_row."""
        H = verifier.hidden_size
        T = row.seq_len
        hidden = torch.zeros(1, T, len(layer_ids) * H)
        last = torch.zeros(1, T, H)
        for s, e in row.document_bounds():
            ids = row.input_ids[:, s:e]
            if causal_lm:
                out = model(ids, output_hidden_states=True)
            else:
                out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
            states = out.hidden_states  # N+1 tensors [1, t, H]; [-1] is post-norm
            hidden[0, s:e] = torch.cat([states[i][0] for i in layer_ids], dim=-1)
            # pre-norm last layer is not in output_hidden_states; this is what users take
            last[0, s:e] = states[-1][0]
            del out, states
        return hidden, last

    def run(row):
        if method == "hooks":
            return capture_row(model, row.input_ids, row.document_ids, layer_ids)
        return ohs(row, causal_lm=method == "ohs-causal-lm")

    first = packed[0].documents[0]
    warm = pack_row([TokenizedConversation(first.input_ids[:64], first.loss_mask[:64])], 64)
    with torch.inference_mode():
        run(warm)  # warm-up: first-call kernel setup stays out of the timed run
        gc.collect()
        base = psutil.Process().memory_info().rss
        checksum = 0.0
        with _PeakRss() as mem:
            start = time.perf_counter()
            for row in packed:
                hidden, _ = run(row)
                checksum += float(hidden.double().sum())
                del hidden
            seconds = time.perf_counter() - start
    return {"method": method, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "peak_rss_delta_mb": (mem.peak - base) / 2**20,
            "checksum": checksum, "threads": torch.get_num_threads(),
            "target_layer_ids": layer_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    ap.add_argument("--repeats", type=int, default=2,
                    help="interleaved runs per method; best time and highest peak are kept")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        print(json.dumps(worker(args.worker, args.verifier, args.rows, args.seq_len)))
        return

    from dflash_audit.data.verifier import resolve_verifier_path
    resolve_verifier_path(args.verifier)  # convert once, before the timed workers
    results: dict[str, dict] = {}
    for _ in range(args.repeats):  # interleaved, so load changes hit every method alike
        for method in METHODS:
            cmd = [sys.executable, __file__, "--worker", method, "--verifier", args.verifier,
                   "--rows", str(args.rows), "--seq-len", str(args.seq_len)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(f"{method} worker failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            best = results.setdefault(method, r)  # best time, highest peak memory
            if r["seconds"] < best["seconds"]:
                best.update(seconds=r["seconds"], tokens_per_s=r["tokens_per_s"])
            best["peak_rss_delta_mb"] = max(best["peak_rss_delta_mb"], r["peak_rss_delta_mb"])

    h = results["hooks"]
    print(f"verifier {args.verifier}: {args.rows} rows x {args.seq_len} tokens "
          f"({h['tokens']} real tokens), target_layer_ids {h['target_layer_ids']}, "
          f"{h['threads']} torch threads, best of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'method':<15}{'tokens/s':>10}{'seconds':>10}{'peak RSS +MB':>14}"
          f"{'speed vs hooks':>16}{'memory vs hooks':>17}")
    for method, r in results.items():
        print(f"{method:<15}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}"
              f"{r['peak_rss_delta_mb']:>14.1f}{r['tokens_per_s'] / h['tokens_per_s']:>15.2f}x"
              f"{r['peak_rss_delta_mb'] / max(h['peak_rss_delta_mb'], 1e-9):>16.2f}x")
    same = all(abs(r["checksum"] - h["checksum"]) <= 1e-6 * abs(h["checksum"]) + 1e-3
               for r in results.values())
    print(f"hidden_states identical across methods (checksum): {same}")


if __name__ == "__main__":
    main()
