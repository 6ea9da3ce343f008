"""Conversation sources as lists of ``{"role", "content"}`` turns.

Sources:

- ``chitchat``: the PyPI package ``chitchat-dataset`` (7,168 two-person dialogues in its
  ``dataset.json``: ``{id: {"messages": [[{"text", "sender", ...}, ...], ...], ...}}``,
  each inner list a run of utterances by one sender). The first sender becomes ``user``,
  the other ``assistant``; a run's utterances are joined with newlines. Dialogues with a
  single sender have no assistant turn.
- a ``.jsonl`` file, one conversation per line, either ``{"messages": [{"role",
  "content"}, ...]}`` or ShareGPT ``{"conversations": [{"from", "value"}, ...]}``
  (``human``/``gpt``/...). A ``.json`` file holding a list of such records works too.

Conversations without an assistant turn are skipped and counted, never silently dropped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.data.errors import ConversationError
from dflash_audit.user_input import loads_json

CHITCHAT = "chitchat"
CHITCHAT_INSTALL = "pip install chitchat-dataset==0.9.0"

ROLE_ALIASES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant", "bot": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}


@dataclass(frozen=True)
class Conversation:
    """One conversation: ``messages`` = ``[{"role": "user"|"assistant"|"system"|"tool",
    "content": str}, ...]``; ``source`` says where it came from (``file:line`` or
    ``chitchat:<id>``)."""

    messages: tuple[dict[str, str], ...]
    source: str

    @property
    def hash(self) -> str:
        """sha256 hex of the canonical JSON of ``messages`` (independent of ``source``)."""
        return conversation_hash(self.messages)

    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


@dataclass
class ConversationSet:
    """Conversations of one source, plus how many were skipped for lacking an assistant turn."""

    source: str
    conversations: list[Conversation] = field(default_factory=list)
    skipped_no_assistant: int = 0

    def __len__(self) -> int:
        return len(self.conversations)


def conversation_hash(messages: Any) -> str:
    """sha256 hex of the canonical JSON of a message list."""
    canonical = json.dumps([dict(m) for m in messages], sort_keys=True, ensure_ascii=False,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _merge_same_role(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Join consecutive turns of the same role (newline separated)."""
    out: list[dict[str, str]] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(dict(m))
    return out


def _add(result: ConversationSet, messages: list[dict[str, str]], source: str) -> None:
    conv = Conversation(messages=tuple(_merge_same_role(messages)), source=source)
    if conv.has_assistant():
        result.conversations.append(conv)
    else:
        result.skipped_no_assistant += 1


# ----------------------------------------------------------------------------- chitchat
def chitchat_path() -> Path:
    """Path of ``dataset.json`` in the installed ``chitchat-dataset`` package.

    Raises:
        ConversationError: package missing (the message gives the install command).
    """
    spec = importlib.util.find_spec("chitchat_dataset")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "dataset.json"
        if candidate.is_file():
            return candidate
    raise ConversationError(f"data 'chitchat' needs the chitchat-dataset package. "
                            f"Fix: {CHITCHAT_INSTALL}")


def chitchat_to_messages(dialogue: dict[str, Any]) -> list[dict[str, str]]:
    """Map one chitchat dialogue to alternating user/assistant turns.

    ``dialogue["messages"]`` is a list of runs, each a list of ``{"text", "sender"}`` by one
    sender. The first sender is the user, any other sender the assistant.
    """
    first_sender = None
    messages: list[dict[str, str]] = []
    for run in dialogue.get("messages", []):
        texts = [str(u.get("text", "")).strip() for u in run]
        texts = [t for t in texts if t]
        if not texts:
            continue
        sender = run[0].get("sender")
        if first_sender is None:
            first_sender = sender
        role = "user" if sender == first_sender else "assistant"
        messages.append({"role": role, "content": "\n".join(texts)})
    return messages


def load_chitchat(path: str | Path | None = None) -> ConversationSet:
    """All chitchat dialogues (file order) as user/assistant conversations.

    Raises:
        ConversationError: package missing or the file unreadable.
    """
    path = Path(path) if path is not None else chitchat_path()
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConversationError(f"cannot read chitchat data {path}: {exc}") from exc
    result = ConversationSet(source=CHITCHAT)
    for key, dialogue in data.items():
        _add(result, chitchat_to_messages(dialogue), f"{CHITCHAT}:{key}")
    return result


# -------------------------------------------------------------------------------- JSONL
def parse_record(record: Any, where: str) -> list[dict[str, str]]:
    """Turns of one chat record (``messages`` or ShareGPT ``conversations``).

    Raises:
        ConversationError: naming ``where`` (``file:line``) and the problem.
    """
    if not isinstance(record, dict):
        raise ConversationError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise ConversationError(
            f"{where}: record has neither 'messages' nor 'conversations' "
            f"(keys: {sorted(record)[:8]})")
    if not isinstance(turns, list):
        raise ConversationError(f"{where}: the turn list must be a JSON array")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ConversationError(f"{where}: turn {i} is not an object")
        # ShareGPT files sometimes use role/content inside 'conversations' and vice versa
        role = turn.get(role_key, turn.get("role", turn.get("from")))
        content = turn.get(content_key, turn.get("content", turn.get("value")))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise ConversationError(
                f"{where}: turn {i} has unknown role {role!r}; known: {sorted(ROLE_ALIASES)}")
        if not isinstance(content, str):
            raise ConversationError(
                f"{where}: turn {i} content must be a string, got {type(content).__name__}")
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    return messages


def load_jsonl(path: str | Path) -> ConversationSet:
    """Conversations of a JSONL file (or a ``.json`` list of records); blank lines ignored.

    Raises:
        ConversationError: unreadable file, or a bad line (message ``path:line: ...``).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConversationError(f"cannot read conversations file {path}: {exc}") from exc
    result = ConversationSet(source=str(path))
    if path.suffix == ".json":
        try:
            records = loads_json(text)
        except json.JSONDecodeError as exc:
            raise ConversationError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
        if not isinstance(records, list):
            raise ConversationError(f"{path}: a .json conversations file must hold a list")
        for i, record in enumerate(records):
            _add(result, parse_record(record, f"{path}[{i}]"), f"{path}[{i}]")
        return result
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = loads_json(line)
        except json.JSONDecodeError as exc:
            raise ConversationError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})"
                                    ) from exc
        _add(result, parse_record(record, where), where)
    return result


def load_conversations(data: str) -> ConversationSet:
    """Resolve a ``--data`` spec: ``chitchat`` or a path to a ``.jsonl`` / ``.json`` file.

    Raises:
        ConversationError: unknown spec, missing file, or a malformed record.
    """
    if data == CHITCHAT:
        return load_chitchat()
    path = Path(data).expanduser()
    if not path.is_file():
        raise ConversationError(
            f"data {data!r} is neither 'chitchat' nor an existing .jsonl/.json file")
    return load_jsonl(path)
