"""Runs INSIDE the reference's process (PYTHONPATH = resolved speculators source).

argv: WORK. WORK holds ``ours/`` (a checkpoint written by dflash-audit), ``inputs.safetensors``
(batch + anchors), ``profile.json`` ({"drafter": ...}) and ``verifier`` (path of an HF
verifier folder, in ``verifier.txt``). Writes:
* ``logits_ref_loading_ours.safetensors``: the reference's DFlashDraftModel.from_pretrained(ours)
  logits on the inputs;
* ``theirs/``: a checkpoint saved by the reference's own save_pretrained, and
  ``logits_theirs.safetensors``: that model's logits on the inputs.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reference"))

import adapter  # noqa: E402

work = Path(sys.argv[1])
adapter.ensure_distribution_metadata(Path(adapter.SOURCE))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from speculators.models.attention import create_float_mask  # noqa: E402
from speculators.models.dflash import core  # noqa: E402

inputs = load_file(work / "inputs.safetensors")
anchors, valid = inputs["anchor_positions"], inputs["anchor_valid"].bool()
core.select_anchors = lambda loss_mask, n, block_size: (anchors.clone(), valid.clone())


def eager(model):
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._create_mask_fn = create_float_mask
    return model.float().eval()


def logits_of(model):
    with torch.no_grad():
        _, logits, _, _, _ = model._backbone_forward(
            inputs["hidden_states"], inputs["input_ids"], inputs["loss_mask"],
            inputs["verifier_last_hidden_states"], inputs["document_ids"],
            inputs["position_ids"], max_anchors=anchors.numel())
    return logits.contiguous()


ours = eager(core.DFlashDraftModel.from_pretrained(str(work / "ours")))
save_file({"logits": logits_of(ours)}, work / "logits_ref_loading_ours.safetensors")

profile = json.loads((work / "profile.json").read_text())
config = adapter.build_config(profile["drafter"], work)
config.speculators_config.verifier.name_or_path = (work / "verifier.txt").read_text().strip()
torch.manual_seed(1)
theirs = core.DFlashDraftModel(config)
for name, p in theirs.named_parameters():
    if p.requires_grad:
        torch.nn.init.normal_(p, std=0.2)
if theirs.use_draft_vocab:
    V, Vd = theirs.verifier_vocab_size, theirs.draft_vocab_size
    ids = torch.randperm(V)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    theirs.load_vocab_mappings(t2d, ids - torch.arange(Vd))
theirs.load_verifier_weights()
theirs.save_pretrained(str(work / "theirs"))
save_file({"logits": logits_of(eager(theirs))}, work / "logits_theirs.safetensors")
