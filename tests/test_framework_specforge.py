"""SpecForge 0.2.0's real DFlash training code audited as a candidate through the tool's own
path, ``dflash-audit compare --candidate framework:specforge`` (the tool installs
specforge==0.2.0 into its cache; a failed install fails the test): ONE compare under the zlab
profile (seed 22: four synthetic cases, each cut to one document -- llama full, qwen3 sliding
with W=1, qwen3_5 mixed with a 35-token window, gemma3_text full, one document already), and
the adapter's run-config reader, sampler and layer-id mapping on the same install.

The differences asserted are the ones read in SpecForge next to the reference
(``specforge/algorithms/common/dflash_family_model.py`` = dfm): anchors may sit in the row's
last B positions and need loss_mask[a+1] (dfm:184-187, seen in the multi-turn documents); the sliding window starts at a+s-W+1, not a-W (dfm:73-76);
labels are data tokens and the loss is divided by the sum of weights (dfm:361-362, 406-416);
no decay by default (dfm:148); a saved partial_rotary_factor the draft does not rotate, and
nested per-layer-type RoPE crashing its derivation (training/model_loading.py:211-258); one
document per row (algorithms/common/collation.py:24-68), with what it would do on packed rows
(no document mask, dfm:72; no per-document positions, dfm:294-296) listed as latent
differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from framework_support import framework_compare, framework_site

pytestmark = pytest.mark.reference


@pytest.fixture(scope="session")
def specforge_site() -> object:
    """The tool's install of specforge==0.2.0, importable in this process."""
    return framework_site("specforge")


@pytest.fixture(scope="session")
def report(reference_identity, tmp_path_factory) -> dict:
    """One compare of SpecForge against the cached reference (see the module docstring)."""
    return framework_compare("specforge", tmp_path_factory, "--profile", "zlab", "--cases",
                             "4", "--seed", "22")


LLAMA, QWEN3, QWEN35, GEMMA = ("syn-000-llama-full-doc0", "syn-001-qwen3-sliding-doc2",
                               "syn-002-qwen3_5-mixed-doc0", "syn-003-gemma3_text-full")
RAN = (LLAMA, QWEN3, QWEN35, GEMMA)


def results(report, case, check):
    return report["by"].get((case, check), [])


def statuses(report, case, check):
    return {r["status"] for r in results(report, case, check)}


def test_compare_fails_and_names_specforge(report):
    assert report["rc"] == 1, report["stdout"][-1500:]
    assert report["json"]["candidate"]["framework"]["install"].endswith(
        "frameworks/specforge-0.2.0/site")
    assert report["json"]["verdict"] == "fail"
    assert "SpecForge 0.2.0" in report["md"]


def test_shared_math_is_identical(report):
    """fc + hidden_norm, the context rule kv < a, the bidirectional block and the draft forward
    are the same math: context and full-attention masks equal, full-attention logits exact."""
    for case in RAN:
        assert statuses(report, case, "context") == {"pass"}, case
    for case in (LLAMA, QWEN35, GEMMA):  # the cases with a full-attention layer
        full = [r for r in results(report, case, "mask")
                if r["details"]["layer_type"] == "full_attention"]
        assert full and all(r["status"] == "pass" for r in full), case
    for case in (LLAMA, GEMMA):
        assert statuses(report, case, "logits") == {"pass"}, case


def test_sliding_window_bound_is_narrower(report):
    """dfm:73-76: a sliding layer sees kv >= a + s - (W-1); the reference kv >= a - W. SpecForge
    only ever attends to less (0 extra entries), first from the late slots of a block."""
    for case in (QWEN3, QWEN35):
        sliding = [r for r in results(report, case, "mask")
                   if r["details"]["layer_type"] == "sliding_attention"]
        assert [r["status"] for r in sliding] == ["fail"], case
        details = sliding[0]["details"]
        assert details["extra_attention"] == 0 and details["missing_attention"] > 0
        first = sliding[0]["first_diff"]
        assert first["kv_position"] < first["anchor_position"]
        assert any("measured from the query's own position: kv >= a + s - W + 1" in d
                   for d in sliding[0]["diagnosis"]), case
        logits = results(report, case, "logits")[0]
        assert any("follows from the mask difference" in d for d in logits["diagnosis"])


