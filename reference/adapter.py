"""Runs INSIDE the reference's process: the real speculators DFlash code on prepared cases.

Imports only the resolved speculators source (on PYTHONPATH), torch, transformers and
safetensors. Never imports dflash_audit: what it reports is the reference's own behaviour.

Usage: ``python reference/adapter.py CASES_DIR``. Each sub-folder of CASES_DIR that holds
``inputs.safetensors``, ``weights.safetensors`` and ``profile.json`` is one case; the
adapter writes ``outputs.safetensors`` and ``outputs.json`` beside them.

inputs.safetensors: hidden_states [1,T,n*H], verifier_last_hidden_states [1,T,H],
    input_ids, loss_mask, position_ids, document_ids [1,T], anchor_positions [A] int64,
    anchor_valid [A] bool.
weights.safetensors: one state dict with the reference's key names.
profile.json: {"drafter": {...drafter config fields...}, "loss": {"loss", "weighting",
    "gamma", "dpace_alpha"}}.
outputs.safetensors: context [1,T,H]; mask.full_attention / mask.sliding_attention
    [Q,T+Q] bool; targets, logits [1,Q,V_d]; aligned_loss_mask [1,Q]; loss [];
    loss_weights.<term> [1,Q]; grad.<param> for every trainable parameter.
outputs.json: metrics (floats), structure (config, fc shape, state-dict keys/shapes/frozen),
    defaults of the reference's API, identity (version, module file).
derive.json (optional) {"verifier_dir", "num_layers", "sliding_window",
    "full_attention_indices"}: the adapter also runs the reference's drafter-config
    derivation of that verifier with the case's draft layout and writes derivation.json
    (see :func:`derive`), in the same process as the case.

On failure writes CASES_DIR/error.json {"kind", "message", "missing"} and exits 3.

Derivation mode: ``python reference/adapter.py --derive [--num-layers N] [--sliding-window W]
[--full-attention-indices I,J] VERIFIER_DIR...`` (defaults 1, 2048, "0": one full-attention
draft layer; "" makes every layer sliding). Runs the reference's own drafter-config
derivation on each VERIFIER_DIR/config.json (the training CLI's
``create_transformer_layer_config``, ``resolve_target_layer_ids``, ``get_target_vocab_size``,
``resolve_mask_token_id``, and the model's ``flatten_rope_parameters``, rotary embedding and
``resolve_verifier_norm_class``) and writes VERIFIER_DIR/derivation.json: one flat dict of
fields (see :func:`derive`), or {"error", "traceback"} where the reference's code raises.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from adapter_numerics import dense_mask_of, measure_noise  # noqa: E402 (beside this script)

SOURCE = os.environ.get("DFLASH_AUDIT_REFERENCE_SOURCE")


def fail(cases_dir: Path, kind: str, message: str, missing: list[str] | None = None) -> None:
    (cases_dir / "error.json").write_text(json.dumps(
        {"kind": kind, "message": message, "missing": missing or []}))
    print(f"reference adapter: {kind}: {message}", file=sys.stderr)
    sys.exit(3)


def ensure_distribution_metadata(source: Path) -> None:
    """speculators reads ``importlib.metadata.version("speculators")`` at import time; a git
    checkout has no installed metadata, so provide a minimal one (version from
    ``version.py`` when present)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("speculators")
        return
    except PackageNotFoundError:
        pass
    ver = "0.0.0+git"
    vfile = source / "speculators" / "version.py"
    if vfile.exists():
        scope: dict = {}
        exec(compile(vfile.read_text(), str(vfile), "exec"), scope)  # noqa: S102
        ver = str(scope.get("version", ver))
    site = Path(tempfile.mkdtemp(prefix="speculators-meta-"))
    dist = site / f"speculators-{ver}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\nVersion: {ver}\n")
    sys.path.append(str(site))


