"""Errors of the data pipeline (verifier, conversations, tokenization, capture, batch files).

Every error raised on bad user input derives from :class:`DataError`, so the CLI turns any
of them into a one-line message and exit code 2 instead of a traceback.
"""

from __future__ import annotations


class DataError(Exception):
    """Bad input to the data pipeline; the message says what is wrong and how to fix it."""


class VerifierError(DataError):
    """A verifier spec cannot be resolved (missing package, folder, config or cache)."""


class ConversationError(DataError):
    """A conversation source is unreadable or a record in it is malformed."""


class TokenizationError(DataError):
    """The chat template cannot be used to derive assistant spans."""


class MaskTokenError(DataError):
    """No usable ``mask_token_id`` (or an invalid explicit one)."""


class LayerIdError(DataError):
    """Invalid ``target_layer_ids`` for the verifier (range, duplicates, last layer)."""


class BatchFileError(DataError):
    """A batch file is missing, corrupt, or inconsistent with its metadata."""