def test_anchor_sampler_differences_named(report):
    """dfm:184-187: valid anchors are a < T-1 with loss_mask[a] and loss_mask[a+1]: the row's
    last B positions are not excluded (named), and a supervised token followed by an
    unsupervised one is never an anchor."""
    for case in RAN:
        r = results(report, case, "anchors")[0]
        assert r["status"] == "fail", case
        assert any("last block_size positions" in d for d in r["diagnosis"]), case
    for case in (LLAMA, QWEN35, GEMMA):  # a multi-turn document: a user turn inside its span
        r = results(report, case, "anchors")[0]
        assert any(d.startswith("an anchor also needs loss_mask[a+1] (SpecForge 0.2.0's rule)")
                   for d in r["diagnosis"]), r["diagnosis"]
    # a rule is named as a framework's only when that framework is the candidate
    assert "ModelOpt" not in json.dumps(report["json"]["diagnoses"])


def test_loss_differs(report):
    """Hard CE against data tokens input_ids[a+s] (dfm:406-416) divided by the sum of weights
    (dfm:361-362) against the reference's CE on argmax(verifier) / (sum(m) + 1e-5): the labels
    are named by the targets check (the loss check names training on them as its consequence),
    the denominator by the loss check."""
    for case in RAN:
        t = results(report, case, "targets")[0]
        assert t["status"] == "fail" and t["diagnosis"] == [
            "targets are the data tokens input_ids[a+s], not the verifier's prediction"], case
        r = results(report, case, "loss")[0]
        assert r["status"] == "fail", case
        assert "total loss" in r["summary"]
        # training on the labels the targets check names is a consequence, not a second cause
        assert r["diagnosis"] == [
            "loss normalised by the sum of weights instead of the number of supervised tokens",
            "follows from the targets difference (targets are the data tokens input_ids[a+s], "
            "not the verifier's prediction): the loss is cross-entropy against those labels "
            "('ce-data' where the profile says 'ce')"], case
        grads = results(report, case, "gradients")[0]
        assert grads["status"] == "fail" and any("follows from" in d for d in grads["diagnosis"])


def test_derivation_differences_named(report):
    q = results(report, QWEN35, "derivation")[0]
    assert q["status"] == "fail"
    assert "rope_partial_rotary_factor 0.25" in q["summary"]
    assert "the draft layers do not apply" in q["summary"]
    g = results(report, GEMMA, "derivation")[0]
    assert g["status"] == "fail" and "KeyError: 'rope_type'" in g["summary"]
    assert statuses(report, LLAMA, "derivation") == {"pass"}  # SpecForge's generated layout


def test_what_the_adapter_set_is_never_a_plain_pass(report):
    """A sliding layout is the adapter's (SpecForge generates full attention; a user draft
    config sets the window): the derivation compared on it is marked, as are the layer ids
    the adapter converts (structure.target_layer_ids), in every case."""
    q = results(report, QWEN3, "derivation")[0]
    assert q["status"] == "warn", q["summary"]
    assert q["details"]["provenance"]["adapter"] == [
        "derivation.layer_types", "derivation.sliding_window", "derivation.saved.layer_types",
        "derivation.saved.sliding_window", "derivation.saved.use_sliding_window"]
    assert q["summary"].startswith("derivation: computed by the adapter, not audited as "
                                   "SpecForge 0.2.0's")
    for case in RAN:
        s = results(report, case, "structure")[0]
        assert s["details"]["provenance"]["adapter"] == ["structure.target_layer_ids"], case
    assert all(r["status"] != "pass" or "provenance" not in r["details"]
               for c in report["json"]["cases"] for r in c["results"])


def test_defaults_named(report):
    r = results(report, LLAMA, "defaults")[0]
    assert "gamma: candidate None (no position decay)" in r["summary"]
    assert "ce-data" in r["summary"]


def test_every_case_runs_cut_to_one_document(report):
    """SpecForge has no document mask: the planner cut each packed row to one document, and
    every case it planned is one SpecForge runs (none "not supported")."""
    names = [c["name"] for c in report["json"]["cases"]]
    assert names == list(RAN)
    assert any("SpecForge 0.2.0 takes one document per row: packed rows were cut" in n
               for n in report["json"]["notes"])
    for case in report["json"]["cases"]:
        assert case["layout"]["documents"] == 1 and case["layout"]["padding"] == 0
        assert not case["layout"].get("unsupported")


