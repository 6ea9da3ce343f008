"""Conversation sources: JSONL (messages / ShareGPT), chitchat mapping, error paths."""

from __future__ import annotations

import json

import pytest
from data_support import SAMPLE_CONVERSATIONS, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_audit.data.conversations import (
    chitchat_to_messages,
    conversation_hash,
    load_chitchat,
    load_conversations,
    load_jsonl,
)
from dflash_audit.data.errors import ConversationError


def test_jsonl_messages_and_sharegpt(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", SAMPLE_CONVERSATIONS)
    result = load_conversations(str(path))
    assert len(result) == 4 and result.skipped_no_assistant == 1
    first, sharegpt = result.conversations[0], result.conversations[1]
    assert first.messages == tuple(SAMPLE_CONVERSATIONS[0]["messages"])
    assert sharegpt.messages == ({"role": "user", "content": "What is 2+2?"},
                                 {"role": "assistant", "content": "2+2 is 4."})
    assert first.source == f"{path}:1" and sharegpt.source == f"{path}:2"
    assert result.conversations[2].messages[0] == {"role": "system", "content": "Be brief."}


def test_json_list_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(SAMPLE_CONVERSATIONS))
    result = load_jsonl(path)
    assert len(result) == 4 and result.skipped_no_assistant == 1


def test_blank_lines_are_ignored_and_line_numbers_kept(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [SAMPLE_CONVERSATIONS[1], "", SAMPLE_CONVERSATIONS[2]])
    result = load_jsonl(path)
    assert [c.source for c in result.conversations] == [f"{path}:1", f"{path}:3"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"messages": [', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "hello"}', "neither 'messages' nor 'conversations'"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
    ('{"messages": "hello"}', "must be a JSON array"),
])
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [SAMPLE_CONVERSATIONS[0], SAMPLE_CONVERSATIONS[1],
                                                bad_line, SAMPLE_CONVERSATIONS[2]])
    with pytest.raises(ConversationError, match=message) as info:
        load_conversations(str(path))
    assert f"{path}:3:" in str(info.value)


def test_missing_assistant_turns_are_counted(tmp_path):
    only_users = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    path = write_jsonl(tmp_path / "c.jsonl", only_users + [SAMPLE_CONVERSATIONS[1]])
    result = load_conversations(str(path))
    assert len(result) == 1 and result.skipped_no_assistant == 3


def test_unknown_data_spec():
    with pytest.raises(ConversationError, match="neither 'chitchat' nor"):
        load_conversations("/no/such/file.jsonl")


def test_chitchat_mapping_on_a_dialogue():
    dialogue = {"messages": [
        [{"text": "Hello", "sender": "a"}, {"text": "How are you?", "sender": "a"}],
        [{"text": "good", "sender": "b"}],
        [{"text": "", "sender": "a"}],
        [{"text": "nice", "sender": "a"}],
        [{"text": "bye", "sender": "b"}],
    ]}
    assert chitchat_to_messages(dialogue) == [
        {"role": "user", "content": "Hello\nHow are you?"},
        {"role": "assistant", "content": "good"},
        {"role": "user", "content": "nice"},
        {"role": "assistant", "content": "bye"},
    ]


def test_real_chitchat():
    result = load_chitchat()
    # 7,168 dialogues; those with a single sender have no assistant turn
    assert len(result) + result.skipped_no_assistant == 7168
    assert len(result) > 3500 and result.skipped_no_assistant > 0
    for conv in result.conversations[:200]:
        roles = [m["role"] for m in conv.messages]
        assert roles[0] == "user" and "assistant" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))  # strictly alternating
        assert all(m["content"] for m in conv.messages)
    first = result.conversations[0]
    assert first.source.startswith("chitchat:")
    assert first.messages[0]["content"] == "Hello\nHow are you doing today?"


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                              "content": text})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(turn, max_size=6), max_size=6))
def test_jsonl_roundtrip_property(tmp_path_factory, conversations):
    path = write_jsonl(tmp_path_factory.mktemp("h") / "c.jsonl",
                       [{"messages": c} for c in conversations])
    result = load_jsonl(path)
    with_assistant = [c for c in conversations if any(t["role"] == "assistant" for t in c)]
    assert len(result) == len(with_assistant)
    assert result.skipped_no_assistant == len(conversations) - len(with_assistant)
    for conv, original in zip(result.conversations, with_assistant):
        # consecutive same-role turns are merged with a newline, contents preserved in order
        assert "\n".join(m["content"] for m in conv.messages) == "\n".join(
            t["content"] for t in original)
        assert all(a["role"] != b["role"] for a, b in zip(conv.messages, conv.messages[1:]))
        assert conv.hash == conversation_hash(conv.messages)
