"""Chat-template tokenization with an assistant ``loss_mask``, and the ``mask_token_id`` choice.

Assistant spans are found by rendering prefixes with the verifier's own chat template, the
way the reference does (``speculators/data_generation/preprocessing.py``, render
boundaries): for assistant turn j, ``render(messages[:j], add_generation_prompt=True)``
gives the context, ``render(messages[:j+1])`` the context plus the reply; the tokens in
between, up to and including the end-of-turn token (``<|im_end|>`` in ChatML), are
supervised. Template separators after the end-of-turn token (ChatML's ``\\n``) are not.
This needs no ``{% generation %}`` tags (SmolLM2's template has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_audit.data.errors import MaskTokenError, TokenizationError

# End-of-turn tokens of common chat templates (ChatML, Llama 3, Gemma, Phi-3).
KNOWN_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


@dataclass
class TokenizedConversation:
    """One conversation as verifier tokens.

    ``input_ids``: token ids (list of int, length <= seq_len);
    ``loss_mask``: 0/1 per token, 1 on assistant tokens including the end-of-turn token;
    ``spans``: assistant spans ``[start, end)`` in token positions, after truncation;
    ``truncated``: whether an assistant reply was cut or left out to fit ``seq_len``.
    """

    input_ids: list[int]
    loss_mask: list[int]
    source: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


def end_of_turn_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """Token ids that end an assistant turn: eos, the generation config's eos ids, and the
    known end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``, ...) present in the vocab."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in KNOWN_END_OF_TURN_TOKENS if t in vocab)
    return frozenset(ids)


