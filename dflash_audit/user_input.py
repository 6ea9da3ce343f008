"""Reading untrusted input (a user's files, a candidate's outputs): what a path is, a bounded
read of a regular file, and JSON / TOML parsing with a bound on nesting.

A path given as a file may be a folder, a device (``/dev/zero`` never ends), a FIFO (a read
blocks) or a socket: :func:`path_kind` names it for the message ("is a character device, not
a regular file") instead of "does not exist", and :func:`read_regular_text` refuses it
without blocking.

``json.loads`` and ``tomllib.loads`` recurse once (or several times) per level of arrays and
objects: a document nested some hundred levels deep (``[[[[...]]]]``) raises
``RecursionError``, which no caller expects, or parses just below the limit and makes the next
recursive step (``json.dumps`` of a report for its signature) raise it instead. These loaders
refuse any document nested deeper than :data:`MAX_NESTING` levels before parsing it, with the
format's own decode error (:class:`JSONNestingError` is a ``json.JSONDecodeError``,
:class:`TOMLNestingError` a ``tomllib.TOMLDecodeError``, both ``ValueError``), so every
caller's existing "not valid JSON / TOML" handling reports it as one line.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

#: Deepest nesting of arrays / objects (tables) accepted. Real inputs stay far below (a
#: compare report, a HF config or a chat record with tool calls: under 10 levels).
MAX_NESTING = 100

_JSON_STRINGS = r'"(?:[^"\\]|\\.)*"'
_TOML_STRINGS = (r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"|'
                 r"'[^'\n]*'|#[^\n]*")  # and comments
_JSON_TOKENS = re.compile(_JSON_STRINGS + r"|[\[\]{}]")
_TOML_TOKENS = re.compile(_TOML_STRINGS + r"|[\[\]{}]")
_SKIPPED = {_JSON_TOKENS: re.compile(_JSON_STRINGS), _TOML_TOKENS: re.compile(_TOML_STRINGS)}
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_WHAT = f"nested deeper than {MAX_NESTING} levels of arrays / objects"


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"))


def path_kind(path: str | Path) -> str:
    """What ``path`` is, for a message: ``"a regular file"``, ``"a folder"``, ``"a character
    device"``, ``"a FIFO (named pipe)"``, ``"a socket"``, ``"a block device"``, ``"a broken
    link"``, ``"unreadable (<reason>)"`` or ``"missing"`` (links followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_a_file(path: str | Path) -> str:
    """The end of a message for a ``path`` that should be a regular file and is not: ``"does
    not exist"``, ``"is a folder, not a file"``, ``"is a character device, not a regular
    file"``..."""
    kind = path_kind(path)
    if kind == "missing":
        return "does not exist"
    if kind.startswith("unreadable"):
        return f"is {kind}"
    return f"is {kind}, not {'a' if kind == 'a folder' else 'a regular'} file"


def read_regular_text(path: str | Path, max_bytes: int, follow_links: bool = True) -> str:
    """The UTF-8 text of the regular file ``path``, opened without blocking (a FIFO is refused,
    not waited on) and read only up to ``max_bytes``; with ``follow_links`` False a symlink
    is refused (``ELOOP``) instead of followed (a file another program wrote: a candidate's
    output).

    Raises:
        OSError: unreadable, a symlink (``follow_links`` False), or not a regular file
            (``EINVAL``, the message says what it is), or larger than ``max_bytes``
            (``EFBIG``); ``filename`` is ``path``.
        UnicodeDecodeError: not UTF-8.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow_links else flags | os.O_NOFOLLOW)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise OSError(errno.EINVAL, f"{kind}, not a regular file", str(path))
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
    return data.decode("utf-8")


def shorten(text: str, limit: int = 80) -> str:
    """``text`` for a message: as is up to ``limit`` characters, else its start and its
    length (a value of any size is named, never echoed whole)."""
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"


class JSONNestingError(json.JSONDecodeError):
    """A JSON document nested deeper than :data:`MAX_NESTING` levels (``pos``: where)."""


class TOMLNestingError(tomllib.TOMLDecodeError):
    """A TOML document nested deeper than :data:`MAX_NESTING` levels."""

    def __init__(self, msg: str):
        ValueError.__init__(self, msg)


def too_deep(text: str, tokens: re.Pattern[str] = _JSON_TOKENS,
             limit: int = MAX_NESTING) -> int | None:
    """The offset in ``text`` of the first opening bracket / brace that is more than
    ``limit`` levels deep (brackets inside strings, and TOML comments, ignored), or None."""
    if text.count("[") + text.count("{") <= limit:  # the common case: no scan
        return None
    brackets = _NOT_A_BRACKET.sub("", _SKIPPED[tokens].sub("", text))  # at C speed
    if max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0) <= limit:
        return None
    depth = 0  # too deep: find where
    for m in tokens.finditer(text):
        c = m.group()
        if c in ("[", "{"):
            depth += 1
            if depth > limit:
                return m.start()
        elif c in ("]", "}"):
            depth = max(depth - 1, 0)
    return None


def loads_json(text: str | bytes | bytearray) -> Any:
    """``json.loads`` for untrusted text (a user's file, a candidate's output).

    Raises:
        json.JSONDecodeError: not JSON, or nested deeper than :data:`MAX_NESTING` levels
            (:class:`JSONNestingError`).
        UnicodeDecodeError: ``bytes`` that are not UTF-8.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    pos = too_deep(text)
    if pos is not None:
        raise JSONNestingError(_WHAT, text, pos)
    try:
        return json.loads(text)
    except RecursionError:  # pragma: no cover - only with a far lower recursion limit
        raise JSONNestingError(_WHAT, text, 0) from None


#: The largest JSON file a candidate's process may hand over (status, identity, outputs).
MAX_OUTPUT_JSON_BYTES = 64 << 20


def read_output_json(path: str | Path, max_bytes: int = MAX_OUTPUT_JSON_BYTES) -> Any:
    """The JSON file ``path`` that another process wrote into a folder it can write (a
    candidate's status, heartbeat, identity or outputs): read only when it is a regular file
    itself (a symlink, FIFO or device is refused, never followed or waited on), up to
    ``max_bytes``, parsed with :func:`loads_json`.

    Raises:
        OSError: missing, unreadable, not a regular file, a symlink or too large.
        ValueError: not UTF-8 JSON, or nested too deeply.
    """
    return loads_json(read_regular_text(path, max_bytes, follow_links=False))


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads`` for untrusted text.

    Raises:
        tomllib.TOMLDecodeError: not TOML, or nested deeper than :data:`MAX_NESTING` levels
            (:class:`TOMLNestingError`, naming the line).
    """
    pos = too_deep(text, _TOML_TOKENS)
    if pos is not None:
        raise TOMLNestingError(f"{_WHAT} (line {text.count(chr(10), 0, pos) + 1})")
    try:
        return tomllib.loads(text)
    except RecursionError:  # pragma: no cover - only with a far lower recursion limit
        raise TOMLNestingError(_WHAT) from None
