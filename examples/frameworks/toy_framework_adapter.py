"""A worked example of a framework adapter written with the kit
(:mod:`dflash_audit.audit.frameworks.kit`).

The first half is a toy training framework, written here so the example runs anywhere: like
real ones, its ``forward`` samples anchors inside itself from torch's global RNG, builds its
mask with a module-level function, and returns only the loss. The second half is the adapter:
glue that drives the toy's real code and records what it computes. What the toy does not
compute (the verifier targets, the aligned mask it applies implicitly) the adapter supplies
with dflash_audit's reference-conformant pieces and marks as its own in PROVENANCE.

    python examples/frameworks/toy_framework_adapter.py          # one step, recorded
    dflash-audit compare --candidate examples/frameworks/toy_framework_adapter.py:candidate \\
        --rows 0 --cases 1 --offline                                # audited (it fails: a toy)
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F


# --- the toy framework (a real adapter imports this from the framework's package) ---------
def build_block_mask(doc, anchors, B):
    """[Q, T+Q] bool: context kv < anchor in the anchor's document, own block bidirectional."""
    T, qa = doc.numel(), anchors.repeat_interleave(B)[:, None]
    kv, q = torch.arange(T)[None], torch.arange(qa.numel())[:, None]
    ctx = (kv < qa) & (doc[None] == doc[qa])
    return torch.cat([ctx, (torch.arange(qa.numel())[None] // B) == q // B], 1)


class ToyTrainer(nn.Module):
    def __init__(self, n_layers_in, H, V, B, mask_id):
        super().__init__()
        self.B, self.mask_id = B, mask_id
        self.fc, self.hidden_norm = nn.Linear(n_layers_in * H, H, bias=False), nn.RMSNorm(H)
        self.qkv, self.norm = nn.Linear(H, 3 * H, bias=False), nn.RMSNorm(H)
        self.embed, self.head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)

    def _sample_anchors(self, T, loss_mask):  # global RNG, inside forward
        ok = loss_mask[0, :T - self.B].bool().nonzero().flatten()
        pick = ok[torch.randperm(ok.numel())[:4]].sort().values
        return pick, torch.ones_like(pick, dtype=torch.bool)

    def per_token_loss(self, logits, labels, weights):
        return F.cross_entropy(logits[0], labels[0], reduction="none") * weights[0]

    def forward(self, hidden_states, input_ids, loss_mask, document_ids):
        T, B = input_ids.shape[1], self.B
        anchors, keep = self._sample_anchors(T, loss_mask)
        idx = (anchors[:, None] + torch.arange(B)).reshape(-1)
        ctx = self.hidden_norm(self.fc(hidden_states))
        ids = torch.full((1, idx.numel()), self.mask_id)
        ids[0, ::B] = input_ids[0, anchors]
        x = self.embed(ids)
        q, _, _ = self.qkv(x).chunk(3, -1)
        _, k, v = self.qkv(torch.cat([ctx, x], 1)).chunk(3, -1)
        mask = build_block_mask(document_ids[0], anchors, B)
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.head(self.norm(x))
        w = loss_mask[:, idx] * (torch.arange(idx.numel()) % B != 0)
        return self.per_token_loss(logits, input_ids[:, idx], w).sum() / w.sum().clamp_min(1)


# --- the adapter ------------------------------------------------------------------------
from dflash_audit.audit.case import SideOutputs  # noqa: E402
from dflash_audit.audit.frameworks import kit  # noqa: E402
from dflash_audit.candidate import structure_summary  # noqa: E402
from dflash_audit.model.drafter import aligned_loss_mask, block_indices, verifier_targets  # noqa: E402,E501
from dflash_audit.model.layers import RMSNorm  # noqa: E402
from dflash_audit.model.metrics import dflash_metrics  # noqa: E402

NAME, VERSION = "toy framework", "0.0"
#: What the toy cannot express (its labels are always the data tokens; one vocabulary) and,
#: for each, what it would do on such input, where in its code (a latent difference: PATH
#: relative to the framework's install root, here this folder; "shows" is what those lines say).
CAPABILITIES = {"sample_from_anchor": False, "draft_vocab": False}
LATENT = [
    {"capability": "sample_from_anchor", "source": "toy_framework_adapter.py:64",
     "would": "teaches slot s the data token input_ids[a+s] whatever the recipe: under "
              "sample_from_anchor=True every slot would be taught one position early",
     "shows": "input_ids[:, idx]"},
    {"capability": "draft_vocab", "source": "toy_framework_adapter.py:40",
     "would": "has one output head over the full vocabulary V: no draft vocabulary",
     "shows": "nn.Linear(H, V, bias=False)"}]
PROVENANCE = {"context": "framework", "logits": "framework", "mask.full_attention": "framework",
              "loss": "framework", "loss_weights.": "framework", "grad.": "framework",
              "targets": "adapter", "aligned_loss_mask": "adapter"}


class ToyCandidate:
    name = "toy framework (kit example)"

    def select_anchors(self, loss_mask, max_anchors, block_size, generator):
        """The toy's own sampler, seeded from the audit's generator."""
        model = ToyTrainer(1, 4, 8, block_size, 0)
        with kit.seeded_global_rng(generator):
            a, v = model._sample_anchors(loss_mask.shape[1], loss_mask)  # noqa: SLF001
        pad = max_anchors - a.numel()
        return F.pad(a, (0, pad)), F.pad(v, (0, pad))

    def run_case(self, config, loss, weights, inputs):
        B, H, V = config.block_size, config.hidden_size, config.vocab_size
        model = ToyTrainer(config.num_target_layers, H, V, B, config.mask_token_id)
        with torch.no_grad():  # the case's weights where the toy has a counterpart
            model.fc.weight.copy_(weights["fc.weight"])
            model.embed.weight.copy_(weights["embed_tokens.weight"])
            model.head.weight.copy_(weights["lm_head.weight"])
        anchors, valid = inputs["anchor_positions"], inputs["anchor_valid"].bool()
        this = sys.modules[__name__]
        with kit.inject_anchors(model, "_sample_anchors", lambda T, lm: (anchors, valid)) as s, \
                kit.record_calls(this, "build_block_mask") as masks, \
                kit.record_calls(model, "per_token_loss") as per_token, \
                kit.record_outputs(model.hidden_norm) as ctx, \
                kit.record_outputs(model.head) as logits:
            loss_value = model(inputs["hidden_states"], inputs["input_ids"], inputs["loss_mask"],
                               inputs["document_ids"])
        assert s, "the toy did not call its sampler: the injected anchors were not used"
        loss_value.backward()
        logits_, args = logits[0].detach(), per_token[0].args
        plain = F.cross_entropy(args[0][0], args[1][0], reduction="none")
        idx = block_indices(anchors, B)
        norm = RMSNorm(H, config.rms_norm_eps, config.verifier_norm_one_plus_weight)
        norm.weight.data.copy_(weights["verifier_norm.weight"])
        head = nn.Linear(H, V, bias=False)
        head.weight.data.copy_(weights["verifier_lm_head.weight"])
        targets = verifier_targets(inputs["verifier_last_hidden_states"], idx, norm, head)
        m = aligned_loss_mask(inputs["loss_mask"], idx, valid, B)
        tensors = {"context": ctx[0].detach(), "logits": logits_, "targets": targets,
                   "aligned_loss_mask": m, "loss": loss_value.detach(),
                   "mask.full_attention": masks[0].result,
                   f"loss_weights.{loss.loss}": kit.slot_weights_from_losses(
                       per_token[0].result, plain, m),
                   **{f"grad.{n}": p.grad for n, p in model.named_parameters()
                      if p.grad is not None}}
        return SideOutputs(tensors=tensors, metrics=dflash_metrics(logits_, targets, m, B),
                           structure=structure_summary(model, config))


candidate = ToyCandidate()

if __name__ == "__main__":
    from dflash_audit.audit.cases.plan import plan_synthetic_cases
    from dflash_audit.profile import Profile

    case = plan_synthetic_cases(Profile.load("reference-model").replace(block_size=4), 1)[0].case
    T = 16
    case.inputs = {k: v[:, :T] for k, v in case.inputs.items() if v.dim() > 1}
    case.inputs["loss_mask"] = torch.ones(1, T)
    case.inputs["document_ids"] = torch.zeros(1, T, dtype=torch.long)
    case.inputs.update(anchor_positions=torch.tensor([2, 5]),
                       anchor_valid=torch.tensor([True, True]))
    out = candidate.run_case(case.config, case.loss, case.weights, case.inputs)
    mask = out.tensors["mask.full_attention"]
    print("anchors injected:", case.inputs["anchor_positions"].tolist())
    print(f"mask recorded: {list(mask.shape)} {str(mask.dtype).replace('torch.', '')}")
    print("loss:", round(float(out.tensors["loss"]), 4), "| weights:",
          out.tensors[f"loss_weights.{case.loss.loss}"][0].tolist())
