"""serve-check's z-lab dflash 0.1.0 side on z-lab's real code, installed by the tool into the
suite's cache (``install_engine``; a failed install fails the test): its probe on tiny
checkpoints (z-lab's own window origin, a sliding layer z-lab reads differently, a refused
folder) and the served drafting step against our training forward (equal on a full-attention
checkpoint, the differences named and explained when z-lab's forward differs)."""

from __future__ import annotations

import json
import sys

import pytest
from serve_support import TINY, edit_config, make_checkpoint

from dflash_audit.serve.engines import ENGINES, install_engine, run_probe

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def zlab_site():
    """The tool's install of dflash==0.1.0, importable in this process too."""
    site = install_engine(ENGINES["zlab"])
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny verifier, and drafters over it: TINY (mixed: layer 1 sliding W=8), full."""
    from data_support import make_tiny_verifier

    base = tmp_path_factory.mktemp("serve-zlab")
    verifier = make_tiny_verifier(base / "verifier")
    return {"base": base, "verifier": verifier,
            "tiny": make_checkpoint(base / "tiny", verifier=str(verifier)),
            "full": make_checkpoint(base / "full", verifier=str(verifier),
                                    layer_types=("full_attention", "full_attention"),
                                    sliding_window=None)}


def _probe(folder):
    from dflash_audit.serve.probes.zlab_probe import probe

    return probe(folder)


def test_probe_reads_zlabs_window_from_the_query(zlab_site, folders):
    from dflash_audit.serve.engines import PROBES as probes

    rec = run_probe(probes / "zlab_probe.py", folders["tiny"], zlab_site, "z-lab dflash 0.1.0")
    f = rec.fields
    assert rec.refused is None and rec.side == "z-lab dflash 0.1.0"
    assert (f["layers.0.attention"], f["layers.0.sliding_window"], f["layers.0.block_causal"],
            f["layers.0.window_origin"]) == ("full", None, False, None)
    # z-lab counts W back from each query (query_pos - key_pos < W): slot 0 sees W-1 context
    # keys, where the reference trains kv >= a - W (W keys) for every slot
    assert (f["layers.1.attention"], f["layers.1.sliding_window"], f["layers.1.block_causal"],
            f["layers.1.window_origin"]) == ("sliding", 8, True, "query")
    slot0 = rec.masks["1"]["rows"][0][:rec.masks["1"]["total_seq_len"]]
    assert sum(slot0) == 7
    assert "_attention_mask (line 157)" in rec.sources["layers.1.window_origin"]
    assert f["target_layer_ids"] == list(TINY["target_layer_ids"]) == [1, 3, 4]
    assert "z-lab ids [0, 2, 3]" in rec.sources["target_layer_ids"]
    assert (f["fc.in_features"], f["mask_token_id"], f["block_size"],
            f["num_speculative_tokens"], f["sample_from_anchor"]) == (96, 299, 4, 3, False)
    assert (f["rope.type"], f["rope.theta"], f["rope.rotary_dim"], f["rope.neox_style"],
            f["rope.scaling"], f["rope.max_positions"]) == ("default", 10000.0, 8, True, None,
                                                            None)
    assert (f["lm_head.source"], f["embed_tokens.source"], f["draft_vocab_size"],
            f["draft_vocab.mapping"], f["norm.one_plus_weight"]) == ("target", "target", 300,
                                                                     "none", False)
    assert (f["num_hidden_layers"], f["hidden_size"], f["num_attention_heads"],
            f["num_key_value_heads"], f["head_dim"], f["intermediate_size"]) == (
        2, 32, 4, 2, 8, 64)
    assert any("converted by the adapter" in n for n in rec.notes)
    assert any("Unrecognized model" in n for n in rec.notes)  # z-lab's loader, as is


def test_probe_sliding_layer_without_a_window_and_non_causal(zlab_site, folders):
    from dflash_audit.serve.probes.zlab_probe import write_zlab_folder

    # a z-lab config whose sliding layer lost its window (use_sliding_window false: Qwen3Config
    # drops sliding_window): the reference runs it as full bidirectional attention, z-lab
    # as full attention with a CAUSAL block (is_causal follows the layer type)
    served = folders["base"] / "zlab-nowindow"
    write_zlab_folder(folders["tiny"], served)
    edit_config(served, lambda d: d.update(use_sliding_window=False))
    f = _probe(served).fields
    assert (f["layers.1.attention"], f["layers.1.sliding_window"], f["layers.1.block_causal"],
            f["layers.1.window_origin"]) == ("full", None, True, None)
    assert f["layers.0.block_causal"] is False
    # a non-causal window: z-lab's is_causal=False for every layer, the window two-sided
    nc = make_checkpoint(folders["base"] / "noncausal", sliding_window_non_causal=True)
    rec = _probe(nc)
    assert (rec.fields["layers.1.block_causal"], rec.fields["layers.1.window_origin"]) == (
        False, "query")


def test_probe_refuses_what_zlab_cannot_load(zlab_site, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    rec = _probe(tmp_path)
    assert rec.refused and "neither a z-lab config" in rec.refused and not rec.fields


def test_compare_drafting_equal_on_full_attention(zlab_site, folders):
    from dflash_audit.serve.drafting import compare_drafting

    r = compare_drafting(folders["full"], num_prompts=1, max_new_tokens=8)
    s = r.step
    assert s.equal and s.max_abs_diff <= s.tolerance == 1e-4 and s.differences == []
    assert s.served_drafts == s.trained_drafts and len(s.served_drafts) == 3
    assert s.context_tokens > 8 and r.verifier == str(folders["verifier"])
    a = r.acceptance
    assert a.prompts == 1 and a.served_verify_steps >= 1 and a.trained_blocks >= 1
    assert 1.0 <= a.served <= 4.0 and 1.0 <= a.trained <= 4.0


def _run(folders, checkpoint, served=None):
    from dflash_audit.serve.probes.zlab_drafting import run

    return run({"checkpoint": str(checkpoint), "verifier": str(folders["verifier"]),
                "served": str(served) if served else None,
                "prompts": ["What is the capital of France?"], "max_new_tokens": 8,
                "tolerance": 1e-4, "acceptance": False})["step"]


def test_drafting_names_the_window_origin_on_the_mixed_checkpoint(zlab_site, folders):
    step = _run(folders, folders["tiny"])  # context 84 tokens > W = 8
    assert not step["equal"] and step["max_abs_diff"] > 1e-3
    assert step["differences"] == ["layers.1.window_origin: served 'query', trained 'anchor'"]
    assert step["explained"] and step["explained_max_abs_diff"] <= 1e-4


def test_drafting_names_an_edited_served_config(zlab_site, folders):
    from dflash_audit.serve.probes.zlab_probe import write_zlab_folder

    # layer 0 flipped to sliding in the folder z-lab is given
    flipped = folders["base"] / "zlab-flipped"
    write_zlab_folder(folders["full"], flipped)
    edit_config(flipped, lambda d: d.update(layer_types=["sliding_attention", "full_attention"],
                                            sliding_window=4, use_sliding_window=True))
    step = _run(folders, folders["full"], flipped)
    assert not step["equal"]
    assert "layers.0.attention: served 'sliding', trained 'full'" in step["differences"]
    assert step["explained"]
    # rope theta removed: z-lab's Qwen3Config default (10000) is not what was trained (1e6)
    trained = make_checkpoint(folders["base"] / "theta", verifier=str(folders["verifier"]),
                              layer_types=("full_attention", "full_attention"),
                              sliding_window=None, rope_theta=1e6)
    no_theta = folders["base"] / "zlab-notheta"
    write_zlab_folder(trained, no_theta)
    edit_config(no_theta, lambda d: d["rope_parameters"].pop("rope_theta"))
    step = _run(folders, trained, no_theta)
    assert not step["equal"]
    assert step["differences"] == ["rope.theta: served 10000.0, trained 1000000.0"]
    assert step["explained"]


def test_drafting_a_draft_vocabulary_checkpoint_compares_in_verifier_ids(zlab_site, folders):
    """z-lab drafts over the target's whole head; our drafter over V_d ids mapped by d2t: the
    comparison runs in verifier ids (it raised 'size of tensor a (300) must match ... (64)')
    and names the vocabulary; the acceptance estimate maps draft ids too."""
    from dflash_audit.serve.probes.zlab_drafting import run

    vocab = make_checkpoint(folders["base"] / "vocab", verifier=str(folders["verifier"]),
                            layer_types=("full_attention", "full_attention"),
                            sliding_window=None, draft_vocab_size=64)
    out = run({"checkpoint": str(vocab), "verifier": str(folders["verifier"]), "served": None,
               "prompts": ["What is the capital of France?"], "max_new_tokens": 8,
               "tolerance": 1e-4, "acceptance": True})
    step = out["step"]
    assert "draft_vocab_size: served 300, trained 64" in step["differences"]
    assert step["max_abs_diff"] == step["max_abs_diff"]  # finite, over the 64 shared ids
    assert len(step["trained_drafts"]) == 3 and all(0 <= t < 300 for t in step["trained_drafts"])
    assert out["acceptance"]["trained_blocks"] >= 1 and out["acceptance"]["trained"] >= 1.0
