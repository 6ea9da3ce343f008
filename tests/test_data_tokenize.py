"""Chat-template tokenization: the assistant loss_mask (incl. end-of-turn), truncation,
dropped rows, template errors, and the mask_token_id choice."""

from __future__ import annotations

import functools

import pytest
from data_support import SAMPLE_CONVERSATIONS, byte_tokenizer, smollm2
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_audit.data.conversations import load_chitchat
from dflash_audit.data.errors import MaskTokenError, TokenizationError
from dflash_audit.data.tokenize import (
    _spans_by_text,
    _spans_by_tokens,
    choose_mask_token_id,
    end_of_turn_ids,
    tokenize_conversation,
)


@functools.cache
def tok():
    """The byte tokenizer, built once on first use (not at collection: it imports
    transformers)."""
    return byte_tokenizer()


MESSAGES = SAMPLE_CONVERSATIONS[0]["messages"]


def mask_runs(ids: list[int], mask: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of loss_mask == 1 as [start, end)."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def expected_replies(messages, eot="<|im_end|>") -> list[str]:
    return [m["content"] + eot for j, m in enumerate(messages) if m["role"] == "assistant" and j]


def test_loss_mask_is_exactly_the_assistant_replies():
    doc = tokenize_conversation(tok(), MESSAGES, 1024, source="s")
    text = tok().decode(doc.input_ids)
    assert text == tok().apply_chat_template(MESSAGES, tokenize=False)
    runs = mask_runs(doc.input_ids, doc.loss_mask)
    assert runs == doc.spans
    assert [tok().decode(doc.input_ids[a:b]) for a, b in runs] == expected_replies(MESSAGES)
    # the end-of-turn token is supervised, the template's "\n" after it and the
    # "<|im_start|>assistant\n" header are not
    for a, b in runs:
        assert doc.input_ids[b - 1] == tok().convert_tokens_to_ids("<|im_end|>")
        assert doc.loss_mask[b] == 0 and tok().decode(doc.input_ids[b:b + 1]) == "\n"
        assert tok().decode(doc.input_ids[a - 22:a]).endswith("<|im_start|>assistant\n")
    assert not doc.truncated and doc.num_supervised == sum(b - a for a, b in runs)


def test_truncation_keeps_the_first_seq_len_tokens():
    full = tokenize_conversation(tok(), MESSAGES, 1024)
    cut = full.spans[1][0] + 5  # inside the second reply
    doc = tokenize_conversation(tok(), MESSAGES, cut)
    assert doc.truncated and len(doc) == cut
    assert doc.input_ids == full.input_ids[:cut] and doc.loss_mask == full.loss_mask[:cut]
    assert doc.spans == [full.spans[0], (full.spans[1][0], cut)]
    # the second reply starts at T: the row ends after the first reply, still "truncated"
    short = tokenize_conversation(tok(), MESSAGES, full.spans[1][0])
    assert short.spans == [full.spans[0]] and short.truncated
    assert short.input_ids == full.input_ids[:len(short)] and len(short) < full.spans[1][0]


def test_rows_without_supervised_tokens_are_dropped():
    doc = tokenize_conversation(tok(), MESSAGES, 1024)
    assert tokenize_conversation(tok(), MESSAGES, doc.spans[0][0]) is None  # reply starts at T
    leading = [{"role": "assistant", "content": "I speak first"},
               {"role": "user", "content": "ok"}]
    assert tokenize_conversation(tok(), leading, 1024) is None  # no context before it


def test_template_errors():
    no_template = byte_tokenizer()
    no_template.chat_template = None
    with pytest.raises(TokenizationError, match="no chat template"):
        tokenize_conversation(no_template, MESSAGES, 256)
    unstable = byte_tokenizer()  # a header counting the turns changes every earlier render
    unstable.chat_template = "{{ messages|length }}" + unstable.chat_template
    with pytest.raises(TokenizationError, match="not prefix-stable"):
        tokenize_conversation(unstable, MESSAGES, 256, source="conv-7")


safe_text = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="<|>"),
                    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant"]), safe_text), min_size=1,
                max_size=8), st.integers(8, 400))
def test_loss_mask_property(turns, seq_len):
    messages = [{"role": r, "content": c} for r, c in turns]
    eot = end_of_turn_ids(tok())
    fast = _spans_by_text(tok(), messages, seq_len, eot)
    assert fast == _spans_by_tokens(tok(), messages, seq_len, eot, "")  # both ways agree
    doc = tokenize_conversation(tok(), messages, seq_len)
    full = tokenize_conversation(tok(), messages, 10_000)
    if full is None:
        assert doc is None
        return
    runs = mask_runs(full.input_ids, full.loss_mask)
    assert [tok().decode(full.input_ids[a:b]) for a, b in runs] == expected_replies(messages)
    if doc is not None:
        assert len(doc) <= seq_len
        assert doc.input_ids == full.input_ids[:len(doc)]
        assert doc.loss_mask == full.loss_mask[:len(doc)]


def test_smollm2_chitchat_mask():
    smol = smollm2()
    tok = smol.tokenizer
    conv = load_chitchat().conversations[3]
    doc = tokenize_conversation(tok, conv.messages, 4096)
    runs = mask_runs(doc.input_ids, doc.loss_mask)
    assert [tok.decode(doc.input_ids[a:b]) for a, b in runs] == expected_replies(conv.messages)
    assert all(doc.input_ids[b - 1] == 2 for a, b in runs)  # <|im_end|> = eos = 2
    assert tok.decode(doc.input_ids[:3]) == "<|im_start|>system\n"


# ------------------------------------------------------------------------- mask token id
def test_mask_token_prefers_the_tokenizers_mask_token():
    tok = byte_tokenizer(mask_token="<reserved_0>")
    choice = choose_mask_token_id(tok, 300)
    assert choice.id == 3 and "tokenizer mask token" in choice.reason


def test_mask_token_spare_embedding_row():
    choice = choose_mask_token_id(tok(), 300)
    assert choice.id == len(tok()) == 260 and "spare embedding row" in choice.reason


def test_mask_token_reserved_special_when_no_spare_row():
    choice = choose_mask_token_id(tok(), len(tok()))
    assert choice.id == 3 and "<reserved_0>" in choice.reason


def test_smollm2_mask_token_is_never_pad_or_eos():
    smol = smollm2()
    tok = smol.tokenizer
    assert tok.mask_token is None and tok.eos_token_id == tok.pad_token_id == 2
    choice = choose_mask_token_id(tok, smol.embedding_rows)
    assert choice.id not in (0, 1, 2) and choice.id not in end_of_turn_ids(tok)
    assert choice.id == 16 and "<empty_output>" in choice.reason
    assert "<empty_output>" not in tok.chat_template


def test_explicit_mask_token():
    assert choose_mask_token_id(tok(), 300, explicit=299).id == 299
    assert "explicit" in choose_mask_token_id(tok(), 300, explicit=299).reason
    with_mask = byte_tokenizer(mask_token="<reserved_0>")
    assert "overrides" in choose_mask_token_id(with_mask, 300, explicit=299).reason
    with pytest.raises(MaskTokenError, match="pad"):
        choose_mask_token_id(tok(), 300, explicit=2)  # eos = pad
    with pytest.raises(MaskTokenError, match="out of range"):
        choose_mask_token_id(tok(), 300, explicit=300)


def test_no_mask_token_option_asks_for_the_flag():
    tok = byte_tokenizer()
    tok.chat_template = tok.chat_template + "<reserved_0>"  # the only reserved token is used
    with pytest.raises(MaskTokenError, match="--mask-token-id"):
        choose_mask_token_id(tok, len(tok))
