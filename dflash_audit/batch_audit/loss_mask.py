"""``loss_mask`` against the chat template's assistant spans.

Each document of a row is decoded to text and split back into messages with the verifier's
own chat template (its role headers and turn suffix are learned by rendering sentinel
messages); the messages are tokenized again with :func:`dflash_audit.data.tokenize.
tokenize_conversation`, the same assistant-span logic ``dflash-audit data`` uses (end-of-turn
token included; system prompt, user turns, template separators and padding excluded). A
document whose tokens do not re-render exactly (not a chat-template rendering) is skipped and
said so. Where the files' mask differs, named hypotheses are tried, each a whole-row mask;
the one that explains the files' mask (to within one token per document, for the shifts'
document-boundary effects) names the finding:

- ``shift +1`` / ``shift -1``: the expected mask moved one token later / earlier (a
  labels-vs-inputs alignment slip);
- ``user turns`` / ``user and assistant turns``: the mask put on the user's turns (instead of,
  or besides, the assistant's);
- ``system prompt``: the system prompt supervised as well;
- ``end-of-turn excluded``: the end-of-turn token (``<|im_end|>``...) left out;
- ``inverted`` / ``all tokens``: the complement / every token of the documents.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from dflash_audit.batch_audit.files import Row
from dflash_audit.batch_audit.result import FAIL, PASS, SKIP, Check
from dflash_audit.data.errors import TokenizationError
from dflash_audit.data.tokenize import (
    end_of_turn_ids,
    render_text,
    tokenize_conversation,
)

ROLES = ("system", "user", "assistant")
_SENTINEL = {r: f"q9{r.upper()}SENTINELq9" for r in ROLES}


@dataclass(frozen=True)
class ChatMarkers:
    """Text of each role's header (``<|im_start|>user\\n``) and of the turn suffix
    (``<|im_end|>\\n``) in the verifier's chat template."""

    headers: dict[str, str]
    suffix: str


@functools.lru_cache(maxsize=4)
def _markers(tokenizer: Any) -> ChatMarkers:
    s, u = ({"role": r, "content": _SENTINEL[r]} for r in ("system", "user"))
    only_sys = render_text(tokenizer, [s], False)
    with_user = render_text(tokenizer, [s, u], False)
    prompt = render_text(tokenizer, [s, u], True)
    cut = only_sys.index(_SENTINEL["system"])
    suffix = only_sys[cut + len(_SENTINEL["system"]):]
    user_part = with_user[len(only_sys):]
    headers = {"system": only_sys[:cut], "user": user_part[:user_part.index(_SENTINEL["user"])],
               "assistant": prompt[len(with_user):]}
    if not suffix or not all(headers.values()):
        raise TokenizationError("cannot learn the chat template's role headers")
    return ChatMarkers(headers=headers, suffix=suffix)


def parse_chat(text: str, markers: ChatMarkers) -> list[tuple[str, int, int, int]]:
    """Split a rendered conversation into ``(role, content_start, content_end, turn_end)``
    character spans (``turn_end`` after the suffix; a truncated last turn ends the text)."""
    out, pos = [], 0
    while pos < len(text):
        hits = [(text.find(h, pos), r) for r, h in markers.headers.items()]
        hits = [(i, r) for i, r in hits if i >= 0]
        if not hits:
            break
        i, role = min(hits, key=lambda x: (x[0], -len(markers.headers[x[1]])))
        start = i + len(markers.headers[role])
        end = text.find(markers.suffix, start)
        end = len(text) if end < 0 else end
        out.append((role, start, end, min(len(text), end + len(markers.suffix))))
        pos = out[-1][3]
    return out


