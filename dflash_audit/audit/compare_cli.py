"""The ``dflash-audit compare`` command: its options and its exit code (0 pass, 1 a
conformance failure, 2 a usage or setup error); the work is
:func:`dflash_audit.audit.compare.run_compare`, imported when the command runs (``--help``
and usage errors need no torch)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_audit.audit.options import (
    CANDIDATE_TIMEOUT_ENV,
    DEFAULT_ANCHORS,
    DEFAULT_CANDIDATE_TIMEOUT_S,
    DEFAULT_CASES,
    DEFAULT_DATA,
    DEFAULT_PROFILE,
    DEFAULT_ROWS,
    DEFAULT_SEED,
    DEFAULT_SEQ_LEN,
    DEFAULT_VERIFIER,
    CompareOptions,
    check_options,
)
from dflash_audit.audit.setup_error import EXIT_SETUP, CompareSetupError


def compare_command(
    ref: Annotated[Optional[str], typer.Option(  # noqa: UP007 (typer needs Optional)
        help="Reference: speculators@<branch|tag|sha> (git clone), speculators==X.Y.Z "
             "(release from the package index) or path:DIR. Default: reference/speculators.lock."
    )] = None,
    ref_url: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="Git URL (or local path / file://) for speculators@<ref>; also "
             "$DFLASH_AUDIT_REF_URL. Default: https://github.com/vllm-project/speculators.")
    ] = None,
    candidate: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="module:attr or path/to/file.py:attr (an object with run_case, or a factory), "
             "or framework:NAME[==VERSION] to audit a training framework's own DFlash code "
             "(specforge, modelopt, nemo, zlab; installed by the tool into its cache) or "
             "framework:speculators@REF|==X.Y.Z|:path:DIR (the reference at another ref or "
             "release). Default: dflash-audit's own drafter.")] = None,
    candidate_python: Annotated[Optional[str], typer.Option(  # noqa: UP007
        "--candidate-python", metavar="PATH",
        help="Run the candidate's process under this interpreter (an environment where the "
             "framework is installed; it must import torch; dflash_audit is put on its "
             "PYTHONPATH). Default: this interpreter.")] = None,
    profile: Annotated[str, typer.Option(
        help="Built-in profile (reference-model, reference-train-cli, zlab), a TOML file, or "
             "a drafter's config.json (speculators DFlash checkpoint or z-lab DFlash config).")
    ] = DEFAULT_PROFILE,
    cases: Annotated[int, typer.Option(help="Number of synthetic cases (seeded spread); the "
                                            "real cases of --rows come on top.")
                     ] = DEFAULT_CASES,
    verifier: Annotated[str, typer.Option(
        help="'smollm2-135m', a local Hugging Face causal-LM folder, family:NAME (a built-in "
             "proxy: llama, qwen3, qwen3_5, gemma3_text, mistral, gpt_oss, olmo3, glm4) or "
             "path/to/config.json (a proxy of your verifier: real depth and layer types, "
             "shrunk width).")] = DEFAULT_VERIFIER,
    data: Annotated[str, typer.Option(help="'chitchat' or a .jsonl conversation file.")
                    ] = DEFAULT_DATA,
    seq_len: Annotated[int, typer.Option(help="T, tokens per real packed row.")
                       ] = DEFAULT_SEQ_LEN,
    rows: Annotated[int, typer.Option(help="Real packed rows (0: synthetic cases only).")
                    ] = DEFAULT_ROWS,
    anchors: Annotated[int, typer.Option(
        help="Anchor slots A per real case (capped by the profile's max_anchors).")
    ] = DEFAULT_ANCHORS,
    seed: Annotated[int, typer.Option(help="Seeds data order, weights, anchors, cases.")
                    ] = DEFAULT_SEED,
    out: Annotated[Path, typer.Option(help="Folder that receives <UTC time>-<ref id>/.")
                   ] = Path("reports"),
    offline: Annotated[bool, typer.Option(
        help="Never contact a git remote or the package index (use caches).")] = False,
    weights: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="Folder of your drafter checkpoint (*.safetensors, speculators or z-lab keys): "
             "the real cases run on its weights instead of seeded random ones.")] = None,
    dtype: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="fp32 | bf16: both sides run in this dtype (bf16: fp32 master weights under bf16 "
             "autocast, as the reference trains; tolerances from the reference's measured "
             "bf16-vs-fp32 noise). Default: the profile's dtype (fp32).")] = None,
    device: Annotated[str, typer.Option(
        help="cpu | cuda: cuda runs both sides on the GPU with their flex-attention paths.")
    ] = "cpu",
    candidate_timeout: Annotated[Optional[float], typer.Option(  # noqa: UP007
        "--candidate-timeout", metavar="SECONDS", min=1.0,
        help="Seconds the candidate (in its own process) may take per case; a case over it "
             f"fails (exit 1). Default: ${CANDIDATE_TIMEOUT_ENV}, else "
             f"{DEFAULT_CANDIDATE_TIMEOUT_S:g} times the load average per core.")] = None,
    require_sandbox: Annotated[Optional[bool], typer.Option(  # noqa: UP007
        "--require-sandbox/--no-require-sandbox",
        help="Refuse (exit 2) when the candidate's sandbox (bubblewrap) cannot start. "
             "Default: on when CI=true, else off (the report then says 'candidate ran "
             "without a sandbox').")] = None,
    reference_cache: Annotated[bool, typer.Option(
        "--reference-cache/--no-reference-cache",
        help="Reuse the reference's outputs of identical cases, the built cases and the "
             "passed import check from the cache (signed, verified records; "
             "~/.cache/dflash-audit/reference-outputs, case-records, import-checks). "
             "--no-reference-cache recomputes all three and replaces the records.")] = True,
) -> None:
    """Audit a DFlash drafter against the real reference; write reports/<time>-<ref>/.

    Exit code 0: conformant (a PASS verdict written to report.json); 1: a check failed or
    the candidate raised, exited, crashed or timed out on a case; 2: a usage or setup error.
    """
    opts = CompareOptions(ref=ref, ref_url=ref_url, candidate=candidate, profile=profile,
                          cases=cases, verifier=verifier, data=data, seq_len=seq_len,
                          rows=rows, anchors=anchors, seed=seed, out=out, offline=offline,
                          weights=weights, dtype=dtype, device=device,
                          candidate_timeout_s=candidate_timeout,
                          candidate_python=candidate_python,
                          require_sandbox=require_sandbox, reference_cache=reference_cache)
    raise typer.Exit(main(opts))


def main(opts: CompareOptions) -> int:
    """Run :func:`run_compare`, print the verdict and the report folder; returns the exit
    code. Setup errors print one message (no traceback) and return 2; an internal error
    prints its traceback and returns 2 too (1 is reserved for conformance failures)."""
    try:
        from dflash_audit.audit.frameworks.registry import check_candidate_spec

        # before torch is imported: a bad option answers at once
        check_candidate_spec(opts.candidate)  # an unknown framework, a file not there
        check_options(opts)
        from dflash_audit.audit.compare import run_compare

        outcome = run_compare(opts)
    except CompareSetupError as exc:
        print(f"dflash-audit compare: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print("dflash-audit compare: interrupted", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - a bug of dflash-audit, not of the candidate
        traceback.print_exc()
        print("dflash-audit compare: internal error (a bug in dflash-audit; please report the "
              "traceback above)", file=sys.stderr)
        return EXIT_SETUP
    report = outcome.report
    checks = report.checks()
    failed = [c["name"] for c in checks if c["status"] == "fail"]
    warned = [c["name"] for c in checks if c["status"] == "warn"]
    by_adapter = sorted({".".join(filter(None, (r.name, (r.details or {}).get("layer_type"))))
                         for r in report.results if (r.details or {}).get("provenance")
                         and r.name not in failed})  # a FAIL there stays a FAIL: listed once
    unsupported = sum(1 for c in report.cases if c.layout.get("unsupported"))
    groups = [f"{len(report.cases)} cases, {len(checks)} checks"] + [
        f"{label}: {', '.join(names)}" for label, names in (
            ("failing", failed), ("warnings", warned),
            ("computed by the adapter, not audited", by_adapter)) if names]
    if unsupported:
        groups.append(f"{unsupported} cases not supported by the framework")
    if report.latent:
        groups.append(f"{len(report.latent)} latent differences of the framework (warnings)")
    line = (f"verdict: {report.verdict.upper()} ({'; '.join(groups)}) in "
            f"{report.timing.get('total', 0.0):.1f} s")
    print(line)
    _say_computed_ids(report.profile.get("fields") or {})
    if not report.candidate.get("sandbox", {}).get("sandboxed", True):
        print("  note: candidate ran without a sandbox (see report.json candidate.sandbox)")
    for latent in report.latent:  # every one, whatever the verdict: none is dropped
        print(f"  warning (latent): {latent.get('text')}")
    if report.verdict == "pass":  # what the warnings are, without opening report.md
        warnings = list(dict.fromkeys(d["cause"] for d in report.diagnoses()
                                      if d.get("status") == "warn"))
        for cause in warnings[:MAX_ROOT_CAUSES]:
            print(f"  warning: {cause}")
    causes = [d["cause"] for d in report.diagnoses() if d.get("status") == "fail"]
    roots = [d["cause"] for d in report.root_causes()] or causes[:3]
    for cause in roots[:MAX_ROOT_CAUSES]:  # the named root causes, grouped across cases
        print(f"  cause: {cause}")
    rest = [c for c in causes if c not in roots[:MAX_ROOT_CAUSES]]
    if rest:
        kinds = [k for k, hit in (
            ("more root causes", any(c in roots for c in rest)),
            ("consequences", any(c.startswith("follows from") for c in rest)),
            ("unexplained differences", any(c.startswith("unexplained") for c in rest))) if hit]
        what = f" ({', '.join(kinds)})" if kinds else ""
        print(f"  ... {len(rest)} more{what} in report.md")
    command = train_command(opts) if report.verdict == "pass" else None
    if command:
        print(f"next: {command}")
        print(f"  ({TRAIN_COST})")
    elif report.verdict != "pass":
        print(f"next: {FAIL_NEXT}")
    print(f"report: {outcome.folder}")
    return guarded_exit_code(outcome.exit_code, outcome.folder)


def _say_computed_ids(fields: dict) -> None:
    """Print a note when the profile's target layer ids were computed from a drafter config
    that names none (z-lab's rule), as ``check-batches`` says it too."""
    from dflash_audit.profile_import import ids_computed

    if ids_computed(fields.get("target_layers_origin", "")):
        print(f"  note: target layer ids {fields.get('target_layers')}: "
              f"{fields['target_layers_origin']}")


#: Said after a FAIL's causes: what to do, and where every difference is.
FAIL_NEXT = ("fix the cause(s) above in the candidate (every difference, case by case, and "
             "the hypotheses behind each cause: report.md in the folder below), then run this "
             "compare again; `dflash-audit train` starts only after it passes")

#: The run folder the printed train command names (the person picks their own).
TRAIN_OUT = "runs/drafter"
#: Said under it: what the printed command's defaults cost, and where a sized recipe is.
TRAIN_COST = ("train's defaults: 300 steps of 1024-token rows captured online, then an "
              "evaluation on 32 held-out prompts; on a CPU see --steps, --seq-len, --batches, "
              "--no-eval and the README's 2-core recipe (Training, after the audit)")


def train_command(opts: CompareOptions) -> str | None:
    """The ``dflash-audit train`` command (shell-quoted) whose gate finds this audit's report:
    the same ``--profile``, ``--candidate``, ``--ref`` and ``--verifier`` (when not the
    defaults), ``--reports-dir`` = compare's ``--out`` (when not ``reports``), the audited
    ``--data`` and ``--out`` :data:`TRAIN_OUT`. None for a framework candidate (audited, not
    trained here). The reverse of :func:`dflash_audit.train.gate.compare_command`."""
    import shlex

    from dflash_audit.audit.frameworks.registry import is_framework_spec

    if is_framework_spec(opts.candidate):
        return None
    parts = ["dflash-audit", "train", "--profile", opts.profile]
    for flag, value, default in (("--candidate", opts.candidate, None),
                                 ("--ref", opts.ref, None),
                                 ("--verifier", opts.verifier, DEFAULT_VERIFIER),
                                 ("--reports-dir", str(opts.out), "reports")):
        if value is not None and value != default:
            parts += [flag, value]
    return shlex.join([*parts, "--data", opts.data, "--out", TRAIN_OUT])


#: Named root causes a FAIL's terminal summary lists before pointing to report.md.
MAX_ROOT_CAUSES = 8


def guarded_exit_code(code: int, folder: Path) -> int:
    """The last guard of the gate: 0 only when ``folder/report.json`` exists and its verdict
    is ``pass``; otherwise a 0 becomes 2 with a message (a bug: no verdict was written)."""
    import json

    if code != 0:
        return code
    try:
        verdict = json.loads((Path(folder) / "report.json").read_text()).get("verdict")
    except (OSError, ValueError, AttributeError) as exc:
        verdict = f"unreadable ({exc})"
    if verdict == "pass":
        return 0
    print(f"dflash-audit compare: error: no PASS verdict in {folder}/report.json (verdict: "
          f"{verdict}); refusing to exit 0", file=sys.stderr)
    return EXIT_SETUP
