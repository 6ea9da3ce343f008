"""NVIDIA ModelOpt 0.47.0's real DFlash trainer audited as the candidate through the tool's own
path, ``dflash-audit compare --candidate framework:modelopt`` (the tool installs the adapter's
pinned REQUIREMENTS into its cache; a failed install fails the test): ONE compare under a
profile ModelOpt expresses as written (examples/profiles/modelopt-self-distillation.toml;
seed 0: llama full, qwen3 sliding W=29, qwen3 full, each cut to one document), whose
differences are cross-checked against ModelOpt's source (nvidia-modelopt==0.47.0,
modelopt/torch/speculative/...); its recipe reader, its row layout and what it refuses.
ModelOpt is imported only in subprocesses (the candidate's, and one that reads its defaults).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from framework_support import framework_compare, framework_site

from dflash_audit.audit.frameworks import modelopt_adapter as adapter
from dflash_audit.audit.frameworks import modelopt_config
from dflash_audit.audit.frameworks.capabilities import Capabilities
from dflash_audit.audit.frameworks.modelopt_config import NotSupported, dflash_settings
from dflash_audit.audit.frameworks.modelopt_recipe import (
    ARCHITECTURE_DEFAULTS,
    DFLASH_DEFAULTS,
    TRAINING_DEFAULTS,
    RecipeError,
    read_run_config,
)
from dflash_audit.audit.frameworks.modelopt_rows import (
    plan_rows,
    to_packed_mask,
    to_slots,
)
from dflash_audit.data.families import family_config
from dflash_audit.limits import limit_s
from dflash_audit.model.config import DFlashConfig
from dflash_audit.model.loss import LossSpec

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "examples" / "profiles" / "modelopt-self-distillation.toml"
RECIPE = "modelopt_recipes/general/speculative_decoding/dflash.yaml"
pytestmark = pytest.mark.reference


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
    return env


@pytest.fixture(scope="session")
def modelopt_site() -> Path:
    """The tool's install of ``adapter.REQUIREMENTS`` (what the candidate imports); not put
    on this process's path by the tests that use it: ModelOpt runs in subprocesses here."""
    return framework_site("modelopt", importable=False)


@pytest.fixture(scope="session")
def modelopt_report(reference_identity, tmp_path_factory) -> dict:
    """report.json of the one compare (see the module docstring), ``_exit`` its exit code."""
    done = framework_compare("modelopt", tmp_path_factory, "--profile", str(PROFILE),
                             "--cases", "3", "--seed", "0")
    return {**done["json"], "_exit": done["rc"]}


def _results(report: dict) -> dict[tuple[str, str], dict]:
    return {(res["case"], res["name"]): res for case in report["cases"]
            for res in case["results"] if res["name"] != "mask"} | {
        (res["case"], f"mask.{res['details']['layer_type']}"): res
        for case in report["cases"] for res in case["results"] if res["name"] == "mask"}


# ----------------------------------------------------------------------------- the compare
CASES = ("syn-000-llama-full-doc0", "syn-001-qwen3-sliding-doc0", "syn-009-qwen3-full-doc1")


def test_every_planned_case_is_one_modelopt_runs(modelopt_report):
    """The planner filled the budget with cases inside ModelOpt's CAPABILITIES (its three
    final-norm families here, full or all-sliding layouts, one document per row)."""
    report = modelopt_report
    assert [c["name"] for c in report["cases"]] == list(CASES)
    assert all(not c["layout"].get("unsupported") for c in report["cases"])
    notes = " | ".join(report["notes"])
    assert "not supported by NVIDIA ModelOpt 0.47.0: mixed draft-layer layout" in notes
    assert "not supported by NVIDIA ModelOpt 0.47.0: verifier family 'gemma3_text'" in notes
    assert report["candidate"]["framework"]["install"].endswith(
        "frameworks/modelopt-0.47.0/site")