def render_text(tokenizer: Any, messages: Sequence[dict[str, str]],
                add_generation_prompt: bool) -> str:
    """``messages`` rendered to text with the tokenizer's chat template.

    Raises:
        TokenizationError: the tokenizer has no chat template or rendering fails.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizationError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template; "
            "use a chat (instruct) verifier")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja errors of arbitrary types
        raise TokenizationError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def render_ids(tokenizer: Any, messages: Sequence[dict[str, str]],
               add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template.

    The template writes every special token (bos, role markers) itself, so the text is
    tokenized with ``add_special_tokens=False``.

    Raises:
        TokenizationError: as :func:`render_text`.
    """
    text = render_text(tokenizer, messages, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _close_span(ids: Sequence[int], start: int, end: int, eot_ids: frozenset[int]) -> int:
    """End of an assistant span: just after its last end-of-turn token, else ``end``."""
    for i in range(end - 1, start - 1, -1):
        if ids[i] in eot_ids:
            return i + 1
    return end


def _assistant_turns(messages: Sequence[dict[str, str]]) -> list[int]:
    # An assistant turn at index 0 has no context and stays unsupervised (as in the reference).
    return [j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0]


def _spans_by_text(tokenizer: Any, messages: Sequence[dict[str, str]], seq_len: int,
                   eot_ids: frozenset[int]) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Fast path: render text prefixes, tokenize the pieces between span boundaries in one
    call, and accept the result only if the pieces concatenate to the tokenization of the
    whole text (no token crosses a boundary). ``None`` when that does not hold."""
    char_limit = 16 * seq_len  # renders past this many chars are beyond seq_len tokens
    bounds: list[tuple[int, int]] = []  # (prompt chars, reply chars) per assistant turn
    full_text = ""
    for j in _assistant_turns(messages):
        prompt = render_text(tokenizer, messages[:j], add_generation_prompt=True)
        if len(prompt) > char_limit:
            break
        reply = render_text(tokenizer, messages[: j + 1], add_generation_prompt=False)
        if not reply.startswith(prompt) or not reply.startswith(full_text):
            return None
        bounds.append((len(prompt), len(reply)))
        full_text = reply
    if not bounds:
        return [], []
    cuts = sorted({0, len(full_text), *(c for b in bounds for c in b)})
    pieces = [full_text[a:b] for a, b in zip(cuts, cuts[1:])]
    encoded = tokenizer(pieces + [full_text], add_special_tokens=False)["input_ids"]
    ids = [t for piece in encoded[:-1] for t in piece]
    if ids != list(encoded[-1]):
        return None
    token_at, count = {0: 0}, 0  # char cut -> token index
    for cut, piece in zip(cuts[1:], encoded[:-1]):
        count += len(piece)
        token_at[cut] = count
    spans, row_end = [], 0
    for p_chars, r_chars in bounds:
        start, end = token_at[p_chars], token_at[r_chars]
        if start >= seq_len:
            break
        spans.append((start, _close_span(ids, start, end, eot_ids)))
        row_end = end  # the row ends with the last reply that starts inside seq_len
    return ids[:row_end], spans


def _spans_by_tokens(tokenizer: Any, messages: Sequence[dict[str, str]], seq_len: int,
                     eot_ids: frozenset[int], source: str
                     ) -> tuple[list[int], list[tuple[int, int]]]:
    """Slow path (the reference's way): tokenize each prefix render; the span starts where
    the reply render extends the generation-prompt render (common prefix otherwise)."""
    spans: list[tuple[int, int]] = []
    full: list[int] = []
    for j in _assistant_turns(messages):
        prompt = render_ids(tokenizer, messages[:j], add_generation_prompt=True)
        if len(prompt) >= seq_len:
            break
        reply = render_ids(tokenizer, messages[: j + 1], add_generation_prompt=False)
        start = len(prompt) if reply[: len(prompt)] == prompt else _common_prefix_len(prompt,
                                                                                      reply)
        if reply[: len(full)] != full:
            raise TokenizationError(
                f"{source or 'conversation'}: chat template is not prefix-stable at assistant "
                f"turn {j} (the render of turns 0..{j} does not extend the earlier render)")
        spans.append((start, _close_span(reply, start, len(reply), eot_ids)))
        full = reply
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], seq_len: int,
                          source: str = "", eot_ids: frozenset[int] | None = None,
                          ) -> TokenizedConversation | None:
    """Tokenize one conversation and mark its assistant spans, truncated to ``seq_len``.

    The row ends with the last assistant turn that starts within ``seq_len`` tokens
    (trailing user turns carry no supervision). A truncated reply keeps its first tokens.

    Returns:
        The tokenized conversation, or ``None`` when no supervised token is left
        (the caller counts it as dropped).

    Raises:
        TokenizationError: no chat template, or the template is not prefix-stable (an
            earlier render is not a prefix of a later one, so spans cannot be placed).
    """
    if seq_len < 2:
        raise TokenizationError(f"seq_len must be >= 2, got {seq_len}")
    if eot_ids is None:
        eot_ids = end_of_turn_ids(tokenizer)
    fast = _spans_by_text(tokenizer, messages, seq_len, eot_ids)
    full, spans = fast if fast is not None else _spans_by_tokens(
        tokenizer, messages, seq_len, eot_ids, source)
    input_ids = full[:seq_len]
    loss_mask = [0] * len(input_ids)
    kept = []
    for start, end in spans:
        end = min(end, len(input_ids))
        if start < end:
            loss_mask[start:end] = [1] * (end - start)
            kept.append((start, end))
    if not kept:
        return None
    # truncated: some assistant reply of the conversation is cut or left out
    truncated = len(full) > seq_len or len(kept) < len(_assistant_turns(messages))
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask, source=source,
                                 spans=kept, truncated=truncated)


# ------------------------------------------------------------------------ mask token id
@dataclass(frozen=True)
class MaskTokenChoice:
    """The ``mask_token_id`` for the noise block and why it was chosen."""

    id: int
    reason: str


def _forbidden_ids(tokenizer: Any) -> dict[int, str]:
    named = {}
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id",
                 "cls_token_id", "sep_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            named.setdefault(int(value), attr.removesuffix("_id"))
    for i in end_of_turn_ids(tokenizer):
        named.setdefault(i, "end-of-turn token")
    return named


def choose_mask_token_id(tokenizer: Any, embedding_rows: int,
                         explicit: int | None = None) -> MaskTokenChoice:
    """Choose ``mask_token_id``; never a silent fallback to pad or eos.

    Order: an ``explicit`` id (recorded as overriding the tokenizer's mask token if it has
    one); else the tokenizer's mask token; else the first spare embedding row (an id >=
    ``len(tokenizer)`` and < ``embedding_rows``); else the highest-id reserved special token
    (an added special token that is not bos/eos/pad/unk/end-of-turn and does not occur in the
    chat template).

    Raises:
        MaskTokenError: the explicit id is out of ``[0, embedding_rows)`` or is a
            pad/eos/bos/unk/end-of-turn token; or no candidate exists (pass --mask-token-id).
    """
    forbidden = _forbidden_ids(tokenizer)
    tok_mask = getattr(tokenizer, "mask_token_id", None)
    if explicit is not None:
        explicit = int(explicit)
        if not 0 <= explicit < embedding_rows:
            raise MaskTokenError(f"--mask-token-id {explicit} is out of range [0, "
                                 f"{embedding_rows}) (verifier embedding rows)")
        if explicit in forbidden:
            raise MaskTokenError(
                f"--mask-token-id {explicit} is the {forbidden[explicit]} token; the mask "
                "token must never occur in the data (pad/eos/bos would be confused with it)")
        note = f" (overrides the tokenizer's mask token {tok_mask})" if (
            tok_mask is not None and tok_mask != explicit) else ""
        return MaskTokenChoice(explicit, f"explicit --mask-token-id{note}")
    if tok_mask is not None:
        return MaskTokenChoice(int(tok_mask), f"tokenizer mask token {tokenizer.mask_token!r}")
    if embedding_rows > len(tokenizer):
        return MaskTokenChoice(
            len(tokenizer), f"spare embedding row: id {len(tokenizer)} >= len(tokenizer) "
            f"and < embedding rows {embedding_rows}, never produced by the tokenizer")
    template = str(getattr(tokenizer, "chat_template", "") or "")
    special = {int(i): t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(t, "special", False)}
    candidates = sorted(i for i, t in special.items()
                        if i not in forbidden and str(t) not in template and i < embedding_rows)
    if candidates:
        i = candidates[-1]
        return MaskTokenChoice(
            i, f"reserved special token {str(special[i])!r}: an added special token that is "
            "not bos/eos/pad/unk/end-of-turn and not used by the chat template "
            "(the tokenizer has no mask token and no spare embedding row)")
    raise MaskTokenError(
        "the verifier's tokenizer has no mask token, no spare embedding row and no reserved "
        "special token; pass --mask-token-id N (an id that never occurs in the data, not "
        "pad/eos)")
