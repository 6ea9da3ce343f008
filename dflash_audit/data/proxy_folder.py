"""A verifier proxy as a Hugging Face folder, so the data pipeline and the reference take it
like any verifier folder: ``--verifier family:NAME`` or ``--verifier path/to/config.json``.

The proxy (:mod:`dflash_audit.data.families`: real depth and layer types, rope, norm
convention, head_dim, eps, activation; width shrunk) is built on demand and cached by the hash
of its config under ``<cache>/verifiers/proxy-<hash>/`` (``config.json``, seeded random
weights, tokenizer).

Tokenizer: a proxy reuses the built-in verifier's (SmolLM2-135M-Instruct) tokenizer and chat
template, and its vocabulary is widened to that tokenizer's 49152 ids (bos / eos / pad taken
from it), so real conversations tokenize, pack and capture exactly as with a real verifier.
The user's own tokenizer is not needed (and usually not available offline); the drafter's
behaviour under test does not depend on which text the token ids spell.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_audit.atomic import atomic_folder
from dflash_audit.data.errors import VerifierError

#: Bumped when the folder layout or the weight init changes (invalidates cached proxies).
PROXY_FORMAT = 1
PROXY_SEED = 0
#: Verifier depth of a ``family:NAME`` proxy (the synthetic spread's N).
FAMILY_LAYERS = 12


def is_proxy_spec(spec: str) -> bool:
    """Whether a ``--verifier`` spec names a proxy: ``family:NAME`` or a ``.json`` file (a
    path the OS refuses, e.g. too long, is none)."""
    try:
        return spec.startswith("family:") or (spec.endswith(".json") and Path(spec).is_file())
    except OSError:
        return False


def proxy_name(spec: str) -> str:
    """The verifier name of a proxy spec in reports: ``family:gemma3_text`` or
    ``proxy:<config file name's folder>/<file>``."""
    if spec.startswith("family:"):
        return spec
    path = Path(spec).expanduser().resolve()
    return f"proxy:{path.parent.name}/{path.name}"


def check_proxy_spec(spec: str) -> Any:
    """The proxy's transformers config (width not yet widened to the tokenizer) for a
    ``family:NAME`` or ``config.json`` spec, None for any other spec: a cheap check (no
    weights, no tokenizer) of what :func:`proxy_verifier_dir` would refuse later.

    Raises:
        VerifierError: unknown family, or a config.json a proxy cannot be built from.
    """
    from dflash_audit.data.families import FAMILIES, FamilyError, resolve_verifier_spec

    if spec.startswith("family:") and spec.split(":", 1)[1] not in FAMILIES:
        raise VerifierError(f"--verifier {spec}: unknown verifier family; use one of "
                            f"{', '.join('family:' + f for f in FAMILIES)}")
    if not is_proxy_spec(spec):
        return None
    try:
        return resolve_verifier_spec(spec, num_hidden_layers=FAMILY_LAYERS)
    except (FamilyError, TypeError, ValueError) as exc:
        raise VerifierError(f"verifier {spec!r}: {exc}") from None


def _proxy_config(spec: str, tokenizer: Any) -> Any:
    config = check_proxy_spec(spec)
    config.vocab_size = len(tokenizer)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if hasattr(config, key) and value is not None:
            setattr(config, key, int(value))
    return config


def _tested_proxy(config: Any, spec: str) -> Any:
    """The proxy model of ``config``, built, run on 4 tokens (twice: the last one changed,
    which must not change the earlier outputs) and our drafter config derived from its
    config, so an architecture the proxy cannot build or run, that is not causal (BERT), or
    that DFlash cannot derive from is refused before it is cached, not as a traceback in the
    middle of the audit or an audit of a verifier that sees the future.

    Raises:
        VerifierError: the build, forward or derivation raised, or the model is not causal
            (model_type and error named).
    """
    import torch

    from dflash_audit.data.families import build_proxy, one_line
    from dflash_audit.model.config import DFlashConfig

    ids = torch.arange(3, 7)[None]
    try:
        model = build_proxy(config, seed=PROXY_SEED)
        with torch.no_grad():
            logits = model(ids).logits
            later_changed = model(torch.cat([ids[:, :-1], ids[:, -1:] + 1], 1)).logits
        DFlashConfig.from_verifier_config(config, target_layer_ids=[0], mask_token_id=0)
    except Exception as exc:  # noqa: BLE001 - transformers' modeling code of any family
        raise VerifierError(f"verifier {spec!r}: a proxy of model_type "
                            f"{getattr(config, 'model_type', '?')!r} cannot run or derive a "
                            f"drafter config ({type(exc).__name__}: {one_line(exc)}); this "
                            "architecture is not supported, use --verifier family:NAME for "
                            "the closest supported family") from None
    # MoE expert kernels reorder fp32 sums (~1e-7); attending to a later token moves ~1e-3
    if not torch.allclose(logits[:, :-1], later_changed[:, :-1], rtol=1e-4, atol=1e-5):
        raise VerifierError(f"verifier {spec!r}: model_type {config.model_type!r} is not a "
                            "causal LM (its outputs at earlier positions change with a later "
                            "token); DFlash drafts for a causal verifier")
    return model


def proxy_verifier_dir(spec: str, progress: Callable[[str], None] | None = None
                       ) -> tuple[str, Path]:
    """``(name, folder)`` of the proxy verifier for ``spec``, built on first use.

    Raises:
        VerifierError: unknown family, unreadable or unknown config, an architecture whose
            proxy cannot be built or run, or the built-in verifier's tokenizer unavailable
            (its install command).
    """
    from transformers import AutoTokenizer

    from dflash_audit.data.builtin_verifier import (
        SMOLLM2_NAME,
        builtin_folder,
        cache_dir,
    )

    smollm2 = builtin_folder(SMOLLM2_NAME, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    config = _proxy_config(spec, tokenizer)
    key = hashlib.sha256(json.dumps({"format": PROXY_FORMAT, "seed": PROXY_SEED,
                                     "config": config.to_dict()}, sort_keys=True,
                                    default=str).encode()).hexdigest()[:16]
    folder = cache_dir() / "verifiers" / f"proxy-{key}"
    if not (folder / "config.json").is_file():
        if progress:
            progress(f"building the proxy verifier of {spec} into {folder}")
        with atomic_folder(folder, keep_existing=True) as tmp:
            _tested_proxy(config, spec).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "proxy.json").write_text(json.dumps({"spec": spec, "name": proxy_name(spec)}))
    return proxy_name(spec), folder