def test_compare_fails_and_names_what_modelopt_does(modelopt_report):
    """Each reported difference was cross-checked in ModelOpt 0.47.0's source."""
    report, res = modelopt_report, _results(modelopt_report)
    assert report["_exit"] == 1 and report["verdict"] == "fail"
    for case in CASES:
        # what ModelOpt does like the reference: fc over the z-lab layers (ids k+1,
        # hf_dflash.py:982-984), its teacher = base logits at a+s-1 through the re-applied
        # final norm (hf_dflash.py:846-853, modeling_final_norm.py:119-145)
        for check in ("protocol", "targets"):
            assert res[(case, check)]["status"] == "pass", res[(case, check)]["summary"]
        # the structures agree, but the frozen parts' names are the adapter's mapping
        structure = res[(case, "structure")]
        assert structure["status"] == "warn" and structure["diagnosis"] == [
            "structure: computed by the adapter, not audited as NVIDIA ModelOpt 0.47.0's "
            "(structure.state_dict.frozen_names)"], structure
        assert "structures agree" in structure["summary"]
        # aligned mask and per-slot weights: decay objective with factor 7 = exp(-(s-1)/7),
        # slot 0 and padding blocks excluded (hf_dflash.py:795-839)
        parts = res[(case, "loss")]["details"]["parts"]
        assert parts["aligned_loss_mask"]["status"] == "pass"
        assert parts["loss_weights.kl_div"]["status"] == "pass"
        # its soft cross-entropy (KL + H(teacher)) over sum(w) + 1e-6 (hf_dflash.py:841-859)
        assert parts["total"]["status"] == "fail"
        assert res[(case, "loss")]["diagnosis"] == [
            "soft cross-entropy -sum p log q (= KL + the teacher's entropy H(p): KL's gradient, "
            "a larger value) where the profile says 'kl_div'",
            "loss normalised by the sum of weights instead of the number of supervised tokens"]
        # ModelOpt's sampler allows a = T - B (max_anchor = seq_len - bs, inclusive,
        # hf_dflash.py:617-620); the reference excludes the last B positions
        assert res[(case, "anchors")]["status"] == "fail"
        assert any(c.startswith("anchors admitted at T-B: a <= T - block_size (NVIDIA ModelOpt "
                                "0.47.0's rule); the block of an anchor")
                   for c in res[(case, "anchors")]["diagnosis"])
        derived = " | ".join(res[(case, "derivation")]["diagnosis"])
        # its saved use_sliding_window None is the reference's False for Qwen3Config (no
        # window either way): not a difference; on the sliding case it is one (None vs True)
        differing = res[(case, "derivation")]["details"]["differing"]
        assert ("saved.use_sliding_window" in differing) == (case == CASES[1]), differing
        # nothing is inherited from the verifier under transformers 5.19: Qwen3Config's own
        # defaults win over the setdefault list (hf_dflash.py:403-413)
        for cause in ("num_attention_heads 32", "head_dim 128", "intermediate_size 22016"):
            assert cause in derived, (cause, derived)
    # the full layers: the context rule kv < a and the bidirectional block as the reference
    for case in (CASES[0], CASES[2]):
        assert res[(case, "mask.full_attention")]["status"] == "pass"
    # one window for the sliding layers measured from each query, kv > a + s - W
    # (hf_dflash.py:709-711)
    sliding = res[(CASES[1], "mask.sliding_attention")]
    assert sliding["status"] == "fail"
    assert "measured from the query's own position: kv >= a + s - W + 1" in sliding[
        "diagnosis"][0]
    # the draft trains with RoPE theta 10000: modify's setattr(rope_theta) never reaches
    # rope_parameters under transformers 5.19 (hf_dflash.py:423-437)
    assert "RoPE theta 10000 in the draft layers, not the verifier's rope_theta" in res[
        (CASES[1], "logits")]["diagnosis"]
    # on a llama3-scaled verifier that default is theta 10000 without the scaling: one named
    # cause (with the hidden_norm eps below), nothing unexplained
    llama = res[(CASES[0], "logits")]["diagnosis"]
    assert llama[0].startswith("RoPE theta 10000 and no scaling in the draft layers (rope_type "
                               "'default' where the verifier uses 'llama3')"), llama
    assert not any(d.startswith("unexplained") for d in llama), llama
    # hidden_norm with ModelOpt's eps 1e-6 (default_config.py:28), not the verifier's 1e-5
    assert res[(CASES[0], "context")]["diagnosis"] == [
        "hidden_norm eps 1e-06, not the verifier's rms_norm_eps"]


