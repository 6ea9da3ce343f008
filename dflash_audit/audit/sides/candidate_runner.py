"""Runs INSIDE the candidate's own process: the candidate on cases already written to disk.

Usage: ``python -m dflash_audit.audit.sides.candidate_runner CASES_DIR OUT_DIR --candidate SPEC
[--threads N] [--case NAME ...]``. Each sub-folder of CASES_DIR holding ``profile.json`` is one
case (:meth:`dflash_audit.audit.case.Case.write`); ``--case`` restricts the run to those names.
Cases whose result folder already exists in OUT_DIR are skipped (a restarted runner resumes).

Files written into OUT_DIR (the only channel to the parent, :mod:`.candidate_process`):

- ``started.json`` = ``{"case": NAME}``, replaced atomically before each case (the parent's
  per-case clock and the name of the case a crash or a hang belongs to);
- ``<case>/status.json`` = ``{"status": "ok" | "raised" | "exit" | "protocol", "summary",
  "traceback"}`` and, when ok, ``<case>/outputs.safetensors`` + ``outputs.json``
  (:meth:`SideOutputs.write`, read back with :meth:`SideOutputs.read` as the reference's are);
  the folder is published atomically, so it exists only once the case is complete;
- ``load_error.json`` = ``{"message"}`` when the candidate cannot be loaded (exit code 3);
  with ``--framework`` (a framework adapter, ``--candidate framework:NAME``) also when the
  framework cannot import a module -- loading the adapter, importing the modules its
  ``FRAMEWORK_MODULES`` names (before any case), or inside a case -- then with
  ``"missing_module"`` and ``"importer"`` (file:line of the import) added: a setup error of
  the audit (the adapter's REQUIREMENTS or the environment), never a conformance failure;
- ``candidate.json`` = ``{"name", "class", "source_files", "has_select_anchors"}`` once it is
  loaded (so the parent never imports the candidate: its name and the files its fingerprint
  hashes come from here). ``--load-only`` stops there (a cheap setup check). ``--wait`` then
  imports a framework's ``FRAMEWORK_MODULES`` (after the identity, while the parent builds the
  cases; without ``--wait`` they are imported before it), writes ``ready.json`` and
  blocks on its stdin until the parent writes one line, the JSON list of the cases to run (once
  they are written: one process per audit loads the candidate and runs its cases,
  :class:`.candidate_load.WaitingCandidate`); an empty line or end of input ends it.

A file candidate's folder is first on ``sys.path`` (its sibling modules import, as when the
file runs as a script). The candidate's stdout and stderr go wherever the parent points this
process's (files); a segfault prints the Python stack to stderr (``faulthandler``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

EXIT_LOAD_ERROR = 3
HEARTBEAT = "started.json"
STATUS = "status.json"
LOAD_ERROR = "load_error.json"
IDENTITY = "candidate.json"
READY = "ready.json"


def import_failure(exc: BaseException) -> dict[str, str] | None:
    """``{"missing_module", "importer", "error"}`` of an ImportError (ModuleNotFoundError
    included) at or under ``exc`` (its ``__cause__`` / ``__context__`` chain); None when
    there is none. ``importer`` is the ``file:line`` of the last frame outside importlib
    (frozen or not), or ``"the adapter's FRAMEWORK_MODULES"`` when that frame is
    :func:`import_framework_modules` (the adapter lists a module that is not there)."""
    import importlib

    machinery = os.path.dirname(importlib.__file__) + os.sep
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ImportError):
            frames = [f for f in traceback.extract_tb(exc.__traceback__)
                      if not f.filename.startswith(("<frozen", machinery))]
            name = exc.name or (str(exc).split("'")[1] if str(exc).count("'") >= 2 else "?")
            importer = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            if frames and frames[-1].name == import_framework_modules.__name__ and \
                    os.path.abspath(frames[-1].filename) == os.path.abspath(__file__):
                importer = "the adapter's FRAMEWORK_MODULES"
            return {"missing_module": name, "importer": importer,
                    "error": f"{type(exc).__name__}: {exc}"}
        exc = exc.__cause__ or exc.__context__
    return None


def import_framework_modules(spec: str | None) -> None:
    """Import every module the adapter module of ``spec`` lists in ``FRAMEWORK_MODULES`` (the
    framework code its ``run_case`` imports lazily), so an import that fails does so before
    any case.

    Raises:
        ImportError: one of them (or what it imports) cannot be imported.
    """
    import importlib

    module = sys.modules.get((spec or "").rpartition(":")[0])
    for name in getattr(module, "FRAMEWORK_MODULES", None) or ():
        importlib.import_module(name)


def framework_load_error(spec: str | None, out_dir: Path) -> int | None:
    """Import the ``FRAMEWORK_MODULES`` of ``spec`` (:func:`import_framework_modules`): None
    when they import; else ``load_error.json`` written (a module that cannot be imported: it
    and its importer, :func:`import_failure`; one that raised something else while it was
    imported: that exception, one line) and :data:`EXIT_LOAD_ERROR` returned."""
    try:
        import_framework_modules(spec)
    except Exception as exc:  # noqa: BLE001 - a framework's module failing at its import
        what = "" if isinstance(exc, ImportError) else " while importing FRAMEWORK_MODULES"
        write_json_atomic(out_dir / LOAD_ERROR, {
            "message": f"{type(exc).__name__}{what}: {exc}", **(import_failure(exc) or {})})
        return EXIT_LOAD_ERROR
    return None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary sibling and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_one(candidate: Any, case: Any) -> tuple[dict[str, Any], Any]:
    """Run the candidate on one case: cloned inputs on the case's device, torch seed 0, the
    case's autocast (no ``run_case`` for a case outside a framework's capabilities,
    ``case.unsupported``) (bf16: fp32 master weights under bf16 autocast, as in training), outputs
    moved to the CPU; then K draws of its ``select_anchors`` and its ``derive_config`` for the
    case's verifier, when it has them.

    Returns:
        ``(status dict, SideOutputs | None)``; status ``"ok"``, ``"raised"`` (an exception,
        with its traceback and the causes :func:`dflash_audit.audit.sides.raised.name_raise` reads
        from its message), ``"exit"`` (``sys.exit`` inside the candidate) or ``"protocol"``
        (run_case returned something other than SideOutputs).
    """
    import torch

    from dflash_audit.audit.case import SideOutputs
    from dflash_audit.audit.precision import autocast, outputs_on_cpu
    from dflash_audit.audit.sides.anchor_draws import draw_anchors
    from dflash_audit.audit.sides.raised import name_raise

    inputs = {k: v.clone().to(case.device) for k, v in case.inputs.items()}
    weights = case.weights if case.device == "cpu" else {
        k: v.to(case.device) for k, v in case.weights.items()}
    torch.manual_seed(0)
    stage = "run_case"
    try:
        if case.unsupported:  # outside the framework's capabilities: no training step
            out = SideOutputs(tensors={}, metrics={}, structure={},
                              metadata={"unsupported": list(case.unsupported)})
        else:
            with autocast(case):
                out = candidate.run_case(case.config, case.loss, weights, inputs)
        if not isinstance(out, SideOutputs):
            return {"status": "protocol", "summary": f"run_case returned "
                    f"{type(out).__name__}, not SideOutputs", "traceback": ""}, None
        out.tensors = outputs_on_cpu(out.tensors)
        if callable(getattr(candidate, "select_anchors", None)):
            stage = "select_anchors"
            out.tensors.update(draw_anchors(candidate.select_anchors, case))
    except SystemExit as exc:
        return {"status": "exit", "summary": f"the candidate's {stage} called sys.exit"
                f"({exc.code!r})", "traceback": traceback.format_exc()}, None
    except Exception as exc:  # noqa: BLE001 - user code: a conformance failure, reported
        causes = name_raise(f"{type(exc).__name__}: {exc}", case.config)
        if stage == "select_anchors":
            causes.append("select_anchors(loss_mask [1,T], max_anchors, block_size[, generator]"
                          "[, document_ids]) must return (anchor_positions [A], anchor_valid [A])")
        status = {"status": "raised", "summary": f"the candidate's {stage} raised "
                  f"{type(exc).__name__}: {str(exc).strip()[:600]}",
                  "traceback": traceback.format_exc(), "diagnosis": causes}
        failure = import_failure(exc)
        if failure is not None:  # a framework's: a setup error (main); a candidate's: a FAIL
            status["import_failure"] = failure
        return status, None
    out.derivation = candidate_derivation(candidate, case)
    return {"status": "ok", "summary": "", "traceback": ""}, out


def candidate_derivation(candidate: Any, case: Any) -> dict[str, Any] | None:
    """The candidate's ``derive_config(verifier_config, config)`` for the case's verifier;
    None when the case has no verifier or the candidate no ``derive_config``;
    ``{"error": ...}`` when it raised or returned no dict (the ``derivation`` check fails);
    ``{"unsupported": ...}`` when it raised a ``NotSupported`` (:class:`.frameworks.kit.
    NotSupported`, or an adapter's own class of that name): the framework cannot derive a
    drafter for that verifier, which the check reports as a warning."""
    derive = getattr(candidate, "derive_config", None)
    if case.verifier is None or not callable(derive):
        return None
    try:
        fields = derive(case.verifier.config, case.config)
    except Exception as exc:  # noqa: BLE001 - user code: reported by the check
        if any(c.__name__ == "NotSupported" for c in type(exc).__mro__):
            return {"unsupported": str(exc).strip()[:600]}
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:600]}"}
    if not isinstance(fields, dict):
        return {"error": f"derive_config returned {type(fields).__name__}, not a dict"}
    return fields


def publish(out_dir: Path, name: str, status: dict[str, Any], outputs: Any) -> None:
    """Write one case's result folder ``out_dir/name`` atomically (status + outputs)."""
    from dflash_audit.atomic import atomic_folder

    with atomic_folder(out_dir / name) as tmp:
        if outputs is not None:
            try:
                outputs.write(tmp)
            except (TypeError, ValueError, RuntimeError) as exc:
                status = {"status": "protocol", "summary": f"the outputs cannot be written: "
                          f"{exc}", "traceback": traceback.format_exc()}
                for leftover in tmp.iterdir():
                    leftover.unlink()
        (tmp / STATUS).write_text(json.dumps(status))


#: Constants of a framework adapter module (dflash_audit.audit.frameworks) reported to the
#: parent: it never imports the adapter (the framework is importable only in this process).
ADAPTER_CONSTANTS = ("NAME", "VERSION", "PROVENANCE", "CAPABILITIES", "LATENT",
                     "REQUIREMENTS")


def identity(candidate: Any, spec: str | None) -> dict[str, Any]:
    """What the parent needs to know about the loaded candidate: its report name, class,
    source files (:func:`dflash_audit.report.fingerprint.candidate_source_files`), whether
    it has its own anchor sampler, and -- for a framework adapter module -- its contract
    constants (``adapter``: {NAME, VERSION, PROVENANCE, CAPABILITIES, LATENT, REQUIREMENTS}, JSON
    values) plus the files of the framework it imported (``framework_files``)."""
    from dflash_audit.report.fingerprint import candidate_source_files

    out = {"name": str(getattr(candidate, "name", None) or spec or type(candidate).__name__),
           "class": f"{type(candidate).__module__}.{type(candidate).__qualname__}",
           "source_files": [str(f) for f in candidate_source_files(candidate)],
           "has_select_anchors": callable(getattr(candidate, "select_anchors", None))}
    module = sys.modules.get((spec or "").rpartition(":")[0])
    if module is not None and all(hasattr(module, k) for k in ("NAME", "VERSION")):
        out["adapter"] = adapter_constants_json(module)
        files = getattr(module, "FRAMEWORK_FILES", None)
        if callable(files):
            out["source_files"] += [str(f) for f in files()]
    return out


#: The most characters an adapter's contract constants take as JSON (a literal LATENT of
#: every capability is a few kB).
MAX_CONSTANTS_CHARS = 1 << 20


def adapter_constants_json(module: Any) -> dict[str, Any]:
    """The :data:`ADAPTER_CONSTANTS` of an adapter module as JSON values (other objects as
    their ``str``), or ``{"error": why}`` when they cannot be (nested too deep, circular) or
    take more than :data:`MAX_CONSTANTS_CHARS`: the parent says so as a setup error."""
    try:
        text = json.dumps({k: getattr(module, k, None) for k in ADAPTER_CONSTANTS},
                          default=str)
    except (ValueError, TypeError, RecursionError) as exc:
        return {"error": f"its contract constants ({', '.join(ADAPTER_CONSTANTS)}) cannot be "
                         f"written as JSON ({type(exc).__name__}: {str(exc)[:200]}): declare "
                         "them as plain literals (lists, dicts, strings)"}
    if len(text) > MAX_CONSTANTS_CHARS:
        return {"error": f"its contract constants ({', '.join(ADAPTER_CONSTANTS)}) are larger "
                         f"than {MAX_CONSTANTS_CHARS} characters as JSON ({len(text)}): "
                         "declare them as short literals"}
    return json.loads(text)


#: The longest line of case names ``--wait`` reads from its stdin.
MAX_GO_LINE = 1 << 20


def await_cases() -> list[str] | None:
    """Block (no polling) on file descriptor 0 until the parent writes one line: the JSON list
    of the cases to run; None on an empty line, end of input or anything but a list of
    strings (read from the descriptor itself: the candidate's code may have replaced
    ``sys.stdin``)."""
    line = b""
    while not line.endswith(b"\n") and len(line) < MAX_GO_LINE:
        try:
            chunk = os.read(0, 65536)
        except OSError:
            return None
        if not chunk:
            break
        line += chunk
    try:
        names = json.loads(line.decode() or "null")
    except ValueError:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


def prefetch() -> None:
    """Import what reading the first case imports (transformers' ``AutoConfig`` and the
    modules every config class pulls in: ~2 s, :meth:`dflash_audit.audit.case.CaseVerifier.
    read`) while the parent is still building and writing the cases, so the candidate's
    clock starts on work. Best effort: a failure here is met again, and reported, where the
    case needs it."""
    try:
        from transformers import AutoConfig, LlamaConfig  # noqa: F401
    except Exception:  # noqa: BLE001 - raised again by the case that needs it
        pass


def die_with_parent() -> None:
    """On Linux, ask the kernel to SIGKILL this process when the compare that started it dies
    (``prctl(PR_SET_PDEATHSIG)``): a ``kill -9`` of compare leaves no candidate running."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request: follow it now
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """Load the candidate, run every pending case, write results; 0 when all cases ran
    (whatever their status), 3 when the candidate cannot be loaded (or, with
    ``--framework``, the framework cannot import a module: then the remaining cases are not
    run)."""
    parser = argparse.ArgumentParser(prog="python -m dflash_audit.audit.sides.candidate_runner")
    parser.add_argument("cases_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--candidate", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--case", action="append", default=None)
    parser.add_argument("--load-only", action="store_true")
    parser.add_argument("--wait", action="store_true",
                        help="after loading, wait for the JSON list of cases on stdin")
    parser.add_argument("--framework", action="store_true",
                        help="the candidate is a framework adapter: an import that fails is "
                             "a setup error (load_error.json), not a case's failure")
    args = parser.parse_args(argv)
    die_with_parent()
    faulthandler.enable()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from dflash_audit.audit.case import Case
    from dflash_audit.candidate import CandidateError, load_candidate

    if args.threads:
        torch.set_num_threads(args.threads)
    target = (args.candidate or "").rpartition(":")[0]
    if target.endswith(".py"):  # its sibling modules import, as when run as a script
        sys.path.insert(0, str(Path(target).resolve().parent))
    try:
        candidate = load_candidate(args.candidate)
    except CandidateError as exc:
        failure = import_failure(exc) if args.framework else None
        write_json_atomic(args.out_dir / LOAD_ERROR, {"message": str(exc), **(failure or {})})
        return EXIT_LOAD_ERROR
    # waiting: the identity first, so the parent builds the cases while the framework imports
    if args.framework and not args.wait and framework_load_error(args.candidate, args.out_dir):
        return EXIT_LOAD_ERROR
    write_json_atomic(args.out_dir / IDENTITY, identity(candidate, args.candidate))
    if args.load_only:
        return 0
    if args.wait:
        if args.framework and framework_load_error(args.candidate, args.out_dir):
            return EXIT_LOAD_ERROR
        prefetch()
        write_json_atomic(args.out_dir / READY, {})
        args.case = await_cases()
        if args.case is None:
            return 0
    names = sorted(p.name for p in args.cases_dir.iterdir() if (p / "profile.json").is_file())
    if args.case is not None:
        names = [n for n in names if n in set(args.case)]
    for name in names:
        if (args.out_dir / name).exists():
            continue
        write_json_atomic(args.out_dir / HEARTBEAT, {"case": name})
        status, outputs = run_one(candidate, Case.read(args.cases_dir / name))
        if args.framework and status.get("import_failure"):  # the framework cannot import
            write_json_atomic(args.out_dir / LOAD_ERROR, {
                "message": status["summary"], "case": name, **status["import_failure"]})
            return EXIT_LOAD_ERROR
        publish(args.out_dir, name, status, outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
