"""Replace assistant turns with the verifier's own greedy replies (batched, cached on disk).

Drafters learn to predict the verifier, so they train far better on what the verifier itself
says than on human replies (DESIGN.md section 4). For each conversation, assistant turn j is
regenerated from the conversation so far (user turns as given, earlier assistant turns
already regenerated) with greedy decoding, at most ``max_new_tokens`` tokens. A reply that
hits the limit before its end-of-turn token ends the conversation (later turns would answer
text the verifier never finished). Turns whose context alone reaches ``max_context`` tokens
are dropped with everything after them. With ``max_turns``, only the first ``max_turns``
assistant turns are regenerated and the conversation ends after the last one (user turns
after it would ask about replies that were not regenerated).

Cost on CPU: every turn re-reads the whole conversation so far, and decoding is bound by
reading the weights once per step, so batches are large and a conversation with many turns
costs many times one with a single turn. Measured on SmolLM2-135M, 2 cores, 64 new tokens,
chitchat: 3.4 s per conversation with all turns, 0.8 s with ``max_turns=1``.

Generation is batched across conversations (one round per assistant-turn index, left
padding). Results are cached as JSON under ``<cache>/regenerated/``, keyed by the verifier
(config hash and weights hash), the conversation hash, ``max_new_tokens``, ``max_context``
and ``max_turns``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_audit.data.builtin_verifier import cache_dir
from dflash_audit.data.conversations import Conversation
from dflash_audit.data.tokenize import end_of_turn_ids, render_ids
from dflash_audit.data.verifier import Verifier, flush_denormal
from dflash_audit.user_input import loads_json

DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_GENERATION_BATCH = 32  # CPU decoding is weight-bandwidth bound: 32 rows, 1.6x 8 rows


def regeneration_key(verifier: Verifier, conversation: Conversation, max_new_tokens: int,
                     max_context: int, max_turns: int | None = None) -> str:
    """sha256 hex identifying one regenerated conversation."""
    payload = {"verifier_config": verifier.identity.config_hash,
               "verifier_weights": verifier.weights_hash,
               "conversation": conversation.hash, "max_new_tokens": int(max_new_tokens),
               "max_context": int(max_context), "decoding": "greedy"}
    if max_turns is not None:  # absent when unbounded: entries cached before it stay valid
        payload["max_turns"] = int(max_turns)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class _State:
    conversation: Conversation
    messages: list[dict[str, str]]
    turn: int = 0  # next message index to look at
    regenerated: int = 0  # assistant turns replaced so far
    done: bool = False

    def next_assistant(self) -> int | None:
        while self.turn < len(self.messages):
            if self.messages[self.turn]["role"] == "assistant" and self.turn > 0:
                return self.turn
            self.turn += 1
        return None


@torch.inference_mode()
def _generate(verifier: Verifier, prompts: list[list[int]], max_new_tokens: int,
              eot: list[int]) -> list[tuple[list[int], bool]]:
    """Greedy continuations of left-padded ``prompts``: (tokens before end-of-turn, finished)."""
    pad = verifier.tokenizer.pad_token_id
    pad = int(pad if pad is not None else eot[0])
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    with flush_denormal():
        out = verifier.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_new_tokens, do_sample=False,
                                      num_beams=1, eos_token_id=eot, pad_token_id=pad,
                                      temperature=None, top_p=None, top_k=None)
    results = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eot), None)
        results.append((row if cut is None else row[:cut], cut is not None))
    return results


def regenerate_conversations(verifier: Verifier, conversations: Sequence[Conversation],
                             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                             max_context: int = 2048,
                             batch_size: int = DEFAULT_GENERATION_BATCH,
                             max_turns: int | None = None,
                             cache_root: str | Path | None = None,
                             progress: Callable[[int], None] | None = None,
                             ) -> list[Conversation]:
    """Conversations with every assistant turn replaced by the verifier's greedy reply.

    Args:
        verifier: the loaded verifier (fp32, eval).
        conversations: originals; the result keeps their order and ``source``
            (with ``+regen`` appended).
        max_new_tokens: generation bound per reply, in tokens.
        max_context: a turn whose rendered context reaches this many tokens is dropped with
            everything after it (use the packed ``seq_len``).
        batch_size: prompts per ``generate`` call.
        max_turns: regenerate only the first ``max_turns`` assistant turns and end each
            conversation after the last one (``None``: all turns).
        cache_root: cache folder (default ``<cache_dir()>/regenerated``).
        progress: called with the number of conversations finished (cached ones included).

    Returns:
        New :class:`Conversation` objects, same length and order as the input.
    """
    root = Path(cache_root) if cache_root is not None else cache_dir() / "regenerated"
    tokenizer = verifier.tokenizer
    eot = sorted(end_of_turn_ids(tokenizer, getattr(verifier.model, "generation_config", None)))
    results: list[Conversation | None] = [None] * len(conversations)
    keys = [regeneration_key(verifier, c, max_new_tokens, max_context, max_turns)
            for c in conversations]
    states: dict[int, _State] = {}
    for i, (conv, key) in enumerate(zip(conversations, keys)):
        cached = _read_cache(root, key)
        if cached is not None:
            results[i] = Conversation(messages=tuple(cached), source=conv.source + "+regen")
            if progress:
                progress(1)
        else:
            states[i] = _State(conv, [dict(m) for m in conv.messages])
    while True:
        pending: list[tuple[int, list[int]]] = []
        for i, st in states.items():
            if st.done:
                continue
            j = st.next_assistant()
            if j is None:
                st.done = True
                continue
            prompt = render_ids(tokenizer, st.messages[:j], add_generation_prompt=True)
            if len(prompt) >= max_context:
                del st.messages[j:]
                st.done = True
                continue
            pending.append((i, prompt))
        if not pending:
            break
        pending.sort(key=lambda item: len(item[1]))  # similar lengths share a batch
        for b in range(0, len(pending), batch_size):
            chunk = pending[b:b + batch_size]
            outs = _generate(verifier, [p for _, p in chunk], max_new_tokens, eot)
            for (i, _), (tokens, finished) in zip(chunk, outs):
                st = states[i]
                j = st.turn
                st.messages[j] = {"role": "assistant",
                                  "content": tokenizer.decode(tokens, skip_special_tokens=True)}
                st.turn += 1
                st.regenerated += 1
                if not finished or st.regenerated == max_turns:
                    del st.messages[j + 1:]
                    st.done = True
    for i, st in states.items():
        _write_cache(root, keys[i], st.messages)
        results[i] = Conversation(messages=tuple(st.messages),
                                  source=st.conversation.source + "+regen")
        if progress:
            progress(1)
    return [r for r in results if r is not None]


def _cache_path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.json"


def _read_cache(root: Path, key: str) -> list[dict[str, str]] | None:
    path = _cache_path(root, key)
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
        return [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged entry: regenerate


def _write_cache(root: Path, key: str, messages: list[dict[str, str]]) -> None:
    path = _cache_path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"messages": messages}, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