def test_compare_reports_nothing_modelopt_does_not_do(modelopt_report):
    """No check fails that ModelOpt's code does not explain: the failures are the ones named
    above (plus what follows from them)."""
    res = _results(modelopt_report)
    failing = {name.split(".")[0] for (case, name), r in res.items() if r["status"] == "fail"}
    assert failing <= {"derivation", "mask", "context", "logits", "loss", "gradients",
                       "anchors"}, failing


def test_capabilities_are_what_modelopt_refuses():
    """The CAPABILITIES the planner applies and the adapter's own refusals agree: a case the
    planner keeps is one dflash_settings accepts; each case it drops names what ModelOpt's
    code refuses (see test_dflash_settings_refuses_what_modelopt_cannot_train)."""
    caps = Capabilities.from_dict(adapter.CAPABILITIES)
    assert not caps.any_target_layer_count and not caps.embedding_layer
    assert caps.loss_mixes is False and caps.window_below_block is False
    assert adapter.NAME == modelopt_config.NAME and adapter.VERSION == modelopt_config.VERSION


# ------------------------------------------------------------------ ModelOpt's own defaults
@pytest.fixture(scope="module")
def modelopt_own(modelopt_site) -> dict:
    """One subprocess with ModelOpt imported (~8 s of its imports, paid once): its own
    defaults (its DFlashConfig, default_config, TrainingArguments), its ``load_recipe`` of its
    recipe, and its derivation for each case of the default spread built on the CPU and on
    the meta device (``[model_type, cpu, meta]``; a refusal as its message)."""
    script = f"""
import json, warnings; warnings.filterwarnings("ignore")
from modelopt.torch.speculative.config import DFlashConfig
from modelopt.torch.speculative.dflash.default_config import default_dflash_config
from modelopt.torch.speculative.plugins.hf_training_args import TrainingArguments
from modelopt.recipe import load_recipe
from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.frameworks import modelopt_config as mc
from dflash_audit.profile import Profile

def derive(verifier, config, **kw):
    try:
        return mc.derive(verifier, config, **kw)
    except mc.NotSupported as exc:
        return str(exc)

derived = [[p.case.config.verifier_model_type,
            derive(p.case.verifier.config, p.case.config, device="cpu"),
            derive(p.case.verifier.config, p.case.config)]
           for p in plan_synthetic_cases(Profile.load("reference-model"), 12, seed=0)
           if p.case.verifier is not None]
recipe = load_recipe({str(modelopt_site / RECIPE)!r})
print(json.dumps({{"dflash": {{k: f.default for k, f in DFlashConfig.model_fields.items()}},
    "arch": default_dflash_config, "training": TrainingArguments().model_dump(),
    "recipe": recipe.dflash.model_dump(), "recipe_training": recipe.training.model_dump(),
    "derived": derived}}, default=str))
"""
    proc = subprocess.run([sys.executable, "-c", script], env=_env(modelopt_site),
                          capture_output=True, text=True, timeout=limit_s(600), check=False)
    assert proc.returncode == 0, proc.stderr[-1500:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_derivation_built_on_the_meta_device_is_the_cpu_builds(modelopt_own):
    """ModelOpt's derivation reads configs and the rotary module's shape, never a weight: the
    meta-device build (no random initialisation of its default 22016-wide draft) derives every
    field a CPU build does, or refuses alike, for each family of the default spread."""
    rows = modelopt_own["derived"]
    assert len([r for r in rows if isinstance(r[1], dict)]) >= 6
    for family, cpu, meta in rows:
        assert meta == cpu, family


def test_recipe_defaults_are_modelopts(modelopt_own, modelopt_site):
    """The reader's pinned defaults equal ModelOpt's own (its DFlashConfig, default_config,
    TrainingArguments), and ModelOpt's own ``load_recipe`` reads its recipe as the reader does."""
    own = modelopt_own
    assert own["dflash"] == DFLASH_DEFAULTS
    assert own["arch"] == ARCHITECTURE_DEFAULTS
    assert {k: own["training"][k] for k in TRAINING_DEFAULTS} == TRAINING_DEFAULTS
    fields = read_run_config(modelopt_site / RECIPE)
    assert own["recipe"]["dflash_loss_objective"] == "dpace" == fields["weighting"]
    assert own["recipe"]["dflash_loss_decay_factor"] == 4.0  # set, and ignored under D-PACE
    assert own["recipe"]["dflash_block_size"] == fields["block_size"] == 8
    assert own["recipe"]["dflash_num_anchors"] == fields["max_anchors"] == 512
    assert own["recipe_training"]["training_seq_len"] == 4096


# ------------------------------------------------------------------------ the recipe reader
def test_read_run_config_of_modelopts_recipe(modelopt_site):
    fields = read_run_config(modelopt_site / RECIPE)
    assert fields | {"description": ""} == {
        "name": "modelopt-dflash", "description": "", "block_size": 8, "gamma": 4.0,
        "weighting": "dpace", "dpace_alpha": 0.5, "loss": "kl_div", "max_anchors": 512,
        "target_layers": "per-draft-layer", "num_draft_layers": 5, "sample_from_anchor": False,
        "sliding_window_non_causal": False, "layer_layout": "full", "optimizer": "adamw",
        "dtype": "bf16"}
    assert "dflash_loss_decay_factor 4 is ignored" in fields["description"]
    assert "training.learning_rate" in fields["description"]  # read, listed as not audited


def _recipe(tmp_path: Path, dflash: dict, training: dict | None = None) -> Path:
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"metadata": {"recipe_type": "speculative_dflash"},
                                    "training": {"answer_only_loss": True, **(training or {})},
                                    "dflash": dflash}))
    return path


