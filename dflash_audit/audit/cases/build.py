"""The cases stage of a compare: the profile checked against the verifier, the real batches
(captured and cached, :mod:`.real_inputs`) and the synthetic cases (:mod:`.plan`), in the
audit's dtype and device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_audit.audit.options import MAX_BLOCK_SIZE, CompareOptions
from dflash_audit.audit.progress import Stages
from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.data.verifier import ResolvedVerifier, resolve_verifier
from dflash_audit.user_input import loads_json


def plan_cases(opts: CompareOptions, profile: Any, st: Stages,
               before_capture: Callable[[], None] | None = None, *,
               capabilities: Any = None, framework_label: str = "", case_cache: Any = None
               ) -> tuple[list[Any], dict[str, Any]]:
    """The real cases (``--rows`` captured rows, cached) and the synthetic ones, plus the
    report's ``inputs`` section. ``before_capture`` runs before a verifier capture (the compare
    awaits the reference's import check there, so a broken reference costs no capture).
    ``capabilities`` (a framework's :class:`~dflash_audit.audit.frameworks.capabilities.
    Capabilities`, named ``framework_label``): the cases are those it supports
    (:func:`dflash_audit.audit.cases.supported.framework_cases`), ``inputs["unsupported"]``
    lists what was cut or left out and ``inputs["latent_exercised"]`` which cases needed each
    capability the framework lacks ({capability: [case names]}). ``case_cache`` (a
    :class:`~dflash_audit.audit.cases.case_records.CaseCache`): the cases come from its
    trusted record when there is one, else they are built and stored there (not with
    ``--weights``); ``inputs["case_cache"]`` says which.

    Raises:
        CompareSetupError: bad verifier, data, layer ids, mask token, or a profile that does
            not fit the verifier; a framework that can run none of the cases.
    """
    from dflash_audit.audit.cases.real_inputs import load_real_inputs
    from dflash_audit.audit.cases.user_weights import (
        UserWeightsError,
        load_user_weights,
    )
    from dflash_audit.data.errors import DataError
    from dflash_audit.model.config import ConfigError
    from dflash_audit.profile import ProfileError

    planned, info, fit_note = [], {}, None
    if profile.block_size > MAX_BLOCK_SIZE or (opts.rows and profile.block_size >= opts.seq_len):
        raise CompareSetupError(
            f"block_size {profile.block_size}: the audit takes block sizes up to "
            f"{MAX_BLOCK_SIZE} and below --seq-len ({opts.seq_len}; a block that does not fit "
            "a row leaves no anchor, and synthetic cases grow as block_size squared)")
    if opts.weights is not None and not opts.rows:
        raise CompareSetupError("--weights needs real cases (--rows >= 1): the synthetic cases "
                                "have tiny dimensions a checkpoint cannot fit")
    try:
        user = load_user_weights(opts.weights) if opts.weights is not None else None
        with st.stage("verifier_config", "checking the profile against the verifier"):
            verifier = resolve_verifier(opts.verifier, progress=st.say)  # once per compare
            try:  # before any capture, with or without --rows (issue 9)
                profile_fits_verifier(profile, verifier)
            except ProfileError as exc:
                raise CompareSetupError(
                    f"{exc}; {verifier_hint(profile, opts.verifier)}") from None
            if capabilities is not None:  # e.g. one target layer per draft layer (ModelOpt)
                from dflash_audit.audit.cases.supported import fitted_profile

                profile, fit_note = fitted_profile(profile, capabilities, verifier.num_layers,
                                                   framework_label)
        if opts.rows:
            with st.stage("batches", "real batches (verifier + data)"):
                # a style the data pipeline cannot resolve alone (per-draft-layer needs the
                # draft depth) goes as the profile's ids
                layers = (profile.resolve_target_layer_ids(verifier.num_layers)
                          if profile.target_layers == "per-draft-layer"
                          else profile.target_layers)
                real = load_real_inputs(verifier, opts.data, opts.seq_len, opts.rows,
                                        layers, seed=opts.seed,
                                        cache_root=opts.cache_dir, progress=st.say,
                                        before_capture=before_capture)
            first = real.batches[0]
            info = {"verifier": real.verifier, "data": real.data, "seq_len": opts.seq_len,
                    "rows": len(real.batches), "rows_requested": opts.rows,
                    "target_layer_ids": first.target_layer_ids,
                    "mask_token_id": first.mask_token_id,
                    "mask_token_reason": first.metadata.get("mask_token_reason"),
                    "batch_cache": {"key": real.cache_key, "hit": real.cache_hit,
                                    "dir": str(real.cache_dir)},
                    "data_stats": real.stats}
        with st.stage("cases", "building cases"):
            cache = case_cache if opts.weights is None else None
            frozen = real.frozen if opts.rows else {}
            found = cache.lookup(_cases_fields(opts, profile, verifier, real if opts.rows
                                               else None, capabilities, framework_label),
                                 _environment(opts.device), frozen) if cache else None
            if found is not None:
                planned, extra = found
            else:
                planned, extra = _build(opts, profile, real if opts.rows else None, user,
                                        capabilities, framework_label, fit_note)
                if cache is not None:
                    cache.store(planned, extra, frozen)
            info.update(extra)
            if cache is not None:
                info["case_cache"] = cache.summary()
    except UserWeightsError as exc:
        raise CompareSetupError(str(exc)) from None
    except (DataError, ProfileError, ConfigError, ValueError) as exc:
        raise CompareSetupError(f"building the audit cases failed: {exc}") from None
    if opts.weights is not None:
        info["weights"] = str(Path(opts.weights).expanduser().resolve())
    info.update({"audited_anchors": min(opts.anchors, profile.max_anchors),
                 "synthetic_cases": opts.cases, "seed": opts.seed, "cases": len(planned)})
    return planned, info


def _cases_fields(opts: CompareOptions, profile: Any, verifier: ResolvedVerifier, real: Any,
                  capabilities: Any, framework_label: str) -> dict[str, Any]:
    """What shapes an audit's cases, for :func:`dflash_audit.audit.cases.case_records.
    cases_key` (with the tool's source and the libraries)."""
    from dflash_audit.atomic import file_sha256

    config = Path(verifier.folder) / "config.json"
    return {"profile": profile.to_dict(), "profile_name": profile.name,
            "options": {k: getattr(opts, k) for k in ("cases", "anchors", "seed", "rows",
                                                      "seq_len", "device", "verifier", "data")},
            "dtype": opts.dtype or profile.dtype, "verifier_folder": str(verifier.folder),
            "verifier_config": file_sha256(config) if config.is_file() else None,
            "real": None if real is None else {"batches": real.cache_key,
                                               "verifier": real.verifier,
                                               "verifier_dir": str(real.verifier_dir)},
            "capabilities": None if capabilities is None else capabilities.to_dict(),
            "framework": framework_label}


def _environment(device: str) -> dict[str, Any]:
    import torch

    from dflash_audit.audit.sides.reference_records import environment_fields

    return environment_fields(device, torch.get_num_threads())


def _build(opts: CompareOptions, profile: Any, real: Any, user: Any, capabilities: Any,
           framework_label: str, fit_note: str | None) -> tuple[list[Any], dict[str, Any]]:
    """The cases built: real ones (``real``: the loaded batches, None without rows),
    synthetic or a framework's supported ones, the flex padding case on CUDA, in the audit's
    dtype and device; and the report's ``inputs`` entries they add (``unsupported``)."""
    from dflash_audit.audit.cases.plan import (
        plan_flex_padding_case,
        plan_real_cases,
        plan_synthetic_cases,
    )
    from dflash_audit.audit.precision import in_dtype

    planned, extra = [], {}
    if real is not None:
        planned += plan_real_cases(profile, real, opts.anchors, seed=opts.seed,
                                   user_weights=user, weights_source=str(opts.weights))
    if capabilities is not None and capabilities != type(capabilities)():
        from dflash_audit.audit.cases.supported import framework_cases, nothing_runs

        exercised: dict[str, list[str]] = {}
        planned, notes = framework_cases(planned, profile, opts.cases, opts.seed,
                                         capabilities, framework_label,
                                         opts.dtype or profile.dtype, exercised)
        idle = nothing_runs(planned, capabilities, framework_label, opts.dtype or profile.dtype)
        if idle:  # only warnings would be left: never a PASS
            raise CompareSetupError(idle)
        if fit_note:  # every drafter was deepened to one target layer per layer
            exercised.setdefault("any_target_layer_count", []).extend(
                p.case.name for p in planned)
        extra["unsupported"] = ([fit_note] if fit_note else []) + notes
        extra["latent_exercised"] = exercised
    else:
        planned += plan_synthetic_cases(profile, opts.cases, seed=opts.seed)
    if opts.device == "cuda" and capabilities is not None:  # fitted like the rest
        from dflash_audit.audit.cases.supported import framework_flex_case

        planned.append(framework_flex_case(profile, capabilities, framework_label, opts.seed,
                                           opts.dtype or profile.dtype))
    elif opts.device == "cuda":  # Q and T+Q past and off the flex block size
        planned.append(plan_flex_padding_case(profile, seed=opts.seed))
    rounded: dict[int, Any] = {}  # real cases keep sharing one weights dict
    planned = [dataclasses.replace(p, case=in_dtype(p.case, opts.dtype or profile.dtype,
                                                    opts.device, rounded)) for p in planned]
    return planned, extra


def verifier_hint(profile: Any, verifier: str) -> str:
    """What to do when the profile's target layers do not exist in ``verifier``: name the
    verifier depth a drafter config.json was made for (its ``num_target_layers``)."""
    made_for = ""
    source = Path(str(profile.source or ""))
    if source.suffix == ".json" and source.is_file():
        try:
            depth = loads_json(source.read_text()).get("num_target_layers")
        except (OSError, ValueError, AttributeError):
            depth = None
        if isinstance(depth, int):
            made_for = f" ({source.name} was made for a {depth}-layer verifier)"
    return (f"audit the drafter with the verifier it was made for{made_for}: --verifier "
            f"path/to/that/verifier/config.json (a proxy at its depth) or its folder, instead of "
            f"{verifier}")


def profile_fits_verifier(profile: Any, verifier: ResolvedVerifier) -> list[int]:
    """The profile's target layer ids for the verifier, from its ``config.json`` only (no
    weights loaded): what a real capture would refuse is refused without real rows too.

    Raises:
        ProfileError: an id or a mask token the verifier does not have; ValueError: its
            config.json gives no ``num_hidden_layers``.
    """
    if verifier.num_layers is None:
        raise ValueError(f"{verifier.folder / 'config.json'} has no num_hidden_layers")
    if verifier.vocab_size is not None:
        profile.check_mask_token(verifier.vocab_size, verifier.spec)
    return profile.resolve_target_layer_ids(verifier.num_layers)
