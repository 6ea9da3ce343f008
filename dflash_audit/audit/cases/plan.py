"""Which cases an audit runs: real batches under each audited layout, plus a seeded spread
of synthetic cases.

Layouts: the profile's own layer layout and, unless it already mixes both, the other one
(all full <-> all sliding), because the reference's model API builds full-attention layers
while its training CLI makes every layer sliding; the mask rules differ between the two.

Synthetic cases keep the profile's semantics (loss, weighting, gamma, D-PACE alpha,
sample_from_anchor, sliding_window_non_causal, draft vocabulary or not) and vary what real
data rarely exercises: block size, anchors (including padding anchors), packed documents,
padding, windows smaller than a document, one long row (the last case when there are more
than len(FAMILIES), as by default: T = LONG_SEQ_LEN > 4096), one case at a real width (the
one before it: H = WIDE_HIDDEN with 16 heads of 128, one draft layer, a short row), on every
packed row an anchor within B-1 tokens of a document's end whose block reaches the next
document's supervised tokens (:func:`pin_document_end_anchor`), on all but those two the
drafter's predictions right on some slots, against the verifier's argmax on some blocks and
the data tokens on others (:func:`dflash_audit.audit.cases.synthetic.plant_hits`: accuracy and
acceptance-length definitions then differ), layouts (full / sliding / mixed, cycled
so any N >= 2 covers full and sliding), and the verifier: case i is a proxy of verifier family
``FAMILIES[i % len(FAMILIES)]`` (:mod:`dflash_audit.data.families`: llama with llama3 rope
scaling, qwen3 with head_dim != H/heads, qwen3_5 hybrid with partial rotary and x*(1+w)
norm, gemma3_text with nested per-layer-type rope and gelu, mistral, gpt_oss with yarn,
olmo3, glm4 with partial rotary and a tiny eps), so a candidate that hard-codes a Llama
convention (rope theta or type, norm gain, head_dim, eps, activation) fails the default
audit. After the first pass over the families, the RoPE theta and RMSNorm eps are redrawn
over values implementations commonly hard-code. Dimensions are tiny (H=32, V=128, N=12
verifier layers). Everything derives from ``seed``; a case is reproducible from its name and
the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.audit.case import Case, CaseVerifier
from dflash_audit.audit.cases.synthetic import plant_hits, synthetic_case
from dflash_audit.audit.cases.weights import fit_to_targets, real_case_weights
from dflash_audit.audit.replay.architecture import COMMON_NORM_EPS, COMMON_ROPE_THETAS
from dflash_audit.data.families import FAMILIES, family_config
from dflash_audit.model.anchors import select_anchors, valid_anchor_mask
from dflash_audit.model.config import SLIDING_ATTENTION
from dflash_audit.profile import Profile, ProfileError

#: Window used when the full-attention profile is also audited with all layers sliding:
#: the reference training CLI's default (speculators train/config/schema.py DraftArgs).
REFERENCE_CLI_WINDOW = 2048
SYNTHETIC_LAYOUTS = ("full", "sliding", "mixed")
SYNTHETIC_BLOCK_SIZES = (2, 3, 4, 5, 8, 16)
SYNTHETIC_VERIFIER = {"num_hidden_layers": 12, "vocab_size": 128}
#: T of the last synthetic case, one document: positions past 256 (where bfloat16 stops
#: holding integers exactly), past 2048 (float16; the reference CLI's sliding window) and past
#: 4096 (a common position limit and RoPE cache size), so a bug that only starts on long rows
#: does not pass an audit whose real rows are short. Cheap at the synthetic width (H=32).
LONG_SEQ_LEN = 4200
#: The width of the wide synthetic case (users train drafters of 2048-8192): 8 heads of
#: head_dim 128 (head_dim independent of H / heads, as in Qwen3 and Gemma3), 2 KV heads, a
#: narrow MLP (128) so the case stays cheap (fc, n*H x H, is most of its 19M weights),
#: T = WIDE_SEQ_LEN.
WIDE_HIDDEN = 2048
WIDE_SEQ_LEN = 40


def synthetic_verifier_config(family: str, rng: random.Random | None = None) -> Any:
    """The verifier config of a synthetic case: the family's proxy config (N=12, V=128);
    with ``rng``, the RoPE theta the draft layers use (the flat one, or the nested
    ``sliding_attention`` entry) and the RMSNorm eps redrawn over commonly hard-coded values.
    """
    config = family_config(family, **SYNTHETIC_VERIFIER)
    if rng is not None:
        rope = dict(config.rope_parameters)
        entry = "sliding_attention" if "sliding_attention" in rope else None
        theta = rng.choice(COMMON_ROPE_THETAS)
        if entry:
            rope[entry] = {**rope[entry], "rope_theta": theta}
        else:
            rope["rope_theta"] = theta
        config.rope_parameters = rope
        config.rms_norm_eps = rng.choice(COMMON_NORM_EPS)
    return config


@dataclass
class PlannedCase:
    """A case and how it was made (``kind`` real | synthetic, ``layout`` facts for the report)."""

    case: Case
    kind: str
    layout: dict[str, Any]


def layout_variants(profile: Profile) -> list[Profile]:
    """The profile, plus the other uniform layout when the profile's layout is uniform."""
    if profile.layout_name == "full":
        return [profile, profile.replace(layer_layout="sliding",
                                         sliding_window=profile.sliding_window
                                         or REFERENCE_CLI_WINDOW)]
    if profile.layout_name == "sliding":
        return [profile, profile.replace(layer_layout="full")]
    return [profile]