@pytest.mark.parametrize(("dflash", "training", "expected"), [
    ({"dflash_loss_objective": "decay", "dflash_loss_decay_factor": 7.0},
     {}, {"weighting": "fixed-exp-decay", "gamma": 7.0}),
    ({"dflash_loss_objective": "decay"}, {}, {"weighting": "none"}),
    ({"dflash_self_logit_distillation": False}, {}, {"loss": "ce-data"}),
    ({"dflash_swa_window_size": 64, "dflash_draft_attention": "causal"}, {},
     {"layer_layout": "sliding", "sliding_window": 64, "sliding_window_non_causal": False}),
    ({"dflash_swa_window_size": 64}, {},
     {"layer_layout": "sliding", "sliding_window": 64, "sliding_window_non_causal": True}),
    ({"dflash_draft_attention": "causal"}, {"training_seq_len": 1024},
     {"layer_layout": "sliding", "sliding_window": 1024, "sliding_window_non_causal": False}),
    ({"dflash_architecture_config": {"num_hidden_layers": 2, "target_layer_ids": [1, 8]},
      "dflash_mask_token_id": 7}, {"bf16": False},
     {"num_draft_layers": 2, "target_layers": [2, 9], "mask_token_id": 7, "dtype": "fp32"}),
])
def test_read_run_config_maps_what_modelopt_does(tmp_path, dflash, training, expected):
    fields = read_run_config(_recipe(tmp_path, dflash, training))
    assert {k: fields.get(k) for k in expected} == expected


@pytest.mark.parametrize(("dflash", "training", "key"), [
    ({"dflash_atention_sink": True}, {}, "dflash.dflash_atention_sink"),
    ({"dflash_attention_sink": True}, {}, "dflash.dflash_attention_sink"),
    ({"dflash_export_rope_scaling": {"type": "yarn"}}, {}, "dflash.dflash_export_rope_scaling"),
    ({"dflash_architecture_config": {"num_hidden_layers": 3, "target_layer_ids": [1, 2]}}, {},
     "dflash.dflash_architecture_config.target_layer_ids"),
    ({"dflash_architecture_config": {"num_attention_heads": 8}}, {},
     "dflash.dflash_architecture_config.num_attention_heads"),
    ({}, {"answer_only_loss": False}, "training.answer_only_loss"),
    ({}, {"training_seq_len": 100}, "training.training_seq_len"),
    ({}, {"label_smoothing_factor": 0.1}, "training.label_smoothing_factor"),
])
def test_read_run_config_refuses_what_it_cannot_express(tmp_path, dflash, training, key):
    with pytest.raises(RecipeError, match=f"{key.replace('.', '[.]')}:"):
        read_run_config(_recipe(tmp_path, dflash, training))


