"""``--weights DIR`` (a user's drafter checkpoint in the real cases) and ``--profile
config.json`` together: the checkpoint's own config is the profile, its weights replace the
seeded ones, a checkpoint that does not fit is a named exit-2 error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_zygote import run_cli
from safetensors.torch import load_file, save_file

from dflash_audit.audit.cases.user_weights import (
    UserWeightsError,
    apply_user_weights,
    load_user_weights,
)
from dflash_audit.data.verifier import resolve_verifier_path
from dflash_audit.model.checkpoint import save_pretrained
from dflash_audit.model.drafter import DFlashDrafter
from dflash_audit.profile import Profile


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A drafter checkpoint (speculators format) for the built-in SmolLM2 verifier."""
    from transformers import AutoConfig

    _, folder = resolve_verifier_path("smollm2-135m", progress=None)
    profile = Profile.load("reference-model")
    config = profile.to_drafter_config(AutoConfig.from_pretrained(folder), 16)
    torch.manual_seed(11)
    out = tmp_path_factory.mktemp("ckpt") / "my-drafter"
    save_pretrained(DFlashDrafter(config), out, verifier_name_or_path=str(folder))
    return out


def _compare(*args, timeout=900):
    return run_cli(["compare", *args], Path.cwd(), {"OMP_NUM_THREADS": "1"}, timeout=timeout)


def test_keys_map_from_a_prefixed_layout_and_mismatches_are_named(checkpoint, tmp_path):
    state = load_file(checkpoint / "model.safetensors")
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    save_file({f"model.{k}": v for k, v in state.items()}, zlab / "model.safetensors")
    assert load_user_weights(zlab).keys() == state.keys()
    weights = {**{k: torch.zeros_like(v) for k, v in state.items()},
               "embed_tokens.weight": torch.zeros(4, 2)}  # verifier-owned: never required
    bad = {k: v for k, v in state.items() if k != "norm.weight"}
    bad["fc.weight"] = bad["fc.weight"][:, :10]
    bad["layers.1.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(UserWeightsError) as err:
        apply_user_weights(weights, bad, "ckpt")
    msg = str(err.value)
    assert "keys the reference's drafter does not have: layers.1.mlp.up_proj.weight" in msg
    assert "trained weights missing: norm.weight" in msg
    assert "shapes differ: fc.weight [576, 10] (reference [576, 1728])" in msg
    with pytest.raises(UserWeightsError, match="does not exist"):
        load_user_weights(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserWeightsError, match="no \\*.safetensors file"):
        load_user_weights(tmp_path / "empty")


def test_compare_with_the_checkpoint_config_and_weights(checkpoint, tmp_path):
    proc = _compare("--profile", str(checkpoint / "config.json"), "--weights", str(checkpoint),
                    "--cases", "0", "--anchors", "4", "--seq-len", "64",
                    "--out", str(tmp_path / "reports"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (f"\nnext: dflash-audit train --profile {checkpoint / 'config.json'} --reports-dir "
            f"{tmp_path / 'reports'} --data chitchat --out runs/drafter\n  (train's defaults: "
            "300 steps") in proc.stdout
    report = json.loads(next((tmp_path / "reports").glob("*/report.json")).read_text())
    assert report["inputs"]["weights"] == str(checkpoint.resolve())
    assert report["profile"]["fields"]["loss"] == "ce"  # the train-cli recipe
    # a checkpoint that does not fit the profile's drafter: exit 2, keys named
    proc = _compare("--weights", str(checkpoint), "--cases", "0", "--out", str(tmp_path / "r2"),
                    "--profile", "reference-train-cli")
    assert proc.returncode == 2, proc.stdout
    assert "trained weights missing: layers.1." in proc.stdout
    assert "Traceback" not in proc.stdout


def test_a_checkpoint_that_would_audit_something_else_is_named(checkpoint, tmp_path):
    """Each of these ran the audit before (a NaN weight: FAIL with "unexplained difference";
    int8 weights: a protocol FAIL) or named the wrong cause; now a UserWeightsError."""
    state = load_file(checkpoint / "model.safetensors")
    keys = sorted(state)

    def folder(name, files):
        out = tmp_path / name
        out.mkdir()
        for file, tensors in files.items():
            save_file(tensors, out / file)
        return out

    pickle = tmp_path / "pickle"
    pickle.mkdir()
    torch.save(state, pickle / "pytorch_model.bin")
    with pytest.raises(UserWeightsError, match="pytorch_model.bin is a pickle file, which is "
                                               "never loaded"):
        load_user_weights(pickle)
    sharded = folder("sharded", {"model-00001-of-00002.safetensors":
                                 {k: state[k] for k in keys[:5]}})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(keys)}}))
    with pytest.raises(UserWeightsError, match="names shards that are not there: "
                                               "model-00002-of-00002.safetensors"):
        load_user_weights(sharded)
    nan = {**state, "norm.weight": state["norm.weight"].clone()}
    nan["norm.weight"][3] = float("nan")
    with pytest.raises(UserWeightsError, match="norm.weight in model.safetensors holds 1 "
                                               "non-finite values"):
        load_user_weights(folder("nan", {"model.safetensors": nan}))
    ints = load_user_weights(folder("ints", {"model.safetensors": {
        **state, "fc.weight": state["fc.weight"].to(torch.int8)}}))
    with pytest.raises(UserWeightsError, match="integer where floating point is expected, or "
                                               "the reverse: fc.weight torch.int8"):
        apply_user_weights({k: torch.zeros_like(v) for k, v in state.items()}, ints, "ckpt")
    bf16 = load_user_weights(folder("bf16", {"model.safetensors": {
        k: v.bfloat16() for k, v in state.items()}}))  # exact upcast: accepted
    assert bf16["fc.weight"].dtype == torch.float32