def test_what_specforge_would_do_on_packed_rows_is_a_warning(report):
    """The cut rows' missing document mask and positions are latent differences: listed with
    SpecForge's file and line in report.json, report.md and the terminal, with the cases that
    were cut, as warnings (the exit code stays the checks')."""
    latent = report["json"]["latent"]
    assert {d["capability"] for d in latent} == {
        "packed_rows", "block_attention", "draft_vocab", "sample_from_anchor", "dtypes",
        "embedding_layer", "last_layer"} and all(d["declared"] for d in latent)
    mask = next(d for d in latent if "no document mask" in d["text"])
    assert mask["text"].startswith("SpecForge 0.2.0 has no document mask: ")
    assert mask["text"].endswith("(specforge/algorithms/common/dflash_family_model.py:72)")
    assert {c.rsplit("-doc", 1)[0] for c in mask["cases"]} >= {
        n.rsplit("-doc", 1)[0] for n in (LLAMA, QWEN3, QWEN35)}
    assert f"- ⚠️ {mask['text']}" in report["md"]
    assert f"  warning (latent): {mask['text']}" in report["stdout"]
    assert "8 latent differences of the framework (warnings)" in report["stdout"]


def test_nothing_specforge_does_not_do_is_reported(report):
    """No structure failure (fc over all target layers, ids mapped to the speculators
    convention, block, mask token), no target-layer, causal-block, document or slot-0
    hypothesis; the protocol only misses verifier targets, which SpecForge does not compute."""
    for case in RAN:
        assert "fail" not in statuses(report, case, "structure"), case
        for r in results(report, case, "protocol"):
            assert r["status"] == "pass" or "targets" in r["summary"], r["summary"]
    words = json.dumps(report["json"]["diagnoses"]).lower()
    for wrong in ("counted by decoder layer", "off by one", "cross-document", "causal attention inside",
                  "slot 0", "double norm", "subset of the target layers"):
        assert wrong not in words, wrong


# --------------------------------------------------------------------- in-process parts
def test_select_anchors_is_specforges_rule(specforge_site):
    from dflash_audit.audit.frameworks.specforge_adapter import candidate

    loss_mask = torch.zeros(1, 16)
    loss_mask[0, 4:14] = 1
    loss_mask[0, 2] = 1  # isolated: never an anchor in SpecForge
    g = torch.Generator().manual_seed(0)
    a, v = candidate.select_anchors(loss_mask, 512, 4, g)
    assert sorted(a[v].tolist()) == list(range(4, 13))  # 12 is in the reference's excluded tail
    a2, v2 = candidate.select_anchors(loss_mask, 3, 4, torch.Generator().manual_seed(0))
    a3, _ = candidate.select_anchors(loss_mask, 3, 4, torch.Generator().manual_seed(0))
    assert int(v2.sum()) == 3 and torch.equal(a2, a3) and a2.tolist() == sorted(a2.tolist())
    _, valid = candidate.select_anchors(torch.tensor([[1.0, 0, 1, 0]]), 2, 2,
                                           torch.Generator().manual_seed(0))
    assert not valid.any()


def test_layer_ids_map_and_what_specforge_cannot_take(specforge_site):
    """SpecForge's ids are z-lab's (id k reads HF output_hidden_states[k+1], dflash.py:284-293):
    the shared conversion, and the two speculators ids with no SpecForge id refused by its
    CAPABILITIES (so the planner never sends them), named by the adapter if given directly."""
    from dflash_audit.audit.frameworks.specforge_adapter import (
        NotSupported,
        check_supported,
    )
    from dflash_audit.audit.frameworks.specforge_config import derive_config  # noqa: F401
    from dflash_audit.data.families import family_config
    from dflash_audit.model.config import DFlashConfig
    from dflash_audit.model.layer_ids import from_zlab_ids, to_zlab_ids

    assert to_zlab_ids([2, 9, 15, 21, 28]) == [1, 8, 14, 20, 27]
    assert from_zlab_ids([1, 8, 14, 20, 27]) == [2, 9, 15, 21, 28]
    verifier = family_config("llama", num_hidden_layers=12, vocab_size=128)
    inputs = {"document_ids": torch.zeros(1, 8, dtype=torch.long)}
    config = DFlashConfig.from_verifier_config(verifier, target_layer_ids=[3, 7],
                                               mask_token_id=127)
    assert check_supported(config, inputs) == [2, 6]
    for ids, what in (([0, 5], "target layer id 0 (the embedding output"),
                      ([5, 12], "target layer id 12 (the last layer's output before the final")):
        bad = config.replace(target_layer_ids=ids)
        with pytest.raises(NotSupported, match=r"not supported by SpecForge 0\.2\.0") as err:
            check_supported(bad, inputs)
        assert what in str(err.value)


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


