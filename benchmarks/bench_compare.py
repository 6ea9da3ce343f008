"""Wall time of the main job, ``dflash-audit compare`` (the README's command), cold then warm.

Run 1 uses an empty cache (``$DFLASH_AUDIT_CACHE`` in a temporary folder): it downloads the
pinned reference release from the package index, converts the SmolLM2 verifier, captures the
real batch and checks that the reference imports. Run 2 reuses that cache, as every later
audit does. Both runs write their reports into a temporary folder. Prints each run's wall
time, its stages (from report.json) and the warm time against the target.

Usage: ``python benchmarks/bench_compare.py [--cache DIR] [--target-s 60] [-- extra args]``
(``--cache DIR`` keeps / reuses a cache folder; extra args go to ``dflash-audit compare``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND = ["dflash-audit", "compare"]  # the README's main job
TARGET_S = 60.0


def run(cache: Path, out: Path, extra: list[str]) -> dict:
    """One audit in a subprocess; returns wall time, exit code, CPU time and report timing."""
    env = {**os.environ, "DFLASH_AUDIT_CACHE": str(cache)}
    before = os.times()
    start = time.perf_counter()
    proc = subprocess.run([*COMMAND, "--out", str(out), *extra], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system
                                                          - before.children_system)
    reports = sorted(out.glob("*/report.json"), key=lambda p: p.stat().st_mtime)
    report = json.loads(reports[-1].read_text()) if reports else {}
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
    return {"wall_s": wall, "cpu_s": cpu, "exit_code": proc.returncode,
            "verdict": report.get("verdict"), "timing": report.get("timing", {}),
            "cases": len(report.get("cases", [])),
            "cache_hit": report.get("inputs", {}).get("batch_cache", {}).get("hit")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None,
                        help="cache folder to use (default: a fresh temporary one)")
    parser.add_argument("--target-s", type=float, default=TARGET_S)
    parser.add_argument("extra", nargs="*", help="extra arguments for dflash-audit compare")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    cache = args.cache or tmp / "cache"
    print(f"command: {' '.join(COMMAND + args.extra)}  (cache {cache})")
    print(f"cpus: {os.cpu_count()}  load average before: {os.getloadavg()[0]:.2f}")
    try:
        results = {}
        for label in ("cold", "warm"):
            r = results[label] = run(cache, tmp / f"reports-{label}", args.extra)
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r["timing"].items() if k != "total")
            print(f"{label}: {r['wall_s']:6.1f} s wall, {r['cpu_s']:6.1f} s cpu, exit "
                  f"{r['exit_code']}, verdict {r['verdict']}, {r['cases']} cases, batch cache "
                  f"{'hit' if r['cache_hit'] else 'miss'}; stages (s): {stages}")
        warm = results["warm"]["wall_s"]
        print(f"warm / target: {warm:.1f} s / {args.target_s:.0f} s -> "
              f"{'OK' if warm <= args.target_s else 'OVER'} "
              f"(load average after: {os.getloadavg()[0]:.2f})")
        return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a --cache folder lives outside tmp


if __name__ == "__main__":
    sys.exit(main())