def layout_facts(case: Case) -> dict[str, Any]:
    """Structural facts of a case for the report (layout name, B, T, A, documents...)."""
    cfg, inp = case.config, case.inputs
    types = list(cfg.effective_layer_types)
    kinds = set(types)
    doc = inp["document_ids"]
    return {
        "layout": "mixed" if len(kinds) > 1 else (
            "sliding" if SLIDING_ATTENTION in kinds else "full"),
        "layer_types": types,
        "sliding_window": cfg.sliding_window if SLIDING_ATTENTION in kinds else None,
        "sliding_window_non_causal": cfg.sliding_window_non_causal,
        "block_size": cfg.block_size,
        "seq_len": int(inp["input_ids"].shape[-1]),
        "anchors": int(inp["anchor_positions"].numel()),
        "valid_anchors": int(inp["anchor_valid"].sum()),
        "documents": int(doc.max()) + 1 if bool((doc >= 0).any()) else 0,
        "padding": int((doc < 0).sum()),
        "supervised_tokens": int(inp["loss_mask"].sum()),
        "target_layer_ids": list(cfg.target_layer_ids),
        "hidden_size": cfg.hidden_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "verifier_model_type": cfg.verifier_model_type,
        "head_dim": cfg.head_dim,
        "rope_parameters": cfg.rope_parameters,
        "hidden_act": cfg.hidden_act,
        "verifier_norm": "x*(1+w)" if cfg.verifier_norm_one_plus_weight else "x*w",
    }


