"""NeMo Automodel 0.7.0's real DFlash trainer audited through the tool's own path,
``dflash-audit compare --candidate framework:nemo`` (the tool installs nemo-automodel==0.7.0
into its cache, --no-deps; a failed install fails the test): ONE compare under the default
profile (4 synthetic cases, all Qwen3-family: NeMo has no DFlash draft for other targets),
packed rows (3 documents, padding) given as NeMo's own packing metadata.

The differences asserted are the ones read in NeMo next to the reference
(``core`` = ``nemo_automodel/components/speculative/dflash/core.py``): labels are the data
tokens (core.py:399-433) and the loss is divided by the sum of weights (loss/dllm_loss.py:
824-827, ``normalize="mean"`` core.py:225); an anchor needs block_size-1 further tokens of its
document (core.py:258); the block is always bidirectional and the window is measured from the
query, a + s - kv < W (attention/dflash_mask.py:123, 136-141), one trainer window for every
layer (core.py:212, 442, 504-528: the structure names it); its draft config builder keeps
every layer full attention and copies the verifier's tying and partial rotary factor
(speculative/dflash/draft_qwen3.py build_qwen3_dflash_draft_config); default ids from
``build_target_layer_ids``; no decay by default; accuracy against its labels; an acceptance
length that an unsupervised slot does not end (core.py:139-141). Packed rows,
full-attention masks, context, full-attention logits and the aligned mask (also for an anchor
near a document's end: its DFlash trainer's labels cross the boundary, core.py:572) agree (no
false alarm).
"""

from __future__ import annotations

import pytest
import torch
from framework_support import framework_compare, framework_site

pytestmark = pytest.mark.reference

SLIDING, FULL, Q35_SLIDING, Q35_FULL = ("syn-001-qwen3-sliding", "syn-009-qwen3-full",
                                        "syn-010-qwen3_5-sliding", "syn-018-qwen3_5-full")


@pytest.fixture(scope="session")
def report(reference_identity, tmp_path_factory) -> dict:
    """One compare of NeMo against the cached reference (see the module docstring)."""
    return framework_compare("nemo", tmp_path_factory, "--cases", "4")


def first(report, case, check) -> dict:
    found = report["by"].get((case, check), [])
    assert found, f"no {check} result for {case}"
    return found[0]


def test_runs_nemo_and_fails(report):
    assert report["rc"] == 1, report["stdout"][-1500:]
    assert report["json"]["candidate"]["framework"]["install"].endswith(
        "frameworks/nemo-0.7.0/site")
    ran = {c["name"] for c in report["json"]["cases"]}
    assert ran == {SLIDING, FULL, Q35_SLIDING, Q35_FULL}, ran
    assert "not supported by NeMo Automodel 0.7.0: verifier family 'llama'" in report["md"]


def test_no_false_alarm_on_what_nemo_computes_like_the_reference(report):
    for case in (FULL, Q35_FULL):  # packed rows (3 documents, padding): document mask agrees
        for check in ("mask", "context", "logits"):
            assert {r["status"] for r in report["by"].get((case, check), [])} <= {"pass"}, (
                case, check, first(report, case, check)["summary"])
    for case in (SLIDING, Q35_SLIDING):
        assert first(report, case, "context")["status"] == "pass"


def test_names_labels_loss_and_anchor_rule(report):
    text = report["md"]
    assert "targets are the data tokens input_ids[a+s]" in text
    assert "loss normalised by the sum of weights instead of the number of supervised" in text
    # on packed rows its sampler admits T-B only when the last document runs to the row's end
    # (core.py:251-258): every case here ends in padding, so its own-document rule shows
    anchors = first(report, SLIDING, "anchors")
    assert anchors["status"] == "fail" and anchors["summary"].startswith(
        "an anchor needs block_size-1 further tokens of its own document (NeMo Automodel "
        "0.7.0's rule)"), anchors["summary"]


def test_names_the_always_bidirectional_block_as_its_own_variant(report):
    for case in (SLIDING, Q35_SLIDING):
        s = first(report, case, "structure")
        assert s["status"] == "fail" and "sliding_window_non_causal: candidate True" in (
            s["summary"]), s["summary"]
        mask = first(report, case, "mask")
        # dflash_mask.py:123 (a + s - kv < W) and 136-141 (bidirectional): both named, together
        assert mask["status"] == "fail" and mask["diagnosis"][0].startswith(
            "bidirectional attention inside the block in a sliding layer"), mask["diagnosis"]
        assert mask["diagnosis"][1].startswith(
            "sliding window measured from the query's own position: kv >= a + s - W + 1"), (
            mask["diagnosis"])
    assert first(report, FULL, "structure")["status"] == "warn"


