"""``dflash-audit serve-check CHECKPOINT --engine vllm|sglang|zlab``: what an engine will run
for a drafter checkpoint, computed by the engine's own code at its pinned version, against
what the drafter was trained as (the reference's and our drafter's reading of the same
folder), field by field and as the attention of one drafting step.

Data flow: checkpoint folder -> (reference probe, our reading) = trained; engine installed
into the tool's cache -> engine probe = served -> differences + attention rules -> report.

Exit codes: 0 no difference that can change what is drafted, 1 train-serve differences,
2 usage / setup errors (a folder without config or weights, an unknown engine or version,
a config the engine itself refuses, an engine that cannot be installed offline).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from dflash_audit.serve.engines import (
    PROBES,
    Engine,
    ServeCheckError,
    install_engine,
    probe_timeout,
    resolve_engine,
    run_probe,
)
from dflash_audit.user_input import loads_json


def _say(message: str) -> None:
    print(f"dflash-audit: {message}", file=sys.stderr, flush=True)


def verifier_folder(spec: str | None) -> Path | None:
    """The target's local folder: the built-in verifier's cached folder (``smollm2-135m``) or
    ``spec`` itself when it holds a ``config.json``; None otherwise (a hub id, nothing)."""
    from dflash_audit.data.builtin_verifier import BUILTIN_VERIFIERS, builtin_verifier_dir

    if not spec:
        return None
    path = builtin_verifier_dir(spec) if spec in BUILTIN_VERIFIERS else Path(spec).expanduser()
    return path if (path / "config.json").is_file() else None


def verifier_max_positions(spec: str | None) -> int | None:
    """The target's ``max_position_embeddings`` from its :func:`verifier_folder`, or None when
    it cannot be read."""
    path = verifier_folder(spec)
    if path is None:
        return None
    try:
        d = loads_json((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    d = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    value = d.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def drafting_summary(comparison: Any) -> dict[str, Any]:
    """The report's ``drafting`` entry of a :class:`~dflash_audit.serve.drafting.
    DraftingComparison`: ``differs`` when the served step's draft logits leave the fp32
    tolerance (the named served fields, and whether re-running training with them explains
    it), the acceptance lengths side by side."""
    step, acc = comparison.step, comparison.acceptance
    out: dict[str, Any] = {
        "engine": comparison.side, "verifier": comparison.verifier,
        "differs": not step.equal, "max_abs_diff": step.max_abs_diff,
        "tolerance": step.tolerance, "served_drafts": step.served_drafts,
        "trained_drafts": step.trained_drafts, "context_tokens": step.context_tokens}
    if not step.equal:
        why = "; ".join(step.differences) or "no served field differs (unexplained)"
        out["message"] = (f"one drafting step's draft logits differ by {step.max_abs_diff:.3g} "
                          f"(tolerance {step.tolerance:g}): {why}"
                          + (" -- training re-run with the served values reproduces the "
                             "engine's logits" if step.explained else ""))
    if acc is not None:
        out["acceptance_served"] = acc.served
        out["acceptance_trained_teacher_forced"] = acc.trained
        out["acceptance_prompts"] = acc.prompts
        out["acceptance_new_tokens"] = acc.max_new_tokens
    return out


def _served(eng: Engine, folder: Any, site: Path, notes: list[str]) -> Any:
    """The engine's record of the folder; when the engine refuses a speculators-format folder
    as such, its record of the adapter's z-lab-format conversion (noted), so the report still
    says what the engine would serve once converted."""
    from dflash_audit.serve.checkpoint import SPECULATORS

    served = run_probe(PROBES / eng.probe, folder.path, site, eng.label)
    if not served.refused or folder.format != SPECULATORS or eng.key == "zlab":
        return served
    import tempfile

    from dflash_audit.serve.probes.zlab_probe import ZLabRefused, write_zlab_folder

    with tempfile.TemporaryDirectory(prefix="dflash-serve-zlab-") as tmp:
        try:
            conversion = write_zlab_folder(folder.path, Path(tmp) / "zlab")
        except ZLabRefused:
            return served
        converted = run_probe(PROBES / eng.probe, Path(tmp) / "zlab", site, eng.label)
    if converted.refused:
        return served
    notes.append(f"{eng.label} cannot load this checkpoint as it is ({served.refused}); what "
                 "follows is what it serves of the same drafter written in z-lab's format "
                 f"by the adapter: {conversion[0]}")
    converted.notes += conversion[1:]
    converted.refused_as_is = served.refused
    return converted


def run_serve_check(checkpoint: str | Path, engine: str | Engine, *, ref: str | None = None,
                    verifier: str | None = None, offline: bool = False,
                    drafting: bool = True, prompts: int = 8, max_new_tokens: int = 32,
                    data: str = "chitchat", reference_cache: bool = True) -> Any:
    """Audit ``checkpoint`` as ``engine`` will serve it.

    Args:
        checkpoint: the drafter folder (speculators or z-lab format).
        engine: ``vllm`` / ``sglang`` / ``zlab`` (optionally ``==VERSION``) or an Engine.
        ref: the reference that tells what it was trained as (default: the pinned release).
        verifier: the target (a local HF folder or ``smollm2-135m``) whose context length
            bounds the served positions; default: the folder the checkpoint names.
        offline: use only the tool's cache (engine and reference).
        drafting: where the engine drafts on CPU (z-lab), also run one served drafting step
            against the training forward and measure acceptance (needs the verifier).
        prompts, max_new_tokens: the acceptance measurement's size.
        data: the conversations its held-out prompts come from (as ``eval --data``).
        reference_cache: take the reference's reading of the same config from its verified
            cache record (:mod:`dflash_audit.serve.reference_record`); False runs it again.

    Returns:
        The :class:`~dflash_audit.serve.report.ServeReport`.

    Raises:
        ServeCheckError: bad folder, unknown engine, engine not installable, the engine's
            own refusal of the config, a probe that failed.
    """
    from dflash_audit.serve import trained as trained_sides
    from dflash_audit.serve.checkpoint import SPECULATORS, read_checkpoint
    from dflash_audit.serve.differences import (
        DIFFERS,
        FIXES,
        Row,
        compare,
        complete_from_masks,
        layer_rules,
    )
    from dflash_audit.serve.report import ServeReport

    start = time.perf_counter()
    probe_timeout()  # a bad $DFLASH_AUDIT_PROBE_TIMEOUT is an error before any work
    folder = read_checkpoint(checkpoint)
    from dflash_audit.data.builtin_verifier import BUILTIN_VERIFIERS

    if verifier and verifier not in BUILTIN_VERIFIERS and verifier_folder(verifier) is None:
        raise ServeCheckError(f"--verifier {verifier}: no config.json there; give the target "
                              f"model's local folder or one of {', '.join(BUILTIN_VERIFIERS)}")
    eng = engine if isinstance(engine, Engine) else resolve_engine(engine)
    _say(f"checkpoint {folder.path} ({folder.format} format); engine {eng.label}")
    site = install_engine(eng, offline=offline)
    if folder.format == SPECULATORS:
        _say("reading it as the reference trains it ...")
        trained = trained_sides.reference(folder, ref, offline=offline, cache=reference_cache)
        ours = trained_sides.ours(folder)
    else:
        _say("reading it with z-lab's own model (the format's trainer) ...")
        zlab = resolve_engine("zlab")
        trained = run_probe(PROBES / zlab.probe, folder.path, install_engine(zlab, offline=offline),
                            zlab.label)
        ours = None
    if trained.refused:
        raise ServeCheckError(f"{trained.side} refuses this checkpoint ({trained.refused}): it "
                              "cannot have been trained as it is; fix the config it names")
    _say(f"asking {eng.label}'s own code what it will run ...")
    notes: list[str] = []
    served = _served(eng, folder, site, notes)
    if served.refused:
        raise ServeCheckError(f"{eng.label} refuses this checkpoint: {served.refused} (fix "
                              "the config field it names, or serve with another engine)")
    for record in (trained, ours, served):
        if record is not None:
            complete_from_masks(record)
    positions = verifier_max_positions(verifier or folder.verifier)
    rows = compare(trained, ours, served, eng.label, positions)
    rules = layer_rules(trained, served, eng.label)
    notes += [f"{served.side}: {n}" for n in served.notes] + [
        f"{trained.side}: {n}" for n in trained.notes]
    if served.refused_as_is:
        name = "checkpoint not loadable as it is"
        rows.insert(0, Row("checkpoint_format", folder.format, "zlab (converted)", DIFFERS,
                           f"{eng.label} cannot load this checkpoint as it is: "
                           f"{served.refused_as_is}", name, "the checkpoint's config.json",
                           served.refused_as_is, FIXES[name]))
    summary = None
    if drafting and eng.key == "zlab" and folder.format == SPECULATORS:
        summary = _drafting(folder, verifier, offline, prompts, max_new_tokens, notes, data)
    if positions is None:
        notes.append(f"the target's context length is unknown (no max_position_embeddings "
                     f"in {verifier}/config.json)" if verifier else
                     "the target's context length is unknown (pass --verifier DIR): the "
                     "rotary table size is not checked against it")
    sides = {r.side: r.to_dict() for r in (trained, ours, served) if r is not None}
    for side in sides.values():
        side.pop("masks", None)
    report = ServeReport(
        checkpoint=str(folder.path), checkpoint_format=folder.format,
        engine={"key": eng.key, "label": eng.label, "version": eng.version,
                "requirements": list(eng.requirements), "site": str(site),
                "adapter": f"dflash_audit/serve/probes/{eng.probe}"},
        rows=rows, rules=rules, sides=sides, drafting=summary, notes=notes)
    report.notes.append(f"serve-check took {time.perf_counter() - start:.1f} s")
    return report


def _drafting(folder: Any, verifier: str | None, offline: bool, prompts: int,
              max_new_tokens: int, notes: list[str], data: str = "chitchat"
              ) -> dict[str, Any] | None:
    """The drafting comparison's summary, or None (with a note) when the verifier is not at
    hand. Its prompts are ``eval``'s held-out prompts (:func:`~dflash_audit.train.evaluate.
    held_out_prompts`: the contexts of assistant turns of the last conversations of ``data``,
    which training draws from the start of)."""
    from dflash_audit.serve.drafting import compare_drafting

    named = verifier or folder.verifier
    local = verifier_folder(named)
    if local is None:
        why = (f"the verifier {named} is not a local folder" if named else
               "the checkpoint names no verifier")
        notes.append(f"the served drafting step and acceptance were not measured: {why} "
                     "(pass --verifier DIR)")
        _say(notes[-1])
        return None
    from transformers import AutoTokenizer

    from dflash_audit.data.conversations import load_conversations
    from dflash_audit.data.errors import DataError
    from dflash_audit.train.evaluate import held_out_prompts

    target = str(local)
    try:
        ids, _ = held_out_prompts(AutoTokenizer.from_pretrained(target),
                                  load_conversations(data).conversations, prompts)
        _say(f"drafting with z-lab's own code on {len(ids)} held-out prompts of {data} "
             f"({max_new_tokens} new tokens each) beside the training forward ...")
        return drafting_summary(compare_drafting(folder.path, target, prompts=ids or None,
                                                 num_prompts=prompts,
                                                 max_new_tokens=max_new_tokens,
                                                 offline=offline))
    except (ServeCheckError, DataError, OSError, ValueError) as exc:  # the static
        # comparison stands; say what did not run
        notes.append(f"the served drafting step and acceptance did not run: {exc}")
        _say(notes[-1])
        return None


def serve_check_command(
    checkpoint: Annotated[Path, typer.Argument(
        help="Drafter checkpoint folder: config.json + *.safetensors (speculators format, as "
             "`dflash-audit train` writes it, or a z-lab config).")],
    engine: Annotated[str, typer.Option(
        help="Serving engine: vllm (0.33.0), sglang (0.5.23) or zlab (dflash 0.1.0).")
    ] = "vllm",
    ref: Annotated[str | None, typer.Option(
        help="The reference that tells how it was trained (default: the pinned release).")
    ] = None,
    verifier: Annotated[str | None, typer.Option(
        help="The target model (local HF folder or smollm2-135m) whose context length the "
             "served drafter must cover; default: the one the checkpoint names.")] = None,
    offline: Annotated[bool, typer.Option(
        help="Use only the tool's cache for the engine and the reference.")] = False,
    reference_cache: Annotated[bool, typer.Option(
        "--reference-cache/--no-reference-cache",
        help="Reuse the reference's reading of the same config.json from the cache (a "
             "signed, verified record in the tool's cache, <cache>/serve-probes). "
             "--no-reference-cache runs the reference again and replaces the record.")] = True,
    drafting: Annotated[bool, typer.Option(
        help="zlab: also draft with the engine (one step vs the training forward, and "
             "acceptance on held-out prompts).")] = True,
    prompts: Annotated[int, typer.Option(help="Held-out prompts for the acceptance length.",
                                         min=1)] = 8,
    data: Annotated[str, typer.Option(
        help="Conversations the held-out prompts come from (chitchat, or a JSONL file), as "
             "`eval --data`.")] = "chitchat",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.", min=1)
                              ] = 32,
    out: Annotated[Path, typer.Option(help="Report folder parent.")] = Path("reports"),
) -> None:
    """What an engine will serve for a checkpoint (its own code, pinned) vs what the drafter
    was trained as. Exit 0 no train-serve difference, 1 differences, 2 setup error."""
    from dflash_audit.serve.report import write_report

    if out.exists() and not out.is_dir():
        raise ServeCheckError(f"--out {out} is a file: give the folder the report folder is "
                              "made in")
    report = run_serve_check(checkpoint, engine, ref=ref, verifier=verifier, offline=offline,
                             drafting=drafting, prompts=prompts, max_new_tokens=max_new_tokens,
                             data=data, reference_cache=reference_cache)
    folder = write_report(report, out)
    for line in report.summary_lines():
        print(line, file=sys.stderr)
    not_run = sum(r.status == "not run" for r in report.rows)
    print(f"serve-check ({report.engine['label']}): {report.verdict.upper()} "
          f"({len(report.rows)} fields, {len(report.differences)} differ"
          + (f", {not_run} not run here" if not_run else "")
          + f"; attention differs in {len(report.rule_differences)} of {len(report.rules)} "
          f"layers) report: {folder}", file=sys.stderr)
    raise typer.Exit(report.exit_code)