def import_reference(cases_dir: Path):
    """Import the reference's DFlash modules, checking they come from SOURCE."""
    if SOURCE:
        ensure_distribution_metadata(Path(SOURCE))
    try:
        import speculators
        from speculators.losses import resolve_loss_config
        from speculators.models.dflash import core
    except ModuleNotFoundError as err:
        fail(cases_dir, "missing_dependency", f"importing the reference needs {err.name!r}",
             [err.name or str(err)])
    except ImportError as err:
        fail(cases_dir, "api_mismatch", f"the reference does not provide what the adapter "
             f"imports: {err}")
    if SOURCE and not Path(speculators.__file__).resolve().is_relative_to(Path(SOURCE).resolve()):
        fail(cases_dir, "wrong_source", f"speculators was imported from {speculators.__file__}, "
             f"not from the resolved source {SOURCE}; uninstall the other copy")
    for name in ("DFlashDraftModel", "select_anchors"):
        if not hasattr(core, name):
            fail(cases_dir, "api_mismatch", f"speculators.models.dflash.core has no {name!r}")
    if not hasattr(core.DFlashDraftModel, "_backbone_forward"):
        fail(cases_dir, "api_mismatch",
             "DFlashDraftModel has no '_backbone_forward' (this ref's API is not supported)")
    return speculators, core, resolve_loss_config


def build_config(drafter: dict, work: Path):
    """A DFlashSpeculatorConfig for the profile's drafter fields (eager attention)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    rope = {"rope_type": "default", **(drafter.get("rope_parameters") or {}),
            "rope_theta": drafter["rope_theta"]}
    layer_types = drafter.get("layer_types") or ["full_attention"] * drafter["num_hidden_layers"]
    tl = Qwen3Config(
        hidden_size=drafter["hidden_size"], intermediate_size=drafter["intermediate_size"],
        num_hidden_layers=drafter["num_hidden_layers"],
        num_attention_heads=drafter["num_attention_heads"],
        num_key_value_heads=drafter["num_key_value_heads"], head_dim=drafter["head_dim"],
        vocab_size=drafter["vocab_size"], rms_norm_eps=drafter["rms_norm_eps"],
        max_position_embeddings=drafter["max_position_embeddings"],
        attention_bias=drafter["attention_bias"], hidden_act=drafter["hidden_act"],
        rope_parameters=rope, pad_token_id=drafter.get("pad_token_id"),
        layer_types=list(layer_types), sliding_window=drafter.get("sliding_window"),
        # as the reference's training CLI does; without it Qwen3Config drops sliding_window
        use_sliding_window="sliding_attention" in layer_types,
    )
    tl._attn_implementation = "eager"  # noqa: SLF001
    # The verifier's final-norm convention is resolved from its config's model_type.
    verifier_dir = work / "verifier_config"
    verifier_dir.mkdir(exist_ok=True)
    (verifier_dir / "config.json").write_text(json.dumps(
        {"model_type": drafter.get("verifier_model_type") or "llama",
         "architectures": ["VerifierForCausalLM"]}))
    block_size = drafter["block_size"]
    tokens = block_size if drafter["sample_from_anchor"] else block_size - 1
    return DFlashSpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=drafter.get("draft_vocab_size") or drafter["vocab_size"],
        block_size=block_size,
        aux_hidden_state_layer_ids=list(drafter["target_layer_ids"]),
        mask_token_id=drafter["mask_token_id"],
        sliding_window_non_causal=drafter["sliding_window_non_causal"],
        sample_from_anchor=drafter["sample_from_anchor"],
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(verifier_dir),
                                    architectures=["VerifierForCausalLM"]),
        ),
    )


def api_defaults(core) -> dict:
    """Default values of the reference's model API (forward and trainer kwargs)."""
    sig = inspect.signature(core.DFlashDraftModel.forward)
    defaults = {k: p.default for k, p in sig.parameters.items()
                if p.default is not inspect.Parameter.empty and k != "loss_config"
                and isinstance(p.default, (int, float, str, bool))}
    block = core.DFlashSpeculatorConfig.model_fields["block_size"].default
    defaults["block_size"] = block
    defaults["loss_when_unset"] = "kl_div (fused)"
    return defaults


#: Profile values the reference has no equivalent for, and what it runs instead (reported in
#: outputs.json ``defaults.runs_instead``; the audit's ``defaults`` check names them).
NO_DECAY = ("the reference has no weighting 'none': it ran fixed-exp-decay with gamma = inf "
            "(weights 0, 1, 1, ...: the same per-slot weights)")
DATA_CE = ("the reference has no loss 'ce-data' (CE against the data tokens input_ids[a+s]): "
           "it ran its 'ce' against the argmax of the verifier's logits instead")