def _document(tokenizer: Any, ids: list[int], eot: frozenset[int]
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """Expected mask and per-role span masks of one document, or ``None`` (no re-render)."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    turns = parse_chat(text, _markers(tokenizer))
    messages = [{"role": r, "content": text[s:e]} for r, s, e, _ in turns]
    try:
        doc = tokenize_conversation(tokenizer, messages, len(ids), eot_ids=eot)
    except TokenizationError:
        return None
    expected = list(doc.loss_mask) if doc is not None else []
    if doc is not None and doc.input_ids != ids[:len(doc.input_ids)]:
        return None
    expected += [0] * (len(ids) - len(expected))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids:
        return None
    starts = [a for a, _ in enc["offset_mapping"]]
    roles = {r: torch.zeros(len(ids), dtype=torch.long) for r in ROLES}
    for role, s, e, _ in turns:
        eot_end = e + len(markers_suffix_eot(tokenizer))
        for t, a in enumerate(starts):
            if s <= a < eot_end:
                roles[role][t] = 1
    return torch.tensor(expected), roles


def markers_suffix_eot(tokenizer: Any) -> str:
    """The end-of-turn part of the suffix (``<|im_end|>`` of ``<|im_end|>\\n``)."""
    suffix = _markers(tokenizer).suffix
    return suffix.rstrip() or suffix


def _hypotheses(expected: torch.Tensor, roles: dict[str, torch.Tensor], valid: torch.Tensor,
                eot_pos: torch.Tensor) -> dict[str, torch.Tensor]:
    later = torch.cat([expected.new_zeros(1), expected[:-1]])
    earlier = torch.cat([expected[1:], expected.new_zeros(1)])
    return {"shift +1": later, "shift -1": earlier, "user turns": roles["user"],
            "user and assistant turns": roles["user"] | expected,
            "system prompt": roles["system"] | expected,
            "end-of-turn excluded": expected * (1 - eot_pos),
            "inverted": valid * (1 - expected), "all tokens": valid.clone()}


def check_loss_mask(row: Row, tokenizer: Any, generation_config: Any = None) -> Check:
    """Compare ``row.loss_mask`` with the chat template's assistant spans (module docstring).

    Returns:
        pass, fail with the hypothesis that explains the difference in ``finding`` (or
        ``unexplained``), or skip when no document re-renders from the chat template.
    """
    eot = end_of_turn_ids(tokenizer, generation_config)
    T = row.input_ids.numel()
    expected, valid = torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    roles = {r: torch.zeros(T, dtype=torch.long) for r in ROLES}
    skipped = []
    for s, e in row.documents:
        got = _document(tokenizer, row.input_ids[s:e].tolist(), eot)
        if got is None:
            skipped.append((s, e))
            continue
        expected[s:e], valid[s:e] = got[0], 1
        for r in ROLES:
            roles[r][s:e] = got[1][r]
    if not bool(valid.any()):
        return Check("loss_mask", SKIP, "no document re-renders from the verifier's chat "
                     "template (not a chat rendering of this tokenizer?): loss_mask not checked",
                     row=row.name)
    outside = torch.ones(T, dtype=torch.bool)
    for s, e in row.documents:
        outside[s:e] = False
    keep = valid.bool() | outside  # compare checked documents and padding
    mask = row.loss_mask.clamp(0, 1)
    wrong = int((mask != expected)[keep].sum())
    details = {"wrong_tokens": wrong, "expected_tokens": int(expected.sum()),
               "file_tokens": int(mask[keep].sum()), "documents_skipped": len(skipped)}
    note = f"; {len(skipped)} documents not a chat rendering, unchecked" if skipped else ""
    if wrong == 0:
        return Check("loss_mask", PASS, f"loss_mask equals the assistant spans of the chat "
                     f"template ({int(expected.sum())} tokens, end-of-turn included{note})",
                     row=row.name, details=details)
    eot_pos = torch.tensor([int(t in eot) for t in row.input_ids.tolist()])
    hyps = {k: int((mask != h)[keep].sum()) for k, h in
            _hypotheses(expected, roles, valid, eot_pos).items()}
    name, dist = min(hyps.items(), key=lambda kv: kv[1])
    details["hypotheses"] = hyps
    first = int(((mask != expected) & keep).nonzero()[0])
    if dist <= len(row.documents) and dist < wrong:
        return Check("loss_mask", FAIL, f"loss_mask is the assistant mask with {name} "
                     f"({wrong} tokens differ from the chat template's assistant spans, first "
                     f"at position {first}; '{name}' explains all but {dist})", row=row.name,
                     finding=name, details=details)
    on_user = int((mask.bool() & roles["user"].bool()).sum())
    return Check("loss_mask", FAIL, f"loss_mask differs from the assistant spans on {wrong} "
                 f"tokens (first at position {first}; {on_user} on user turns); no single "
                 "hypothesis explains it", row=row.name, finding="unexplained", details=details)