# ------------------------------------------------------------------- settings and refusals
def _config(**kw) -> DFlashConfig:
    args = {"target_layer_ids": [3, 7], "mask_token_id": 127, "num_hidden_layers": 2,
            "block_size": 4, **kw}
    return DFlashConfig.from_verifier_config(family_config("llama", num_hidden_layers=12,
                                                           vocab_size=128), **args)


def test_dflash_settings_of_a_case():
    s = dflash_settings(_config(), LossSpec(loss="kl_div", gamma=7.0), 5)
    assert s["dflash_architecture_config"]["target_layer_ids"] == [2, 6]  # z-lab ids
    assert (s["dflash_self_logit_distillation"], s["dflash_loss_objective"],
            s["dflash_loss_decay_factor"], s["dflash_swa_window_size"],
            s["dflash_draft_attention"]) == (True, "decay", 7.0, None, "bidirectional")
    sliding = dflash_settings(_config(layer_types=["sliding_attention"] * 2, sliding_window=8),
                              LossSpec(loss="ce", weighting="dpace"), 5)
    assert (sliding["dflash_swa_window_size"], sliding["dflash_draft_attention"],
            sliding["dflash_self_logit_distillation"], sliding["dflash_loss_objective"]) == (
        8, "causal", False, "dpace")


@pytest.mark.parametrize(("config", "loss", "what"), [
    ({"target_layer_ids": [3, 5, 7]}, "kl_div", "one target layer per draft layer"),
    ({"target_layer_ids": [0, 7]}, "kl_div", "target layer 0"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "kl_div",
     "one attention mask to every draft layer"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 2}, "kl_div", "block_size"),
    ({"draft_vocab_size": 64}, "kl_div", "draft vocabulary"),
    ({"sample_from_anchor": True}, "kl_div", "sample_from_anchor"),
    ({}, "jsd", "loss 'jsd'"),
])
def test_dflash_settings_refuses_what_modelopt_cannot_train(config, loss, what):
    """ModelOpt's own refusals, and the same cases outside its CAPABILITIES (so the planner
    never sends them: "not supported", never a failure)."""
    from types import SimpleNamespace

    with pytest.raises(NotSupported, match="not supported by NVIDIA ModelOpt 0.47.0") as err:
        dflash_settings(_config(**config), LossSpec(loss=loss), 5)
    assert what in str(err.value)
    case = SimpleNamespace(config=_config(**config), loss=LossSpec(loss=loss), dtype="fp32",
                           inputs={"document_ids": torch.zeros(1, 8, dtype=torch.long)},
                           weights={})
    assert Capabilities.from_dict(adapter.CAPABILITIES).unsupported(case)


def test_declarations():
    assert adapter.NAME == "NVIDIA ModelOpt" and adapter.VERSION == "0.47.0"
    assert all("==" in r for r in adapter.REQUIREMENTS)
    assert "nvidia-modelopt==0.47.0" in adapter.REQUIREMENTS
    assert adapter.CAPABILITIES["packed_rows"] is False
    assert adapter.CAPABILITIES["draft_vocab"] is False
    assert set(adapter.PROVENANCE.values()) == {"framework", "adapter"}
    assert adapter.PROVENANCE["settings.base_hidden_prenorm"] == "adapter"


# ---------------------------------------------------------------------------- row layout
def _packed_inputs():
    doc = torch.tensor([[0] * 6 + [1] * 5 + [-1] * 2])  # T = 13
    return {"document_ids": doc, "anchor_positions": torch.tensor([1, 3, 7, 0]),
            "anchor_valid": torch.tensor([True, True, True, False])}


def test_rows_one_conversation_each():
    layout = plan_rows(_packed_inputs(), block_size=2)
    assert (layout.starts, layout.lengths, layout.row_len) == ([0, 6], [6, 5], 6)
    assert layout.anchor_row.tolist() == [0, 0, 1, 0]
    assert layout.anchor_block.tolist() == [0, 1, 0, 2]
    assert layout.anchors.tolist() == [[1, 3, 0], [1, 0, 0]]
    assert layout.keep.tolist() == [[True, True, False], [True, False, False]]
    per_row = torch.arange(2 * 3 * 2).reshape(2, 6)  # [R, N*B]: slot ids
    assert to_slots(layout, per_row).tolist() == [[0, 1, 2, 3, 6, 7, 4, 5]]


