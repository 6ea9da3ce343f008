"""Batch files: safetensors round trip, validation of shapes/dtypes/metadata/layout, corrupt
files, and the reference's offline format (hs_{i}.safetensors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_audit.data.batch import Batch
from dflash_audit.data.errors import BatchFileError
from dflash_audit.data.pipeline import load_batches, write_batches
from dflash_audit.data.reference_format import split_documents, write_reference_offline

H, IDS = 4, [1, 3]


def make_batch(seed: int = 0) -> Batch:
    """T=12: document 0 = 5 tokens, document 1 = 4 tokens, 3 padding positions."""
    g = torch.Generator().manual_seed(seed)
    T, n_valid = 12, 9
    docs = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3])
    hidden = torch.randn(1, T, len(IDS) * H, generator=g)
    last = torch.randn(1, T, H, generator=g)
    hidden[:, n_valid:] = 0
    last[:, n_valid:] = 0
    ids = torch.randint(3, 50, (1, T), generator=g)
    ids[:, n_valid:] = 0
    return Batch(
        hidden_states=hidden, verifier_last_hidden_states=last, input_ids=ids,
        loss_mask=torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0]]),
        position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]]),
        document_ids=docs,
        metadata={"verifier": {"name": "tiny", "path": "/x", "config_hash": "ab" * 32},
                  "target_layer_ids": IDS, "layer_id_convention": "speculators",
                  "tokenizer": {"name": "tiny"}, "seq_len": T, "hidden_size": H,
                  "num_verifier_layers": 6, "mask_token_id": 260,
                  "mask_token_reason": "spare embedding row", "num_documents": 2})


def test_round_trip(tmp_path):
    batch = make_batch()
    path = batch.save(tmp_path / "b.safetensors")
    loaded = Batch.load(path)
    for key, tensor in batch.tensors().items():
        got = getattr(loaded, key)
        assert torch.equal(got, tensor) and got.dtype == tensor.dtype
    assert loaded.metadata == batch.metadata
    assert loaded.target_layer_ids == IDS and loaded.mask_token_id == 260
    assert loaded.seq_len == 12 and loaded.hidden_size == H and loaded.num_documents == 2


def _rewrite(path, tensors=None, metadata=None):
    """Write a file bypassing Batch.save (so its validation does not stop the bad content)."""
    base = make_batch()
    t = {k: v.contiguous() for k, v in (tensors or base.tensors()).items()}
    md = {"format": json.dumps("dflash-audit-batch"), "format_version": "1"}
    md.update({k: json.dumps(v) for k, v in (metadata or base.metadata).items()})
    save_file(t, str(path), metadata=md)
    return path


def _mutated(key, fn):
    t = make_batch().tensors()
    t[key] = fn(t[key].clone())
    return t


def _set(t, index, value):
    t[index] = value
    return t


@pytest.mark.parametrize("tensors, metadata, message", [
    (_mutated("hidden_states", lambda t: t[..., :H]), None, r"expected \(1, 12, 8\)"),
    (_mutated("hidden_states", lambda t: t.double()), None, "dtype torch.float64"),
    (_mutated("loss_mask", lambda t: t.int()), None, "loss_mask has dtype torch.int32"),
    (_mutated("loss_mask", lambda t: _set(t, (0, 2), 2)), None, "0/1"),
    (_mutated("loss_mask", lambda t: _set(t, (0, 10), 1)), None, "0 on padding"),
    (_mutated("position_ids", lambda t: _set(t, (0, 5), 5)), None, "restart at 0"),
    (_mutated("document_ids", lambda t: _set(t, (0, 3), -1)), None, "only appear at the end"),
    (_mutated("input_ids", lambda t: t[:, :10]), None, r"expected \(1, 12\)"),
    (_mutated("verifier_last_hidden_states", lambda t: _set(t, (0, 0, 0), float("nan"))), None,
     "non-finite"),
    (None, {**make_batch().metadata, "target_layer_ids": [1, 3, 5]}, "len\\(target_layer_ids\\)=3"),
    (None, {**make_batch().metadata, "num_documents": 3}, "num_documents"),
    (None, {**make_batch().metadata, "target_layer_ids": [3, 1]}, "ascending"),
    (None, {k: v for k, v in make_batch().metadata.items() if k != "mask_token_id"},
     "missing \\['mask_token_id'\\]"),
])
def test_inconsistent_files_are_rejected(tmp_path, tensors, metadata, message):
    path = _rewrite(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(BatchFileError, match=message) as info:
        Batch.load(path)
    assert str(path) in str(info.value)


def test_missing_tensor(tmp_path):
    t = make_batch().tensors()
    del t["document_ids"]
    path = _rewrite(tmp_path / "b.safetensors", t)
    with pytest.raises(BatchFileError, match=r"tensors \['document_ids'\] are missing"):
        Batch.load(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "header"])
def test_corrupt_files_give_a_clear_error(tmp_path, damage):
    path = make_batch().save(tmp_path / "b.safetensors")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01not a safetensors file" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(data[:8] + b"X" + data[9:])  # header JSON broken
    with pytest.raises(BatchFileError, match="truncated or corrupt") as info:
        Batch.load(path)
    assert str(path) in str(info.value)


def test_foreign_safetensors_and_missing_files(tmp_path):
    other = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in make_batch().tensors().items()}, str(other))
    with pytest.raises(BatchFileError, match="not a dflash-audit-batch file"):
        Batch.load(other)
    with pytest.raises(BatchFileError, match="batch file does not exist"):
        Batch.load(tmp_path / "nope.safetensors")
    with pytest.raises(BatchFileError, match="no batch_"):
        load_batches(tmp_path)


def test_save_refuses_an_invalid_batch(tmp_path):
    batch = make_batch()
    batch.metadata["hidden_size"] = 5
    with pytest.raises(BatchFileError):
        batch.save(tmp_path / "b.safetensors")
    assert not (tmp_path / "b.safetensors").exists()


def test_write_and_load_batches(tmp_path):
    batches = [make_batch(0), make_batch(1)]
    (tmp_path / "batch_00007.safetensors").write_bytes(b"stale")
    paths = write_batches(batches, tmp_path)
    assert [p.name for p in paths] == ["batch_00000.safetensors", "batch_00001.safetensors"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["files"] == [p.name for p in paths] and manifest["target_layer_ids"] == IDS
    loaded = load_batches(tmp_path)  # the stale file was removed
    assert len(loaded) == 2 and torch.equal(loaded[1].hidden_states, batches[1].hidden_states)


def test_reference_offline_format(tmp_path):
    import datasets

    batches = [make_batch(0), make_batch(1)]
    out = write_reference_offline(batches, tmp_path / "ref")
    data = datasets.load_from_disk(str(out))
    assert len(data) == 4 and data.format["type"] == "torch"
    assert list(data.with_format(None)["seq_len"]) == [5, 4, 5, 4]
    k = 0
    for batch in batches:
        for (s, e) in ((0, 5), (5, 9)):
            hs = load_file(str(out / "hidden_states" / f"hs_{k}.safetensors"))
            assert set(hs) == {"hidden_states", "token_ids"}
            assert hs["hidden_states"].shape == (e - s, len(IDS) + 1, H)
            assert torch.equal(hs["token_ids"], batch.input_ids[0, s:e])
            assert torch.equal(data[k]["input_ids"], hs["token_ids"])
            assert torch.equal(data[k]["loss_mask"], batch.loss_mask[0, s:e])
            # what the reference's reader does with the file (train/data.py)
            assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), batch.hidden_states[0, s:e])
            assert torch.equal(hs["hidden_states"][:, -1],
                               batch.verifier_last_hidden_states[0, s:e])
            k += 1
    info = json.loads((out / "dflash_audit_reference_format.json").read_text())
    assert info["target_layer_ids"] == IDS and info["num_samples"] == 4
    assert len(split_documents(batches[0])) == 2


def test_publish_batches_creates_replaces_and_cleans_up(tmp_path, monkeypatch):
    """``dflash-audit data`` writes into a hidden sibling and publishes at the end: a new folder
    appears whole, an existing one keeps its other files, a write that fails (a full disk, a
    SIGTERM) leaves the folder as it was and no partial sibling, and a sibling left by a
    killed run is removed by the next one."""
    from dflash_audit.data import pipeline

    out = tmp_path / "out"
    paths = pipeline.publish_batches([make_batch(0), make_batch(1)], out)
    assert [p.name for p in paths] == ["batch_00000.safetensors", "batch_00001.safetensors"]
    assert torch.equal(load_batches(out)[1].input_ids, make_batch(1).input_ids)
    (out / "notes.txt").write_text("mine")
    stale = tmp_path / ".out.partial-999999999"  # a kill -9 of an earlier run
    stale.mkdir()
    pipeline.publish_batches([make_batch(2)], out)
    assert sorted(p.name for p in out.iterdir()) == ["batch_00000.safetensors",
                                                      "manifest.json", "notes.txt"]
    assert not stale.exists()

    def full_disk(batches, folder, reference_format=False):
        folder.mkdir(parents=True)
        (folder / "batch_00000.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "write_batches", full_disk)
    with pytest.raises(OSError):
        pipeline.publish_batches([make_batch(3)], out)
    assert torch.equal(load_batches(out)[0].input_ids, make_batch(2).input_ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(OSError):
        pipeline.publish_batches([make_batch(3)], tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_sigterm_interrupts_like_ctrl_c():
    """Inside ``data``'s work a SIGTERM raises KeyboardInterrupt, so the same cleanup runs."""
    import os
    import signal

    from dflash_audit.data.command import _terminated_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), _terminated_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
    assert signal.getsignal(signal.SIGTERM) == before
