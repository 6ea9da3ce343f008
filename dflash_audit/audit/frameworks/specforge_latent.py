"""What SpecForge 0.2.0 would do on input it cannot express: the ``LATENT`` of
:mod:`.specforge_adapter` (:mod:`.latent`), one entry per capability its ``CAPABILITIES`` lack,
each citing ``specforge==0.2.0``'s own lines (checked against the installed wheel by
tests/test_framework_latent.py)."""

from __future__ import annotations

#: ``dfm``: the file that holds its DFlash objective, anchors, masks and positions.
_DFM = "specforge/algorithms/common/dflash_family_model.py"
LATENT: list[dict[str, str]] = [
    {"capability": "packed_rows",
     "would": "has no document mask: on a packed row a block's context is every position "
              "before its anchor, so attention would leak across documents (the reference "
              "keeps the anchor's own document)",
     "source": f"{_DFM}:72", "shows": "mask_context = (kv_indices < S) & (kv_indices < "
                                      "anchor_expanded)"},
    {"capability": "packed_rows",
     "would": "has no per-document positions: context positions are arange(T) and block "
              "positions a+s, so on a packed row RoPE positions would run on across documents "
              "instead of restarting at 0 in each",
     "source": f"{_DFM}:294-296", "shows": "torch.arange(seq_len, device=device)"},
    {"capability": "block_attention",
     "would": "makes every sliding layer causal inside the block: a non-causal sliding recipe "
              "(sliding_window_non_causal) would train causal blocks",
     "source": f"{_DFM}:81-83", "shows": "mask_draft & (kv_block_offsets <= q_block_offsets)"},
    {"capability": "draft_vocab",
     "would": "has no draft vocabulary (no t2d / d2t): the draft's logits are the target head's "
              "over the full vocabulary V, so a reduced draft vocabulary cannot be trained",
     "source": f"{_DFM}:341", "shows": "logits = self.lm_head("},
    {"capability": "sample_from_anchor",
     "would": "teaches slot s the data token input_ids[a+s] whatever the recipe: under "
              "sample_from_anchor=True (the reference teaches the prediction at a+s, the token "
              "after it) every slot would be taught one position early",
     "source": f"{_DFM}:406-408", "shows": "position k predicts token anchor+k"},
    {"capability": "dtypes",
     "would": "trains bf16 as bf16 parameters (the whole model cast to the dtype; fp32 master "
              "copies only inside its optimizer), not as fp32 weights under bf16 autocast: "
              "every weight would be rounded to bf16 before its forward",
     "source": "specforge/algorithms/model_providers.py:367",
     "shows": "model_factory(common).to(device=_device(), dtype=_torch_dtype(cfg))"},
    {"capability": "embedding_layer",
     "would": "numbers target layers from the first decoder layer (id k reads HF "
              "hidden_states[k+1]): the reference's id 0, the embedding output, would be id -1 "
              "there, and ids copied from a speculators config would each read one layer deeper",
     "source": "specforge/modeling/draft/dflash.py:288-291",
     "shows": "hidden_states[layer_id + offset]"},
    {"capability": "last_layer",
     "would": "reads its last id N-1 as HF hidden_states[N], the last layer's output AFTER the "
              "final norm: the reference's id N (before the norm) cannot be given, and a drafter "
              "asked for it would be fed the normed state",
     "source": "specforge/modeling/draft/dflash.py:288-291",
     "shows": "hidden_states[layer_id + offset]"},
]