def test_rows_mask_back_in_packed_coordinates():
    """A ModelOpt-style mask (context kv < a, own block; float 0 / finfo.min) maps to the
    packed row: row 1's context is packed 6..6+a-1, blocks of other rows never attend."""
    layout = plan_rows(_packed_inputs(), block_size=2)
    R, N, B, L = 2, 3, 2, 6
    keep = torch.zeros(R, 1, N * B, L + N * B, dtype=torch.bool)
    for r in range(R):
        for q in range(N * B):
            n = q // B
            keep[r, 0, q, :int(layout.anchors[r, n])] = True
            keep[r, 0, q, L + n * B:L + (n + 1) * B] = True
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    packed = to_packed_mask(layout, mask, seq_len=13)
    assert packed.shape == (8, 13 + 8)
    assert packed[4].nonzero().reshape(-1).tolist() == [6, 13 + 4, 13 + 5]  # anchor 7, doc 1
    assert packed[2].nonzero().reshape(-1).tolist() == [0, 1, 2, 13 + 2, 13 + 3]  # anchor 3


# ---------------------------------------------------------------------- bf16 training dtype
_BF16_STEP = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_framework_modelopt import _config
from dflash_audit.audit.cases.synthetic import synthetic_case
from dflash_audit.audit.checks.structure import check_structure
from dflash_audit.audit.frameworks.modelopt_adapter import candidate
from dflash_audit.audit.precision import in_dtype
from dflash_audit.audit.protocol import validate_outputs
from dflash_audit.audit.sides.run_sides import run_candidate
from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.loss import LossSpec

out = {{}}
case = synthetic_case("c", _config(), LossSpec(loss="kl_div"), seed=3, seq_len=40,
                      num_documents=1, pad=0, max_anchors=4)
for dtype in ("fp32", "bf16"):
    low = in_dtype(case, dtype)
    mo, failed = run_candidate(candidate, low)
    assert failed is None, failed.summary
    ours, _ = run_candidate(DrafterCandidate(), low)
    res = check_structure(low, mo, ours)
    sd = mo.structure["state_dict"]
    out[dtype] = {{"trainable": sorted({{e["dtype"] for e in sd.values() if e["trainable"]}}),
                  "frozen": sorted({{sd[k]["dtype"] for k in ("embed_tokens.weight",
                                                              "verifier_norm.weight")}}),
                  "master": mo.structure.get("master_weights"),
                  "protocol": [f.message for f in validate_outputs(mo, low)],
                  "status": res.status, "summary": res.summary}}
print(json.dumps(out))
"""


def test_a_bf16_case_trains_modelopts_draft_in_bf16_and_fails_on_its_missing_master(
        modelopt_site):
    """ModelOpt's recipe trains in bf16 (dflash.yaml ``bf16: true``) on a bf16 base (its
    trainer loads the checkpoint's dtype) and casts its draft to the base's dtype
    (hf_dflash.py:511): the adapter runs a bf16 case that way, so ModelOpt's trainable
    parameters are bf16 with no float32 master copy (ModelOpt PR 2322's bug) and the structure
    check fails naming the class; an fp32 case keeps fp32 parameters and no such failure. The
    float outputs stay in the protocol's fp32."""
    script = _BF16_STEP.format(tests=str(ROOT / "tests"))
    done = subprocess.run([sys.executable, "-c", script], env=_env(modelopt_site),
                          capture_output=True, text=True, timeout=limit_s(300), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bf16"]["trainable"] == out["bf16"]["frozen"] == ["bfloat16"]
    assert out["bf16"]["master"] is None and out["bf16"]["protocol"] == []
    assert out["bf16"]["status"] == "fail"
    assert "'fc.weight' is trained in bfloat16 with no float32 master copy reported (the " \
        "reference trains float32 weights)" in out["bf16"]["summary"]
    assert out["fp32"]["trainable"] == ["float32"] and out["fp32"]["protocol"] == []
    assert "master copy" not in out["fp32"]["summary"]
