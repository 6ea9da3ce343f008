"""The z-lab dflash 0.1.0 adapter on z-lab's real code, installed by the tool into its cache
(``--candidate framework:zlab``; a failed install fails the test): its target-layer formula
against ours, its config reader, one step against our drafter, and ONE compare through
``--candidate framework:zlab`` against the real reference that must find the sliding-window
difference (research 4.5) and name it."""

from __future__ import annotations

import json

import pytest
import torch
from framework_support import framework_compare, framework_site

from dflash_audit.audit.checks.mask import MaskHypothesis, build_mask
from dflash_audit.model.config import zlab_build_target_layer_ids
from dflash_audit.profile import Profile

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="session")
def zlab_site():
    """The tool's install of dflash==0.1.0, importable in this process."""
    return framework_site("zlab")


@pytest.fixture(scope="session")
def zlab_compare(reference_identity, tmp_path_factory) -> tuple[int, dict]:
    """ONE compare: ``--candidate framework:zlab``, profile zlab, 6 synthetic cases (full,
    sliding and mixed layouts; windows shorter than the rows)."""
    done = framework_compare("zlab", tmp_path_factory, "--profile", "zlab", "--cases", "6")
    return done["rc"], done["json"]


def test_build_target_layer_ids_equals_zlabs_own(zlab_site):
    from dflash.model import build_target_layer_ids

    for n in range(4, 97):
        for layers in range(1, 9):
            assert zlab_build_target_layer_ids(n, layers) == build_target_layer_ids(n, layers)
    profile = Profile.load("zlab").replace(target_layers="per-draft-layer", num_draft_layers=1)
    assert profile.resolve_target_layer_ids(30) == [16]  # z-lab [15] + 1
    assert profile.replace(num_draft_layers=5).resolve_target_layer_ids(64) == [
        i + 1 for i in build_target_layer_ids(64, 5)] == [2, 17, 32, 47, 62]


def _case(layout: str, window: int | None):
    from dflash_audit.audit.cases.plan import plan_synthetic_cases

    profile = Profile.load("zlab").replace(block_size=4, num_draft_layers=1,
                                           layer_layout=layout, sliding_window=window)
    case = plan_synthetic_cases(profile, 1, seed=3)[0].case
    config = case.config.replace(layer_types=(
        "sliding_attention" if layout == "sliding" else "full_attention",),
        sliding_window=window)
    case.config = config
    return case


def test_one_step_equals_our_drafter_in_full_attention_and_shows_zlabs_window(zlab_site):
    from dflash_audit.audit.frameworks.zlab_adapter import PROVENANCE, candidate
    from dflash_audit.candidate import DrafterCandidate

    for layout, window in (("full", None), ("sliding", 5)):
        case = _case(layout, window)
        z = candidate.run_case(case.config, case.loss, case.weights, dict(case.inputs))
        ours = DrafterCandidate().run_case(case.config, case.loss, case.weights,
                                           dict(case.inputs))
        sup = ours.tensors["aligned_loss_mask"].reshape(-1).bool()
        assert sup.any()
        key = f"mask.{case.config.effective_layer_types[0]}"
        rows = sup.reshape(-1, 4).any(1).repeat_interleave(4)
        if layout == "full":  # the same math: z-lab's forward reproduces ours
            torch.testing.assert_close(z.tensors["logits"][0, sup], ours.tensors["logits"][0, sup],
                                       atol=1e-5, rtol=1e-5)
            assert torch.equal(z.tensors[key][rows], ours.tensors[key][rows])
        else:  # z-lab's own mask: the window counted from each query, a + s - W + 1
            zlab_rule = build_mask(case, MaskHypothesis(window=window, causal_block=True,
                                                        per_query=True))
            assert torch.equal(z.tensors[key][rows], zlab_rule[rows])
            assert not torch.equal(z.tensors[key][rows], ours.tensors[key][rows])
        # every output is attributed, and only z-lab's own computations to the framework
        for out_key in z.tensors:
            owner = PROVENANCE.get(out_key) or next(
                (v for k, v in PROVENANCE.items() if k.endswith(".") and out_key.startswith(k)),
                None)
            assert owner is not None, out_key
            assert (owner == "framework") == (out_key in (
                "context", "logits", "mask.sliding_attention")), out_key
        assert z.structure["target_layer_ids"] == list(case.config.target_layer_ids)