def plan_real_cases(profile: Profile, inputs: Any, anchors: int, seed: int = 0,
                    user_weights: dict[str, torch.Tensor] | None = None,
                    weights_source: str = "") -> list[PlannedCase]:
    """One case per (real batch, audited layout), all sharing one weight set.

    Args:
        profile: the audit profile.
        inputs: :class:`dflash_audit.audit.cases.real_inputs.RealInputs`.
        anchors: A, anchor slots per case (the profile's max_anchors caps it).
        seed: seeds the trainable weights and the anchor draw.
        user_weights: a user's checkpoint (:func:`dflash_audit.audit.cases.user_weights.
            load_user_weights`) replacing the seeded trainable weights.
        weights_source: where ``user_weights`` came from (named in errors).

    Raises:
        ProfileError: the profile does not fit the verifier.
        UserWeightsError: the user's weights do not fit the drafter (keys named).
    """
    if not inputs.batches:
        return []
    first = inputs.batches[0]
    vc = getattr(inputs.verifier_config, "text_config", None) or inputs.verifier_config
    profile.check_mask_token(int(vc.vocab_size), str(inputs.verifier.get("name")))
    base = profile.to_drafter_config(inputs.verifier_config, first.mask_token_id,
                                     target_layer_ids=first.target_layer_ids)
    weights = real_case_weights(base, inputs.frozen, seed,
                                rows=[(b.input_ids, b.loss_mask) for b in inputs.batches])
    n_anchors = max(1, min(anchors, profile.max_anchors))
    verifier = CaseVerifier(name=str(inputs.verifier.get("name")), config=inputs.verifier_config,
                            folder=str(inputs.verifier_dir) if inputs.verifier_dir else None,
                            target_layers=profile.target_layers)
    rows = []
    for i, batch in enumerate(inputs.batches):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        anchor_positions, anchor_valid = select_anchors(batch.loss_mask, n_anchors,
                                                        profile.block_size, g)
        rows.append({**batch.tensors(), "anchor_positions": anchor_positions,
                     "anchor_valid": anchor_valid})
    if user_weights is not None:  # the user's checkpoint is audited as it is
        from dflash_audit.audit.cases.user_weights import apply_user_weights

        weights = apply_user_weights(weights, user_weights, weights_source,
                                     inputs.frozen["verifier_lm_head.weight"])
    else:  # fitted briefly so that loss terms which coincide at random init differ on real data
        weights = fit_to_targets(base, weights, rows[0], seed=seed)
    planned = []
    for i, (batch, tensors) in enumerate(zip(inputs.batches, rows)):
        for variant in layout_variants(profile):
            config = variant.to_drafter_config(inputs.verifier_config, batch.mask_token_id,
                                               target_layer_ids=batch.target_layer_ids)
            case = Case(verifier=verifier,
                name=f"real-{i:02d}-{variant.layout_name}", config=config,
                loss=variant.loss_spec(), inputs=tensors, weights=weights,
                description=(f"real row {i} of {inputs.data.get('source')} through "
                             f"{inputs.verifier.get('name')}: T={batch.seq_len}, "
                             f"{batch.num_documents} document(s), A={n_anchors}, "
                             f"{variant.layout_name} attention"))
            planned.append(PlannedCase(case, "real", layout_facts(case)))
    return planned


def synthetic_target_layers(profile: Profile, n_layers: int) -> list[int]:
    try:
        return profile.resolve_target_layer_ids(n_layers)
    except ProfileError:  # explicit ids of a deeper verifier: keep their count, spread them
        k = min(len(profile.target_layers), n_layers - 1)
        return sorted({round(1 + j * (n_layers - 2) / max(k - 1, 1)) for j in range(k)})


def plan_synthetic_cases(profile: Profile, count: int, seed: int = 0) -> list[PlannedCase]:
    """``count`` synthetic cases over a seeded spread (see the module docstring)."""
    return [synthetic_planned(profile, i, count, seed) for i in range(count)]


