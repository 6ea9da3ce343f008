"""The two sides of a one-step training benchmark: our drafter and the reference's.

Shared by ``bench_step.py`` (CPU, eager attention) and ``bench_gpu.py`` (CUDA, flex attention).
Both sides are built from the same synthetic case (identical weights, batch and anchors); the
reference side runs in a process whose environment imports the resolved speculators source.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

#: Keyword inputs of our ``DFlashDrafter.forward``.
OUR_KEYS = ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
            "document_ids", "position_ids", "anchor_positions", "anchor_valid")


def build_side(side: str, case, inputs: dict[str, torch.Tensor], *, block_size: int,
               max_anchors: int, workdir: Path, attn_implementation: str | None = None,
               ) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """Build one side's model and a closure computing its training loss on ``inputs``.

    Args:
        side: ``"ours"`` (``DFlashDrafter`` + ``dflash_loss``) or ``"reference"``
            (speculators' ``DFlashDraftModel`` with ``kl_div`` loss, eager loss path).
        case: a synthetic case (``dflash_audit.audit.cases.synthetic.synthetic_case``); its weights
            are loaded into the model (the reference with ``strict=False``).
        inputs: the case's batch tensors, already on the device and in the dtype to measure
            (the same dict objects are read at each call of the loss closure).
        block_size: B, the draft block size our loss is computed with.
        max_anchors: A, the reference's ``max_anchors``; its anchor draw is replaced by the
            case's ``anchor_positions``/``anchor_valid`` so both sides train the same anchors.
        workdir: folder where the reference's config files are written.
        attn_implementation: the reference's transformer-layer attention implementation
            (e.g. ``"simple_flex_attention"``); None keeps the adapter's default.

    Returns:
        (model, loss_fn): the model on CPU in the case's dtype (the caller moves it and sets
        train mode), and a zero-argument function returning the scalar loss tensor.
    """
    if side == "ours":
        from dflash_audit.model.drafter import DFlashDrafter
        from dflash_audit.model.loss import dflash_loss

        model = DFlashDrafter(case.config)
        model.load_state_dict(case.weights)

        def loss_fn():
            o = model(**{k: inputs[k] for k in OUR_KEYS})
            return dflash_loss(o.logits, o.targets, o.aligned_loss_mask, block_size,
                               case.loss).loss
        return model, loss_fn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
    import adapter

    adapter.ensure_distribution_metadata(Path(adapter.SOURCE))
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import core

    cfg = adapter.build_config(case.config.to_dict(), workdir)
    if attn_implementation is not None:
        cfg.transformer_layer_config._attn_implementation = attn_implementation
    model = core.DFlashDraftModel(cfg)
    model.load_state_dict(case.weights, strict=False)
    anchors, valid = inputs["anchor_positions"], inputs["anchor_valid"]
    core.select_anchors = lambda lm, n, b: (anchors, valid)
    loss_config = resolve_loss_config("kl_div", "eager")

    def loss_fn():
        return model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                     loss_mask=inputs["loss_mask"],
                     verifier_last_hidden_states=inputs["verifier_last_hidden_states"],
                     document_ids=inputs["document_ids"],
                     position_ids=inputs["position_ids"], loss_config=loss_config,
                     max_anchors=max_anchors)[1]
    return model, loss_fn


def run_sides(script: str, ref: str | None, worker_args: list[str]):
    """Run ``script --worker <side> <worker_args> --out <file>`` for "ours" then "reference"
    (the latter in the resolved reference's environment), each in its own process.

    Returns:
        (identity, results): the resolved ``ReferenceIdentity`` and, per side, the JSON
        object its worker wrote.

    Raises:
        subprocess.CalledProcessError: a worker failed (its output went to the terminal).
    """
    from dflash_audit.reference_source import reference_env, resolve_reference

    identity = resolve_reference(ref)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("ours", "reference"):
            out = Path(tmp) / f"{side}.json"
            env = reference_env(identity) if side == "reference" else None
            subprocess.run([sys.executable, script, "--worker", side, *worker_args,
                            "--out", str(out)], env=env, check=True)
            results[side] = json.loads(out.read_text())
    return identity, results