def test_names_its_own_document_anchor_rule_and_trains_across_documents_like_the_reference(
        report):
    """Packed rows: NeMo's sampler keeps a block inside its document (core.py:258), named as
    its rule; its DFlash trainer's labels cross the boundary like the reference's (core.py:572
    passes no doc_remaining): every case holds an anchor near a document's end (the planner's),
    and the trained slots agree."""
    rule = ("an anchor needs block_size-1 further tokens of its own document (NeMo Automodel "
            "0.7.0's rule)")
    assert any(rule in first(report, case, "anchors")["summary"] for case in (FULL, Q35_FULL))
    for case in (SLIDING, FULL, Q35_SLIDING, Q35_FULL):
        parts = first(report, case, "loss")["details"]["parts"]
        assert parts["aligned_loss_mask"]["status"] == "pass", (case, parts["aligned_loss_mask"])


def test_metrics_differ_and_follow_from_its_data_token_labels(report):
    """The planner makes the drafter right on some slots: NeMo's accuracy (against its labels,
    the data tokens) differs from the reference's, named as following from the labels."""
    for case in (SLIDING, FULL, Q35_SLIDING, Q35_FULL):
        m = first(report, case, "metrics")
        assert m["status"] == "warn", m["summary"]
        assert any(k.startswith("position_") for k in m["details"]["differences"]), m["summary"]
        assert any(d.startswith("follows from the targets difference (targets are the data "
                                "tokens") for d in m["diagnosis"]), m["diagnosis"]


def test_names_its_acceptance_length_that_runs_past_an_unsupervised_slot(report):
    """compute_accept_len (core.py:139-141) lets an unsupervised slot not end the accepted run;
    speculators 0.9.0 (models/metrics.py compute_accepted_length_counts) stops there. The
    planter puts a hit past the unsupervised slots 1-2 of the full case's first block, against
    both labels (the reference's own EAL tells the readings apart too); on the other cases both
    readings agree on NeMo's numbers and nothing is said."""
    m = first(report, FULL, "metrics")
    eal = m["details"]["eal"]
    assert eal["candidate_definition"][0] == "run-past-unsupervised" and (
        "leading-run" not in eal["candidate_definition"]), m["summary"]
    assert eal["reference_definition"] == ["leading-run"], m["summary"]
    # 2 blocks: 1 + 1 (a hit past slots 1-2) and 1 + 2 (the data-token run) on NeMo's numbers
    assert ("acceptance length: an unsupervised slot does not end the accepted run (NeMo "
            "Automodel 0.7.0's acceptance length): the candidate counts hits past it; the "
            "reference stops at the first slot that is not a supervised hit (on the candidate's "
            "own logits: 'run-past-unsupervised' 2.5, the reference's 'leading-run' 2; also "
            "equal to 'product-of-marginals')") in m["diagnosis"], m["diagnosis"]
    for case in (SLIDING, Q35_SLIDING, Q35_FULL):
        m = first(report, case, "metrics")
        assert not any("unsupervised slot" in d for d in m["diagnosis"]), (case, m["diagnosis"])
        assert "run-past-unsupervised" in m["details"]["eal"]["candidate_definition"], (
            case, m["details"]["eal"])


def test_names_its_draft_config_builder(report):
    s = first(report, SLIDING, "derivation")["summary"]
    assert "layer_types ['full_attention'] where the reference derives ['sliding_attention']" in s
    assert "default_target_layer_ids [7] where the reference derives [2, 6, 9]" in s
    assert "rope_partial_rotary_factor 0.25 where the reference derives None" in first(
        report, Q35_FULL, "derivation")["summary"]
    assert "tie_word_embeddings True where the reference derives False" in first(
        report, FULL, "derivation")["summary"]
    defaults = first(report, FULL, "defaults")["summary"]
    assert "gamma: candidate None" in defaults and "block_size: candidate 16" in defaults


def test_sampler_and_derivation_refusal_run_nemo_code():
    """NeMo's own sampler admits a = T - B and draws no more than the valid anchors; a verifier
    outside its families is "not supported" (a warning), not an error."""
    framework_site("nemo")
    from transformers import LlamaConfig

    from dflash_audit.audit.frameworks import kit
    from dflash_audit.audit.frameworks.nemo_adapter import candidate

    mask = torch.zeros(1, 12)
    mask[0, 4] = mask[0, 8] = 1  # valid: a <= T - B = 8
    pos, valid = candidate.select_anchors(mask, 4, 4, torch.Generator().manual_seed(0))
    assert pos[valid].tolist() == [4, 8] and valid.tolist() == [True, True, False, False]
    none = candidate.select_anchors(torch.zeros(1, 12), 3, 4, torch.Generator())
    assert not none[1].any()
    with pytest.raises(kit.NotSupported, match="not supported by NeMo Automodel 0.7.0"):
        candidate.derive_config(LlamaConfig(num_hidden_layers=4), None)