def reference_loss_spec(loss_spec: dict) -> tuple[dict, dict, dict]:
    """The loss the reference runs for a profile's ``loss_spec``, the reference's name of each
    profile term (``{reference name: profile name}``) and what it runs instead of a value it
    lacks (``{field: sentence}``): weighting ``none`` -> ``fixed-exp-decay`` with
    ``gamma = inf`` (``losses/utils.py:17-48`` then gives exp(-0) = 1 on slots >= 1, 0 at slot
    0), loss ``ce-data`` -> ``ce`` (``losses/eager.py``: CE against argmax(targets))."""
    spec, instead = dict(loss_spec), {}
    if spec["weighting"] == "none":
        spec.update(weighting="fixed-exp-decay", gamma=float("inf"))
        instead["weighting"] = NO_DECAY
    try:
        mix = json.loads(spec["loss"])
    except json.JSONDecodeError:
        mix = {spec["loss"]: 1.0}
    if not isinstance(mix, dict):
        mix = {spec["loss"]: 1.0}
    names = {("ce" if n == "ce-data" else n): n for n in mix}
    if "ce-data" in mix:
        instead["loss"] = DATA_CE
        renamed = {("ce" if n == "ce-data" else n): c for n, c in mix.items()}
        spec["loss"] = "ce" if len(renamed) == 1 else json.dumps(renamed)
    return spec, names, instead


def train_step(case: Path, profile: dict, inputs: dict, weights: dict, core,
               resolve_loss_config, low_dtype, device: str):
    """One forward + backward of the reference on a case, under ``torch.autocast(device,
    low_dtype)`` when ``low_dtype`` is set (fp32 master weights, as its trainer runs bf16).
    Returns (output tensors on CPU, metrics, model, missing keys, unexpected keys)."""
    import contextlib

    import torch

    drafter = profile["drafter"]
    loss_spec, term_names, _ = reference_loss_spec(profile["loss"])
    torch.manual_seed(0)
    config = build_config(drafter, case)
    if device != "cpu":  # the reference's own flex-attention path (its default)
        config.transformer_layer_config._attn_implementation = (  # noqa: SLF001
            "simple_flex_attention")
    model = core.DFlashDraftModel(config).float()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    model.to(device).train()
    inputs = {k: v.to(device) for k, v in inputs.items()}

    anchors, valid = inputs["anchor_positions"], inputs["anchor_valid"].bool()
    select = core.select_anchors
    core.select_anchors = lambda loss_mask, n, block_size: (anchors.clone(), valid.clone())

    captured: dict = {"masks": {}, "decay": []}
    model.hidden_norm.register_forward_hook(lambda m, i, o: captured.__setitem__("context", o))
    create = model._create_attention_mask  # noqa: SLF001

    def record_mask(*args, **kwargs):
        mask = create(*args, **kwargs)
        kind = "full_attention" if kwargs.get("sliding_window") is None else "sliding_attention"
        captured["masks"][kind] = dense_mask_of(mask)
        return mask

    model._create_attention_mask = record_mask  # noqa: SLF001
    backbone = model._backbone_forward  # noqa: SLF001

    def record_backbone(*args, **kwargs):
        out = backbone(*args, **kwargs)
        captured["backbone"] = out
        return out

    model._backbone_forward = record_backbone  # noqa: SLF001
    import speculators.models.dflash.metrics as ref_metrics

    compound = ref_metrics.compound_loss

    def record_compound(*args, decay_fn=None, **kwargs):
        def decay(*a, **k):
            w = decay_fn(*a, **k)
            captured["decay"].append(w.detach().reshape(1, -1).float())
            return w
        return compound(*args, decay_fn=decay if decay_fn else None, **kwargs)

    ref_metrics.compound_loss = record_compound
    loss_config = resolve_loss_config(loss_spec["loss"], "eager")
    amp = (torch.autocast(device, dtype=low_dtype) if low_dtype is not None
           else contextlib.nullcontext())
    try:
        with amp:
            _, loss, metrics = model(
                hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                loss_mask=inputs["loss_mask"],
                verifier_last_hidden_states=inputs["verifier_last_hidden_states"],
                document_ids=inputs["document_ids"], position_ids=inputs["position_ids"],
                loss_config=loss_config, gamma=loss_spec["gamma"], max_anchors=anchors.numel(),
                per_position_loss_weight=loss_spec["weighting"],
                dpace_alpha=loss_spec["dpace_alpha"],
            )
        loss.backward()
    finally:
        ref_metrics.compound_loss = compound
        core.select_anchors = select
    _, logits, targets, aligned, _ = captured["backbone"]

    tensors = {
        "context": captured["context"].detach().float(),
        "targets": targets.detach().float(),
        "logits": logits.detach().float(),
        "aligned_loss_mask": aligned.detach().float(),
        "loss": loss.detach().float().reshape(()),
    }
    for kind, mask in captured["masks"].items():
        tensors[f"mask.{kind}"] = mask.contiguous()
    for name, w in zip(loss_config, captured["decay"]):  # named by the profile's terms
        tensors[f"loss_weights.{term_names.get(name, name)}"] = w
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            tensors[f"grad.{name}"] = p.grad.detach().clone()
    tensors = {k: v.cpu() for k, v in tensors.items()}
    return tensors, {k: float(v) for k, v in metrics.items()}, model, missing, unexpected