OFFLINE = "model:\n  target_model_path: Qwen/Qwen3-8B\n{model}data:\n  hidden_states_path: /f\n"


def test_read_run_config_defaults_and_explicit(specforge_site, tmp_path):
    from dflash_audit.audit.frameworks.specforge_config import read_run_config

    base = read_run_config(_write(tmp_path, OFFLINE.format(model="") +
                                  "training:\n  strategy: dflash\n"))
    assert (base["block_size"], base["num_draft_layers"], base["target_layers"]) == (
        16, 1, "per-draft-layer")
    assert (base["weighting"], base["gamma"], base["loss"], base["max_anchors"]) == (
        "none", None, "ce-data", 512)
    tuned = read_run_config(_write(tmp_path, OFFLINE.format(
        model="  draft_num_hidden_layers: 5\n  draft_block_size: 8\n  mask_token_id: 7\n") +
        "training:\n  strategy: dflash\n  loss_decay_gamma: 7.0\n  num_anchors: 64\n"
        "  ttt_length: 3\n"))
    assert (tuned["block_size"], tuned["num_draft_layers"], tuned["gamma"],
            tuned["weighting"], tuned["mask_token_id"]) == (8, 5, 7.0, "fixed-exp-decay", 7)
    assert "training.ttt_length" in tuned["unused_by_dflash"]
    dpace = read_run_config(_write(tmp_path, OFFLINE.format(model="") +
                                   "training:\n  strategy: dflash\n  loss_type: dpace\n"
                                   "  dpace_alpha: 0.3\n"))
    assert (dpace["weighting"], dpace["dpace_alpha"]) == ("dpace", 0.3)


def test_read_run_config_refuses(specforge_site, tmp_path):
    from dflash_audit.audit.frameworks.specforge_config import read_run_config

    with pytest.raises(ValueError, match="strategy is 'eagle3'"):
        read_run_config(_write(tmp_path, OFFLINE.format(model="")))
    with pytest.raises(ValueError, match="dpace-cumulative-confidence-only"):
        read_run_config(_write(tmp_path, OFFLINE.format(model="") + "training:\n  strategy: "
                               "dflash\n  loss_type: dpace-cumulative-confidence-only\n"))
    with pytest.raises(ValueError, match="not a valid SpecForge 0.2.0 run config.*no_such"):
        read_run_config(_write(tmp_path, OFFLINE.format(model="  no_such: 1\n")))


def test_every_schema_key_is_classified(specforge_site):
    """Each key of SpecForge 0.2.0's run-config schema is read (profile or recipe), known to be
    unused by DFlash, or known not to change training: none can be silently ignored."""
    import typing

    from pydantic import BaseModel
    from specforge.config.schema import Config

    from dflash_audit.audit.frameworks import specforge_config as s

    def leaves(model, prefix=""):
        for name, f in model.model_fields.items():
            sub = [a for a in (typing.get_args(f.annotation) or (f.annotation,))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
            if sub and not (prefix + name).startswith(s.NEUTRAL_PREFIXES):
                yield from leaves(sub[0], prefix + name + ".")
            else:
                yield prefix + name

    known = set(s.PROFILE_KEYS) | set(s.RECIPE_KEYS) | set(s.UNUSED_BY_DFLASH)
    keys = list(leaves(Config))
    assert len(keys) > 90
    assert [k for k in keys if k not in known and not k.startswith(s.NEUTRAL_PREFIXES)] == []
