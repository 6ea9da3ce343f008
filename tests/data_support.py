"""Helpers for the data-pipeline tests: a tiny random verifier with a byte-level ChatML
tokenizer, and the real SmolLM2 verifier loaded once per process.

Not a test module; the ``test_data_*`` files import it and wrap these in fixtures.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<reserved_0>"]


def byte_tokenizer(mask_token: str | None = None):
    """A byte-level tokenizer (ids 0-3 specials, then the 256 byte symbols; no merges) with a
    ChatML chat template; eos = pad = ``<|im_end|>`` like SmolLM2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    kwargs = dict(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
                  unk_token="<|endoftext|>", additional_special_tokens=SPECIALS)
    if mask_token:
        kwargs["mask_token"] = mask_token
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(family: str = "llama", layers: int = 6, vocab: int = 300):
    """A random-weight verifier config: H=32, 4 heads / 2 KV heads, ``layers`` layers."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, pad_token_id=2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    return LlamaConfig(**common)


def make_tiny_verifier(folder: Path, family: str = "llama", layers: int = 6, seed: int = 0,
                       vocab: int = 300) -> Path:
    """Save a random tiny causal LM + byte tokenizer into ``folder``; return it.

    Embedding rows (300) exceed the tokenizer length (260), so spare rows exist.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers, vocab))
    with torch.no_grad():  # make the final norm non-trivial so the double-norm test bites
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def shared_tiny_verifier(family: str = "llama", layers: int = 8) -> Path:
    """:func:`make_tiny_verifier` (seed 0) made once into the suite's persistent cache (the
    ``tiny-verifiers`` folder beside ``.records.lock``, one folder per torch and transformers
    version) and shared, read only, by every test and run: the same path and bytes each time,
    so the real cases built on it have the same digests and their reference outputs come from
    the suite's reference cache (a verifier made in a fresh ``tmp_path`` misses it every run).
    A test that changes a verifier makes its own with :func:`make_tiny_verifier`."""
    import shutil

    import transformers
    from filelock import FileLock

    from cache_support import RECORDS_LOCK

    root = RECORDS_LOCK.parent / "tiny-verifiers"
    folder = root / f"{family}-{layers}-torch{torch.__version__}-tf{transformers.__version__}"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "config.json").is_file():
            staging = root / f".staging-{folder.name}"
            shutil.rmtree(staging, ignore_errors=True)
            make_tiny_verifier(staging, family=family, layers=layers)
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
    return folder


def shared_conversations() -> Path:
    """:data:`SAMPLE_CONVERSATIONS` as a JSONL file at a fixed path of the suite's persistent
    cache (a real case's description names its data file, and the case's digest with it: a
    file in a fresh ``tmp_path`` would miss the suite's reference cache every run)."""
    import os

    from cache_support import RECORDS_LOCK

    path = RECORDS_LOCK.parent / "test-data" / "chats.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in SAMPLE_CONVERSATIONS)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".chats-{os.getpid()}.jsonl")
        staging.write_text(text, encoding="utf-8")
        staging.replace(path)
    return path


@functools.lru_cache(maxsize=1)
def smollm2():
    """The real SmolLM2-135M-Instruct verifier (converted into the user cache on first use,
    ~20 s; later loads ~2 s). One instance per test process."""
    from dflash_audit.data.verifier import load_verifier

    return load_verifier("smollm2-135m")


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw strings written verbatim) one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


SAMPLE_CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hi there, how are you?"},
                  {"role": "assistant", "content": "I am fine, thanks! And you?"},
                  {"role": "user", "content": "Great. Tell me a joke."},
                  {"role": "assistant", "content": "Why did the chicken cross the road?"}]},
    {"conversations": [{"from": "human", "value": "What is 2+2?"},
                       {"from": "gpt", "value": "2+2 is 4."}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a color."},
                  {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Only a user turn here."}]},
    {"messages": [{"role": "user", "content": "Count to five."},
                  {"role": "assistant", "content": "1, 2, 3, 4, 5."},
                  {"role": "user", "content": "Thanks."}]},
]