def run_case(case: Path, core, resolve_loss_config) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    profile = json.loads((case / "profile.json").read_text())
    inputs = load_file(case / "inputs.safetensors")
    weights = load_file(case / "weights.safetensors")
    drafter = profile["drafter"]
    device = profile.get("device", "cpu")
    low = {"fp32": None, "bf16": torch.bfloat16}[profile.get("dtype", "fp32")]
    tensors, metrics, model, missing, unexpected = train_step(
        case, profile, inputs, weights, core, resolve_loss_config, low, device)
    noise = {}
    if low is not None:  # the same case in fp32 on the same (rounded) inputs
        exact_inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
        exact, exact_metrics, *_ = train_step(case, profile, exact_inputs, weights, core,
                                              resolve_loss_config, None, device)
        noise = measure_noise(tensors, exact, metrics, exact_metrics)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    runs_instead = reference_loss_spec(profile["loss"])[2]
    anchors = inputs["anchor_positions"]
    select = core.select_anchors
    # the reference's own anchor sampler, drawn K times (it uses the global RNG); a ref whose
    # sampler takes other arguments leaves the anchors check without draws, not the case
    torch.manual_seed(1)
    try:
        draws = [select(inputs["loss_mask"].clone(), anchors.numel(), drafter["block_size"])
                 for _ in range(profile.get("anchor_draws", 0))]
    except TypeError:
        draws = []
    if draws:
        tensors["anchor_draws"] = torch.stack([a.long().cpu() for a, _ in draws])
        tensors["anchor_draws_valid"] = torch.stack([v.bool().cpu() for _, v in draws])
    save_file({k: v.contiguous() for k, v in tensors.items()}, case / "outputs.safetensors")

    structure = structure_summary(model, missing, unexpected)
    (case / "outputs.json").write_text(json.dumps({
        "metrics": metrics,
        "noise": noise,
        "trainable": trainable,
        "structure": structure,
        "defaults": {**api_defaults(core), **({"runs_instead": runs_instead}
                                               if runs_instead else {})},
    }, indent=1, sort_keys=True))


def structure_summary(model, missing, unexpected) -> dict:
    """Structural facts of the reference's built model (fc shape, target ids, block size, mask
    token, layer types, window, norm class, state-dict keys / shapes / trainable, load
    mismatches): the ``structure`` of outputs.json."""
    state = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    first: dict = {}  # a trainable tensor under two names (a module used twice): its first
    shares = {k: first.setdefault(id(p), k) for k, p in params.items() if p.requires_grad}
    return {
        "fc_in_features": model.fc.in_features,
        "fc_out_features": model.fc.out_features,
        "target_layer_ids": list(model.target_layer_ids),
        "block_size": model.block_size,
        "mask_token_id": model.mask_token_id,
        "layer_types": [("sliding_attention" if i in model.sliding_window_indices
                         else "full_attention") for i in range(len(model.layers))],
        "sliding_window": model.sliding_window if model.sliding_window_indices else None,
        "sliding_window_non_causal": bool(model.sliding_window_non_causal),
        "sample_from_anchor": bool(model.config.sample_from_anchor),
        "verifier_norm": type(model.verifier_norm).__name__,
        "state_dict": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                           "trainable": bool(params[k].requires_grad) if k in params else False,
                           **({"shares": shares[k]} if shares.get(k, k) != k else {})}
                       for k, v in state.items()},
        "load_missing_keys": list(missing),
        "load_unexpected_keys": list(unexpected),
    }