def synthetic_planned(profile: Profile, i: int, count: int, seed: int = 0,
                      num_draft_layers: int | None = None) -> PlannedCase:
    """Synthetic case ``i`` of an audit of ``count`` synthetic cases (the spread of the module
    docstring; ``i >= count`` continues it, for a framework whose capabilities skip cases).
    ``num_draft_layers``: the drafter's depth instead of the drawn one (1 or 2), for a
    framework that takes one target layer per draft layer; the layout cycles as before (a
    mixed one alternates), every other draw is the same."""
    V = SYNTHETIC_VERIFIER["vocab_size"]
    ids = synthetic_target_layers(profile, SYNTHETIC_VERIFIER["num_hidden_layers"])
    draft_vocab = V // 2 if profile.draft_vocab_size is not None else None
    loss = profile.loss_spec()
    rng = random.Random(seed * 1_000_003 + i)
    layout = SYNTHETIC_LAYOUTS[i % len(SYNTHETIC_LAYOUTS)]
    if layout == "mixed":
        types = rng.choice([("sliding", "full"), ("full", "sliding")])
    else:
        types = (layout,) * rng.choice((1, 1, 2))
    if num_draft_layers is not None:  # the same layout kinds at the asked depth
        types = tuple(types[k % len(types)] for k in range(num_draft_layers))
    block = profile.block_size if i < len(SYNTHETIC_LAYOUTS) else rng.choice(
        SYNTHETIC_BLOCK_SIZES)
    # the last case past the first pass over the families: one long document; the one
    # before it (when there is room) at a real width
    long_row = i == count - 1 and i >= len(FAMILIES)
    wide = i == count - 2 and i >= len(FAMILIES)
    seq_len = LONG_SEQ_LEN if long_row else rng.randint(max(3 * block, 24), max(96, 4 * block))
    if wide:
        types, seq_len = ("full",), max(WIDE_SEQ_LEN, 3 * block)
    docs = 1 if long_row else rng.randint(1, 4)
    pad = rng.randint(0, min(8, seq_len // 4))
    window = rng.randint(1, seq_len // 2) if rng.random() < 0.8 else rng.randint(
        seq_len, 2 * seq_len)
    variant = profile.replace(block_size=block, num_draft_layers=len(types),
                              layer_layout=list(types), sliding_window=window,
                              draft_vocab_size=draft_vocab)
    # one case in four has more anchor slots than valid anchors: padding anchors
    anchors = seq_len if rng.random() < 0.25 else rng.randint(1, 10)
    anchors = 8 if long_row else (4 if wide else anchors)
    family = FAMILIES[0] if wide else FAMILIES[i % len(FAMILIES)]
    verifier_config = synthetic_verifier_config(
        family, rng if i >= len(FAMILIES) else None)
    if wide:
        widen(verifier_config)
    config = variant.to_drafter_config(verifier_config, mask_token_id=V - 1,
                                       target_layer_ids=ids)
    name = f"syn-{i:03d}-{family}{f'-h{WIDE_HIDDEN}' if wide else ''}-{variant.layout_name}"
    case = synthetic_case(name, config, loss,
                          seed=seed * 1_000_003 + i, seq_len=seq_len, num_documents=docs,
                          pad=pad, max_anchors=anchors)
    case.verifier = CaseVerifier(name=f"family:{family}", config=verifier_config,
                                 target_layers=profile.target_layers)
    if long_row:
        pin_last_anchor(case)
    else:
        pin_document_end_anchor(case)
    if not (long_row or wide):  # the two cost most to run our drafter on
        plant_hits(case)
    return PlannedCase(case, "synthetic", layout_facts(case))


def widen(config: Any) -> None:
    """Set a synthetic verifier config to the real width :data:`WIDE_HIDDEN` (in place):
    8 heads of 128, 2 KV heads, intermediate 128."""
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = (
        WIDE_HIDDEN, 8, 2)
    config.head_dim, config.intermediate_size = 128, 128


def pin_last_anchor(case: Case) -> None:
    """Make the last valid anchor of ``case`` the last position an anchor may take whose next
    slot is supervised (in place), so a trained block reads the context up to the end of the
    row: on the long row, positions past 2048 then reach the loss (random anchors may all fall
    before it)."""
    a, valid = case.inputs["anchor_positions"].clone(), case.inputs["anchor_valid"]
    loss_mask = case.inputs["loss_mask"]
    trained_next = torch.cat([loss_mask[0, 1:].bool(), torch.zeros(1, dtype=torch.bool)])
    allowed = (valid_anchor_mask(loss_mask, case.config.block_size) & trained_next).nonzero()
    if valid.any() and allowed.numel():
        last = int(allowed.max())
        if last not in a[valid].tolist():
            a[int(valid.nonzero().max())] = last  # the largest valid anchor: order is kept
            case.inputs["anchor_positions"] = a


def pin_document_end_anchor(case: Case) -> None:
    """On a packed ``case`` (in place): make one valid anchor a position p within
    block_size-1 tokens of the end of its document (its block reaches the next document), the
    next document's tokens in that block supervised. The reference admits such an anchor and
    trains those slots (loss_mask[a+s], across the boundary); a framework that keeps every
    block inside one document (NeMo Automodel's ``doc_remaining >= block_size - 1``) or cuts
    labels at the document's end differs there, which random anchors rarely show. The anchor
    p is the supervised position before the first document boundary that fits, block slots
    split about evenly between the two documents; the valid anchors stay sorted. Nothing
    changes on a row of one document, when B < 2 or no boundary fits."""
    B, inputs = case.config.block_size, case.inputs
    doc, lm = inputs["document_ids"][0], inputs["loss_mask"]
    a, valid = inputs["anchor_positions"].clone(), inputs["anchor_valid"]
    T, k = doc.numel(), int(valid.sum())
    if B < 2 or not k or bool((a[valid] + B > T).any()):
        return
    allowed = valid_anchor_mask(lm, B)
    for e in range(1, T - 1):
        if not (doc[e] >= 0 and doc[e - 1] >= 0 and doc[e] != doc[e - 1]):
            continue
        fits = [p for p in range(e - 1, e - B, -1)
                if p >= 0 and doc[p] == doc[e - 1] and bool(allowed[p])]
        if not fits:
            continue
        p = min(fits, key=lambda q: abs((e - q) - B // 2))
        if p not in a[valid].tolist():
            a[int((a[:k] - p).abs().argmin())] = p
            a[:k] = a[:k].sort().values
            inputs["anchor_positions"] = a
        nxt = doc[e:p + B] == doc[e]
        if not bool(lm[0, e:p + B][nxt].any()):  # the next document supervised from its start
            lm = lm.clone()
            lm[0, e:p + B] = torch.where(nxt, 1, lm[0, e:p + B])
            inputs["loss_mask"] = lm
        return


#: The flex-attention block size (torch.nn.attention.flex_attention _DEFAULT_SPARSE_BLOCK_SIZE).
FLEX_BLOCK_SIZE = 128


def plan_flex_padding_case(profile: Profile, seed: int = 0,
                           family: str | None = None) -> PlannedCase:
    """A synthetic case whose query count Q = A * B and key count T + Q are past and not
    multiples of the flex block size, so flex attention pads both (SpecForge PR 511: a
    BlockMask that indexes past the anchors for padded queries). Added on ``--device cuda``;
    ``family``: its verifier family (default the first of :data:`FAMILIES`)."""
    block = profile.block_size
    anchors = FLEX_BLOCK_SIZE // block + 3  # Q = 128 + 3 B (B >= 2: never a multiple of 128)
    seq_len = FLEX_BLOCK_SIZE + 77
    family = family or FAMILIES[0]
    ids = synthetic_target_layers(profile, SYNTHETIC_VERIFIER["num_hidden_layers"])
    variant = profile.replace(draft_vocab_size=SYNTHETIC_VERIFIER["vocab_size"] // 2
                              if profile.draft_vocab_size is not None else None)
    config = variant.to_drafter_config(synthetic_verifier_config(family), mask_token_id=(
        SYNTHETIC_VERIFIER["vocab_size"] - 1), target_layer_ids=ids)
    case = synthetic_case(f"syn-flexpad-{family}-{variant.layout_name}", config,
                          profile.loss_spec(), seed=seed * 1_000_003 + 999_983, seq_len=seq_len,
                          num_documents=3, pad=5, max_anchors=anchors)
    return PlannedCase(case, "synthetic", layout_facts(case))
