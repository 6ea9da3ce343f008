"""Wall time of the main job, ``dflash-audit compare`` (the README's command): cold, warm
(a passing audit) with and without the reference cache, and failing (a shipped buggy
candidate), side by side, and each built-in framework audit (``--frameworks``).

Run 1 uses an empty cache (``$DFLASH_AUDIT_CACHE`` in a temporary folder): it downloads the
pinned reference release from the package index, converts the SmolLM2 verifier, captures the
real batch, checks that the reference imports and stores the reference's outputs. Run 2
reuses that cache, as every later audit does, with our conformant drafter (a pass): the
reference's outputs come from the cache. Run 2b is the same with ``--no-reference-cache``
(the reference runs again); the ratio 2 / 2b is printed against ``--cache-ratio`` (issue 31:
at most 0.5). Run 3 reuses the cache with a shipped buggy
candidate (``--fail-candidate``, default ``examples/candidates/bool_mask_added.py``: its logits
difference is found by the replay hypothesis search, the costly part of a failing audit's
diagnosis). Run 4 does the same with ``--compound-candidate`` (default
``examples/candidates/three_causes.py``: three simultaneous causes). All runs write their
reports into a temporary folder. Prints each run's wall time
and stages (from report.json), the warm time against the target and the failing / passing
ratio against the budget (a failing audit costs at most ``--fail-ratio`` x a passing one),
then the cost of each verifier family (:func:`family_costs`, skipped with ``--no-families``).

On a shared machine the load changes from run to run: ``--repeat N`` runs the warm audits with
and without the reference cache N times interleaved (with, without, with, ...) and compares
their medians; each run prints the load average it started at. ``--frameworks`` (every
built-in framework adapter of the registry, :func:`builtin_framework_specs`; or a
comma-separated list of keys) audits each framework, each right after a default warm audit
whose wall time it is compared with (target ``--framework-ratio``, 2x), after a first audit
of it that installs the framework at its pinned version into the cache (printed, not compared:
a one-time cost per version); they take minutes each, so they are not in the default run.

Usage: ``python benchmarks/bench_compare.py [--cache DIR] [--skip-cold] [--target-s 60]
[--fail-candidate FILE.py:ATTR] [--repeat N] [--frameworks [KEYS]] [-- extra args]`` (``--cache DIR`` keeps / reuses a cache
folder, ``--skip-cold`` then measures warm and failing only; extra args go to every run).
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
FAIL_RATIO = 2.0
#: A framework audit against the default audit (issue 31).
FRAMEWORK_RATIO = 2.0
#: A warm audit with the reference cache against one without it (issue 31).
CACHE_RATIO = 0.5
ROOT = Path(__file__).resolve().parents[1]
FAIL_CANDIDATE = f"{ROOT / 'examples' / 'candidates' / 'bool_mask_added.py'}:candidate"
#: A candidate with three simultaneous causes (per-query window + packed positions + loss over
#: the sum of weights): its diagnosis replays the drafter with the candidate's masks and searches
#: the rest (issue 20: within 2x a passing audit).
COMPOUND_CANDIDATE = f"{ROOT / 'examples' / 'candidates' / 'three_causes.py'}:candidate"


def run(cache: Path, out: Path, extra: list[str]) -> dict:
    """One audit in a subprocess; returns wall time, exit code, CPU time and report timing."""
    env = {**os.environ, "DFLASH_AUDIT_CACHE": str(cache)}
    load = os.getloadavg()[0]
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
    return {"wall_s": wall, "cpu_s": cpu, "exit_code": proc.returncode, "load": load,
            "verdict": report.get("verdict"), "timing": report.get("timing", {}),
            "cases": len(report.get("cases", [])),
            "cache_hit": report.get("inputs", {}).get("batch_cache", {}).get("hit"),
            "reference_cached": (report.get("reference", {}).get("cache") or {}).get(
                "from_cache", 0),
            "cases_cached": (report.get("inputs", {}).get("case_cache") or {}).get("from_cache"),
            "check_cached": (report.get("reference", {}).get("import_check") or {}).get(
                "from_cache")}


def builtin_framework_specs(keys: str = "") -> dict[str, str]:
    """``{key: --candidate spec}`` of every framework adapter shipped in the package (the
    registry's :func:`~dflash_audit.audit.frameworks.registry.available_adapters`, not one of
    ``$DFLASH_AUDIT_ADAPTER_PATH``), or of the comma-separated ``keys``; the speculators
    adapter as its self-test at the locked reference (``reference/speculators.lock``)."""
    from dflash_audit.audit.frameworks.registry import PREFIX, SPECULATORS, available_adapters
    from dflash_audit.reference_source.identity import load_lock

    found = {k: c for k, c in available_adapters().items() if c.get("folder") is None}
    wanted = [k.strip() for k in keys.split(",") if k.strip()] or sorted(found)
    unknown = [k for k in wanted if k not in found]
    if unknown:
        raise SystemExit(f"unknown framework(s) {unknown}: built in are {sorted(found)}")
    return {k: PREFIX + (load_lock().spec if k == SPECULATORS else k) for k in wanted}


def median(values: list[float]) -> float:
    """The median of ``values`` (not empty)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def family_costs(seed: int = 8) -> list[dict]:
    """Per verifier family, in this process (one thread, as each side of an audit): seconds to
    plan its synthetic case of the default spread (proxy config + case), to run our drafter on
    it (forward, backward, 512 anchor draws, derivation), and to build its proxy model (what
    ``--verifier family:NAME`` pays once before the cache)."""
    import torch

    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.audit.sides.run_sides import run_candidate
    from dflash_audit.candidate import DrafterCandidate
    from dflash_audit.data.families import FAMILIES, build_proxy, family_config
    from dflash_audit.profile import Profile

    torch.set_num_threads(1)
    profile, candidate, rows = Profile.load("reference-model"), DrafterCandidate(), []
    planned = plan_synthetic_cases(profile, len(FAMILIES), seed=seed)
    run_candidate(candidate, planned[0].case)  # first-use costs (imports, kernels)
    plan_totals = []  # the spread is planned in order: case i costs plan(i+1) - plan(i)
    for n in range(len(FAMILIES) + 1):
        start = time.perf_counter()
        plan_synthetic_cases(profile, n, seed=seed)
        plan_totals.append(time.perf_counter() - start)
    for i, family in enumerate(FAMILIES):
        start = time.perf_counter()
        run_candidate(candidate, planned[i].case)
        run_s = time.perf_counter() - start
        build_proxy(family_config(family, num_hidden_layers=12))  # its modeling import
        start = time.perf_counter()
        build_proxy(family_config(family, num_hidden_layers=12))
        rows.append({"family": family, "plan_s": max(0.0, plan_totals[i + 1] - plan_totals[i]),
                     "candidate_s": run_s, "proxy_build_s": time.perf_counter() - start})
    return rows