@functools.lru_cache(maxsize=8)
def resolved_mask_token_id(verifier_dir: str, vocab_size: int) -> int | None:
    """The training CLI's ``resolve_mask_token_id`` with no explicit id (None for a folder
    without a tokenizer); cached per folder, since loading a tokenizer takes ~0.5 s."""
    import warnings

    from speculators.train import cli

    if not any((Path(verifier_dir) / n).exists()
               for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cli.resolve_mask_token_id(verifier_dir, vocab_size)


def derive(verifier_dir: str, num_layers: int = 1, sliding_window: int = 2048,
           full_attention_indices: tuple[int, ...] = (0,)) -> dict:
    """The drafter config the reference derives from a verifier config, as a flat dict.

    Keys: hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
    rms_norm_eps, hidden_act, attention_bias, max_position_embeddings, tie_word_embeddings,
    vocab_size (verifier vocab), target_vocab_size, layer_types, sliding_window,
    rope_theta / rope_type / rope_partial_rotary_factor / rope_scaling (what the draft
    model's rotary embedding is built from, after ``flatten_rope_parameters``), rotary_dim
    (features per head the model rotates: 2 * len(inv_freq)), rope_attention_scaling,
    verifier_norm ("x*(1+w)" or "x*w"), default_target_layer_ids, mask_token_id (the
    training CLI's resolution when no id is given; None when the folder has no tokenizer),
    saved.<key> for the keys of the transformer_layer_config the reference writes into a
    checkpoint's config.json.
    """
    import warnings
    from types import SimpleNamespace

    from speculators.models.utils import (
        flatten_rope_parameters,
        resolve_target_layer_ids,
        resolve_verifier_norm_class,
    )
    from speculators.train import cli
    from speculators.train.vocab_mapping import get_target_vocab_size
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tl = cli.create_transformer_layer_config(
            verifier_dir, num_layers, "qwen3", None, sliding_window,
            list(full_attention_indices))
        ids = resolve_target_layer_ids(None, verifier_dir)
    flat = flatten_rope_parameters(tl)
    rotary = Qwen3RotaryEmbedding(flat)
    rope = dict(flat.rope_parameters)
    scaling = {k: v for k, v in rope.items()
               if k not in ("rope_theta", "rope_type", "partial_rotary_factor")}
    norm_cls = resolve_verifier_norm_class(SimpleNamespace(speculators_config=SimpleNamespace(
        verifier=SimpleNamespace(name_or_path=verifier_dir))))
    mask = resolved_mask_token_id(verifier_dir, tl.vocab_size)
    uses_sliding = "sliding_attention" in (tl.layer_types or [])
    out = {
        "hidden_size": tl.hidden_size, "intermediate_size": tl.intermediate_size,
        "num_attention_heads": tl.num_attention_heads,
        "num_key_value_heads": tl.num_key_value_heads,
        "head_dim": tl.head_dim or tl.hidden_size // tl.num_attention_heads,
        "rms_norm_eps": tl.rms_norm_eps, "hidden_act": tl.hidden_act,
        "attention_bias": bool(tl.attention_bias),
        "max_position_embeddings": tl.max_position_embeddings,
        "tie_word_embeddings": bool(tl.tie_word_embeddings),
        "vocab_size": tl.vocab_size,
        "target_vocab_size": get_target_vocab_size(None, verifier_dir),
        "layer_types": list(tl.layer_types or []),
        "sliding_window": getattr(tl, "sliding_window", None) if uses_sliding else None,
        "rope_theta": float(rope.get("rope_theta")),
        "rope_type": rope.get("rope_type", "default"),
        "rope_partial_rotary_factor": rope.get("partial_rotary_factor"),
        "rope_scaling": scaling,
        "rotary_dim": 2 * int(rotary.inv_freq.numel()),
        "rope_attention_scaling": float(rotary.attention_scaling),
        "verifier_norm": "x*(1+w)" if "Gemma" in norm_cls.__name__ else "x*w",
        "default_target_layer_ids": list(ids),
        "mask_token_id": mask,
    }
    saved = json.loads(tl.to_json_string(use_diff=False))
    for key in ("rope_parameters", "head_dim", "num_attention_heads", "num_key_value_heads",
                "hidden_act", "rms_norm_eps", "attention_bias", "tie_word_embeddings",
                "sliding_window", "use_sliding_window", "layer_types", "vocab_size",
                "max_position_embeddings", "intermediate_size", "hidden_size"):
        out[f"saved.{key}"] = saved.get(key)
    return out


def derive_case(case: Path) -> None:
    """CASE/derive.json {"verifier_dir", "num_layers", "sliding_window",
    "full_attention_indices"} -> CASE/derivation.json: :func:`derive` on the case's verifier
    with the case's draft layout (``{"error", "traceback"}`` where the reference raises)."""
    args = json.loads((case / "derive.json").read_text())
    try:
        fields = derive(args["verifier_dir"], int(args["num_layers"]),
                        int(args["sliding_window"]), tuple(args["full_attention_indices"]))
    except Exception as err:  # noqa: BLE001 - reported to the harness, with traceback
        fields = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    (case / "derivation.json").write_text(json.dumps(fields, indent=1, sort_keys=True,
                                                     default=str))


def derive_main(argv: list[str]) -> int:
    """``--derive [--num-layers N] [--sliding-window W] [--full-attention-indices I,J] DIR...``:
    writes DIR/derivation.json for every verifier folder (``{"error", "traceback"}`` where the
    reference's derivation raises); exit 0 when every folder was tried, 2 on bad usage."""
    import argparse

    parser = argparse.ArgumentParser(prog="adapter.py --derive")
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--sliding-window", type=int, default=2048)
    parser.add_argument("--full-attention-indices", default="0")
    parser.add_argument("verifier_dirs", nargs="+")
    args = parser.parse_args(argv)
    if SOURCE:
        ensure_distribution_metadata(Path(SOURCE))
    full = tuple(int(i) for i in args.full_attention_indices.split(",") if i.strip())
    for folder in map(Path, args.verifier_dirs):
        try:
            fields = derive(str(folder), args.num_layers, args.sliding_window, full)
        except Exception as err:  # noqa: BLE001 - reported to the harness, with traceback
            fields = {"error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()}
        (folder / "derivation.json").write_text(
            json.dumps(fields, indent=1, sort_keys=True, default=str))
    return 0


#: The files of a case that the harness reads back as the reference's outputs.
OUTPUT_FILES = ("outputs.safetensors", "outputs.json", "derivation.json")


def report_outputs(case: Path) -> None:
    """Print ``{"dflash_audit_outputs": CASE, "sha256": {file: digest}}`` on stdout, a pipe only
    the harness reads: it checks that the files it compares are the ones written here, not
    files another process (the candidate's) replaced or added in this case folder."""
    digests = {n: hashlib.sha256((case / n).read_bytes()).hexdigest() for n in OUTPUT_FILES
               if (case / n).is_file()}
    print(json.dumps({"dflash_audit_outputs": case.name, "sha256": digests}), flush=True)


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when the harness that started it dies
    (``prctl(PR_SET_PDEATHSIG)``), so a killed audit leaves no reference running."""
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415
        import signal  # noqa: PLC0415

        parent = os.getppid()
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str]) -> int:
    die_with_parent()
    if argv and argv[0] == "--derive":
        return derive_main(argv[1:])
    if len(argv) != 1:
        print("usage: adapter.py CASES_DIR", file=sys.stderr)
        return 2
    cases_dir = Path(argv[0])
    speculators, core, resolve_loss_config = import_reference(cases_dir)
    cases = sorted(p for p in cases_dir.iterdir() if (p / "profile.json").exists())
    try:
        for case in cases:
            run_case(case, core, resolve_loss_config)
            if (case / "derive.json").exists():
                derive_case(case)
            report_outputs(case)
    except AttributeError as err:
        fail(cases_dir, "api_mismatch", f"the reference lacks an attribute the adapter uses: {err}")
    except Exception as err:  # noqa: BLE001 - reported to the harness, with traceback
        fail(cases_dir, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    version = getattr(speculators, "__version__", None)
    try:
        from speculators.version import version as version  # noqa: PLC0415
    except ImportError:
        pass
    (cases_dir / "reference.json").write_text(json.dumps({
        "module_file": speculators.__file__, "version": version, "cases": len(cases)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
