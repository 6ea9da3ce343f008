"""Real audit inputs: captured verifier batches + the verifier's frozen weights, cached on disk.

Capturing hidden states needs the verifier forward (seconds); an audit with warm caches
skips it. One cache entry per key = sha256 of (verifier config.json, tokenizer and chat
template + weight files, data source bytes, seq_len, rows, target layers, seed, format
version), under
``<cache>/compare/batches/<key>/`` (``<cache>`` = ``$DFLASH_AUDIT_CACHE`` or
``~/.cache/dflash-audit``)::

    batch_00000.safetensors ...  the batches (dflash_audit.data.pipeline.write_batches)
    manifest.json                the pipeline's manifest
    frozen.safetensors           the verifier's frozen weights (dflash_audit.audit.cases.weights)
    inputs.json                  verifier identity and config, data identity, key fields

An entry is written to a temporary sibling and renamed, so a crash never leaves half of one.
A warm audit neither loads the verifier nor imports transformers: the verifier's (text)
config comes back from ``inputs.json`` as a namespace with the config's attributes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dflash_audit.atomic import atomic_folder, file_sha256
from dflash_audit.audit.cases.weights import (
    load_frozen,
    save_frozen,
    verifier_frozen_weights,
)
from dflash_audit.data.verifier import ResolvedVerifier

FORMAT_VERSION = 3
FROZEN_FILE = "frozen.safetensors"
META_FILE = "inputs.json"


@dataclass
class RealInputs:
    """Real batches (``dflash_audit.data.batch.Batch``), the verifier's frozen weights and
    config, and where they came from."""

    batches: list[Any]
    frozen: dict[str, Any]
    verifier_config: Any  # transformers config (cold) or a namespace of its fields (warm)
    verifier: dict[str, Any]  # VerifierIdentity.to_dict() + weights_sha256
    data: dict[str, Any]  # {"source", "sha256"}
    cache_key: str
    cache_hit: bool
    cache_dir: Path
    stats: dict[str, Any] = field(default_factory=dict)
    #: The verifier's folder (config.json, tokenizer): what the reference derives from.
    verifier_dir: Path | None = None


def data_identity(data: str) -> dict[str, Any]:
    """``{"source", "sha256"}`` of a conversation source (``chitchat`` or a file).

    Raises:
        dflash_audit.data.DataError: the source does not exist (the data pipeline's message).
    """
    from dflash_audit.data.conversations import (
        CHITCHAT,
        chitchat_path,
        load_conversations,
    )

    if data == CHITCHAT:
        return {"source": data, "sha256": file_sha256(chitchat_path())}
    path = Path(data).expanduser()
    if not path.is_file():
        load_conversations(data)  # raises the pipeline's error for an unknown source
    return {"source": str(path.resolve()), "sha256": file_sha256(path)}


def cache_key(verifier_folder: Path, weights_sha256: str, data: dict[str, Any], seq_len: int,
              rows: int, target_layers: Any, seed: int) -> str:
    """sha256 hex of everything that determines the captured batches: the verifier's weights
    and every other file of its folder (config, tokenizer, chat template:
    :func:`dflash_audit.data.verifier.config_files`), the data, the options."""
    from dflash_audit.data.verifier import config_files

    config_sha = file_sha256(Path(verifier_folder) / "config.json")
    fields = {"format": FORMAT_VERSION, "verifier_config": config_sha,
              "verifier_files": config_files(verifier_folder),
              "verifier_weights": weights_sha256, "data": data["sha256"],
              "seq_len": seq_len, "rows": rows, "target_layers": target_layers, "seed": seed}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def load_real_inputs(verifier: ResolvedVerifier, data: str, seq_len: int, rows: int, target_layers: Any,
                     seed: int = 0, cache_root: Path | None = None,
                     progress: Callable[[str], None] | None = None,
                     before_capture: Callable[[], None] | None = None) -> RealInputs:
    """Real batches for an audit, from the cache or built by the data pipeline.

    Args:
        verifier: the command's resolved verifier (:func:`dflash_audit.data.verifier.
            resolve_verifier`).
        data: ``chitchat`` or a ``.jsonl`` / ``.json`` conversation file.
        seq_len, rows: T and the number of packed rows.
        target_layers: ``"speculators"`` | ``"zlab"`` | list of ids (speculators convention).
        seed: the pipeline's conversation shuffle seed.
        cache_root: base of the cache (default: the user cache directory).
        progress: called with a line of text for slow steps (verifier load, capture).
        before_capture: called on a cache miss before the (expensive) capture, e.g. to wait
            for a check that must pass first; its exceptions propagate.

    Raises:
        dflash_audit.data.DataError: bad verifier / data / layer ids / mask token.
        VerifierWeightsError: the verifier has no embedding or final norm.
    """
    from dflash_audit.data.builtin_verifier import cache_dir
    from dflash_audit.data.pipeline import build_batches, load_batches, write_batches
    from dflash_audit.data.verifier import load_verifier
    from dflash_audit.data.verifier import weights_hash as folder_weights_hash

    ident = data_identity(data)  # fails fast on a missing source
    folder = verifier.folder
    weights_sha = folder_weights_hash(str(folder))
    tl = list(target_layers) if isinstance(target_layers, (list, tuple)) else target_layers
    key = cache_key(folder, weights_sha, ident, seq_len, rows, tl, seed)
    root = Path(cache_root) if cache_root is not None else cache_dir()
    entry = root / "compare" / "batches" / key
    if (entry / META_FILE).is_file():
        meta = json.loads((entry / META_FILE).read_text())
        return RealInputs(batches=load_batches(entry), frozen=load_frozen(entry / FROZEN_FILE),
                          verifier_config=SimpleNamespace(**meta["verifier_config"]),
                          verifier=meta["verifier"], data=meta["data"], cache_key=key,
                          cache_hit=True, cache_dir=entry, stats=meta.get("stats", {}),
                          verifier_dir=Path(folder))
    if before_capture is not None:
        before_capture()
    if progress:
        progress(f"capturing {rows} real batch(es) of {seq_len} tokens with {verifier.name} "
                 "(cached afterwards)")
    model = load_verifier(verifier, progress=progress)
    batches = build_batches(model, data, seq_len, rows, target_layer_ids=tl, seed=seed,
                            progress=False)
    frozen = verifier_frozen_weights(model.model)
    vid = {**model.identity.to_dict(), "weights_sha256": weights_sha}
    stats = batches[0].metadata.get("data_stats", {}) if batches else {}
    config = model.config
    meta = {"verifier": vid, "verifier_config": model.config.to_dict(), "data": ident,
            "key": key, "seq_len": seq_len, "rows": rows, "target_layers": tl, "seed": seed,
            "stats": stats}
    # another process that finished first keeps its entry
    with atomic_folder(entry, keep_existing=True) as tmp:
        write_batches(batches, tmp)
        save_frozen(frozen, tmp / FROZEN_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return RealInputs(batches=batches, frozen=frozen, verifier_config=config, verifier=vid,
                      data=ident, cache_key=key, cache_hit=False, cache_dir=entry, stats=stats,
                      verifier_dir=Path(folder))