def print_family_costs(rows: list[dict]) -> None:
    """The table of :func:`family_costs`."""
    print("per-family cost (s, 1 thread): family, plan case, our drafter on it, build proxy")
    for r in rows:
        print(f"  {r['family']:<12} {r['plan_s']:6.2f} {r['candidate_s']:6.2f} "
              f"{r['proxy_build_s']:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None,
                        help="cache folder to use (default: a fresh temporary one)")
    parser.add_argument("--target-s", type=float, default=TARGET_S)
    parser.add_argument("--no-families", action="store_true",
                        help="skip the per-family cost table")
    parser.add_argument("--skip-cold", action="store_true",
                        help="with --cache: no cold run (the cache is already filled)")
    parser.add_argument("--fail-candidate", default=FAIL_CANDIDATE,
                        help="the buggy candidate of the failing run")
    parser.add_argument("--fail-ratio", type=float, default=FAIL_RATIO)
    parser.add_argument("--cache-ratio", type=float, default=CACHE_RATIO,
                        help="most a warm audit with the reference cache may take against "
                             "one without it")
    parser.add_argument("--compound-candidate", default=COMPOUND_CANDIDATE,
                        help="the candidate with several simultaneous causes")
    parser.add_argument("--repeat", type=int, default=1,
                        help="warm runs with and without the reference cache, interleaved")
    parser.add_argument("--frameworks", nargs="?", const="all", default="",
                        help="also audit each built-in framework (or KEY,KEY)")
    parser.add_argument("--framework-ratio", type=float, default=FRAMEWORK_RATIO)
    parser.add_argument("extra", nargs="*", help="extra arguments for dflash-audit compare")
    args = parser.parse_args()
    frameworks = (builtin_framework_specs("" if args.frameworks == "all" else args.frameworks)
                  if args.frameworks else {})
    tmp = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    cache = args.cache or tmp / "cache"
    print(f"command: {' '.join(COMMAND + args.extra)}  (cache {cache})")
    print(f"cpus: {os.cpu_count()}  load average before: {os.getloadavg()[0]:.2f}")
    try:
        results: dict[str, list[dict]] = {}
        runs = [("cold", args.extra)] if not (args.skip_cold and args.cache) else []
        for _ in range(max(1, args.repeat)):
            runs += [("warm", args.extra),
                     ("warm-no-reference-cache", ["--no-reference-cache", *args.extra])]
        runs += [("failing", ["--candidate", args.fail_candidate, *args.extra]),
                 ("compound", ["--candidate", args.compound_candidate, *args.extra])]
        for key, spec in frameworks.items():  # each right after a default audit; its first
            # use installs the framework into the cache (once per version): not the audit's cost
            runs += [(f"first-use-{key}", ["--candidate", spec, *args.extra]),
                     (f"default-before-{key}", args.extra),
                     (f"framework:{key}", ["--candidate", spec, *args.extra])]
        for label, extra in runs:
            r = run(cache, tmp / f"reports-{label}", extra)
            results.setdefault(label, []).append(r)
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r["timing"].items() if k != "total")
            print(f"{label}: {r['wall_s']:6.1f} s wall (load {r['load']:.1f}), {r['cpu_s']:6.1f}"
                  f" s cpu, exit {r['exit_code']}, verdict {r['verdict']}, {r['cases']} cases, "
                  f"batch cache {'hit' if r['cache_hit'] else 'miss'}, reference outputs of "
                  f"{r['reference_cached']} / {r['cases']} cases, cases "
                  f"{'from' if r['cases_cached'] else 'not from'} and import check "
                  f"{'from' if r['check_cached'] else 'not from'} the cache; stages (s): "
                  f"{stages}", flush=True)
        wall = {label: median([r["wall_s"] for r in rs]) for label, rs in results.items()}
        warm, failing = results["warm"][-1], results["failing"][-1]
        print(f"warm / target: {wall['warm']:.1f} s / {args.target_s:.0f} s -> "
              f"{'OK' if wall['warm'] <= args.target_s else 'OVER'} "
              f"(load average after: {os.getloadavg()[0]:.2f})")
        uncached = wall["warm-no-reference-cache"]
        rratio = wall["warm"] / uncached
        print(f"warm with / without the reference cache (median of {len(results['warm'])}, "
              f"interleaved): {wall['warm']:.1f} s / {uncached:.1f} s = {rratio:.2f} / "
              f"{args.cache_ratio:g} -> {'OK' if rratio <= args.cache_ratio else 'OVER'}")
        ratio = wall["failing"] / wall["warm"]
        print(f"pass vs fail: {wall['warm']:.1f} s (exit {warm['exit_code']}) vs "
              f"{wall['failing']:.1f} s (exit {failing['exit_code']}): x{ratio:.2f} / "
              f"x{args.fail_ratio:g} -> {'OK' if ratio <= args.fail_ratio else 'OVER'}; "
              f"checks stage {warm['timing'].get('checks', 0):.1f} s vs "
              f"{failing['timing'].get('checks', 0):.1f} s")
        compound = results["compound"][-1]
        cratio = wall["compound"] / wall["warm"]
        print(f"pass vs three causes: {wall['warm']:.1f} s vs {wall['compound']:.1f} s "
              f"(exit {compound['exit_code']}): x{cratio:.2f} / x{args.fail_ratio:g} -> "
              f"{'OK' if cratio <= args.fail_ratio else 'OVER'}; checks stage "
              f"{compound['timing'].get('checks', 0):.1f} s")
        for key in frameworks:
            fw, base = wall[f"framework:{key}"], wall[f"default-before-{key}"]
            code = results[f"framework:{key}"][-1]["exit_code"]
            print(f"framework:{key} vs the default audit before it: {fw:.1f} s (exit {code}) vs "
                  f"{base:.1f} s: x{fw / base:.2f} / x{args.framework_ratio:g} -> "
                  f"{'OK' if fw / base <= args.framework_ratio else 'OVER'}")
        if not args.no_families:
            print_family_costs(family_costs())
        ok = (all(r["exit_code"] == 0 for k, rs in results.items() for r in rs
                  if k in ("cold", "warm", "warm-no-reference-cache")
                  or k.startswith("default-"))
              and failing["exit_code"] == 1 and compound["exit_code"] == 1
              and all(results[f"framework:{k}"][-1]["exit_code"] in (0, 1) for k in frameworks))
        return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a --cache folder lives outside tmp


if __name__ == "__main__":
    sys.exit(main())