def test_compare_finds_the_window_bound_and_passes_full_attention(zlab_compare):
    code, report = zlab_compare
    assert code == 1 and report["verdict"] == "fail"
    by_case = {c["name"]: c for c in report["cases"]}
    windowed = [c for c in by_case.values() if c["layout"]["sliding_window"] is not None
                and c["layout"]["sliding_window"] < c["layout"]["seq_len"] - 1]
    assert windowed, "the spread has no sliding case with a window shorter than its row"
    causes = []
    for c in by_case.values():
        results = {(r["name"], (r.get("details") or {}).get("layer_type")): r
                   for r in c["results"]}
        if c["layout"]["layout"] == "full":  # z-lab's forward = the reference's here
            compared = {n: r for (n, _), r in results.items() if n in (
                "mask", "context", "logits", "targets", "loss", "gradients")}
            assert len(compared) == 6, c["name"]
            # z-lab's own outputs pass; what the adapter computes (PROVENANCE) agrees too,
            # marked as the adapter's (warn), never a failure
            for name, r in compared.items():
                if name in ("context", "logits"):
                    assert r["status"] == "pass", (c["name"], name, r["summary"])
                else:
                    assert r["status"] == "warn", (c["name"], name, r["summary"])
                    assert "computed by the adapter, not audited as z-lab dflash 0.1.0's" in (
                        r["summary"]), (c["name"], name)
        # the metrics and the derivation are the adapter's too (z-lab has neither)
        for name in ("metrics", "derivation"):
            r = results[(name, None)]
            assert r["status"] in ("warn", "fail") and r["details"]["provenance"] == {
                "adapter": [name]}, (c["name"], name, r["summary"])
        sliding = results.get(("mask", "sliding_attention"))
        if sliding and sliding["status"] == "fail":
            causes += sliding["diagnosis"]
    assert causes and all("measured from the query's own position: kv >= a + s - W + 1" in d
                          for d in causes), causes
    assert {c["name"] for c in windowed} >= {
        name for name, c in by_case.items()
        if any(r["name"] == "mask" and r["status"] == "fail" for r in c["results"])}


ZLAB_CONFIG = {  # the real z-lab config of the reference's converter tests (research 4.9)
    "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "num_target_layers": 36, "num_hidden_layers": 5, "hidden_size": 4096,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}


def test_read_run_config_reads_what_zlab_reads_and_refuses_disagreement(zlab_site, tmp_path):
    from dflash.model import DFlashDraftModel  # noqa: F401 - the adapter's framework imports

    from dflash_audit.audit.frameworks.zlab_adapter import read_run_config

    file = tmp_path / "config.json"
    file.write_text(json.dumps(ZLAB_CONFIG))
    run = read_run_config(tmp_path)
    assert run["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert run["target_layer_ids_speculators"] == [2, 10, 18, 26, 34]
    assert (run["block_size"], run["mask_token_id"], run["output_multiplier"],
            run["input_embedding_scale"], run["final_logit_softcapping"]) == (
        16, 151669, 1.0, 1.0, None)
    assert run["num_target_layers"] == 36 and run["dflash2"] is None
    no_ids = {**ZLAB_CONFIG, "dflash_config": {"mask_token_id": 7}}
    file.write_text(json.dumps(no_ids))
    run = read_run_config(file)
    from dflash.model import build_target_layer_ids

    assert run["target_layer_ids"] == build_target_layer_ids(36, 5)
    assert run["target_layer_ids_source"].startswith("build_target_layer_ids")
    file.write_text(json.dumps({**ZLAB_CONFIG, "dflash_config": {
        **ZLAB_CONFIG["dflash_config"], "block_size": 8}}))
    with pytest.raises(ValueError, match="block_size is 8 in dflash_config and 16 at the top "
                                         "level"):
        read_run_config(file)
    file.write_text(json.dumps({**ZLAB_CONFIG, "dflash_config": {
        **ZLAB_CONFIG["dflash_config"], "output_multiplier": 2.0}}))
    assert read_run_config(file)["output_multiplier"] == 2.0
    with pytest.raises(Exception, match="output_multiplier = 2.0 changes z-lab's drafter"):
        Profile.load(str(file))  # a profile cannot hold it: refused, naming the key
