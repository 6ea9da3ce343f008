"""Real input: verifier + conversations -> packed batches with captured hidden states.

Modules, one job each (imports point down):

- ``verifier``      resolve a verifier spec (local HF folder or ``smollm2-135m``), identity
- ``conversations`` read chitchat / JSONL / ShareGPT conversations as role/content turns
- ``regenerate``    replace assistant turns with the verifier's own greedy replies (cached)
- ``tokenize``      chat-template tokenization with an assistant ``loss_mask``; mask token
- ``pack``          pack tokenized conversations into one [1, T] row
- ``capture``       forward-hook capture of target layers + last layer (pre-norm)
- ``batch``         the :class:`~dflash_audit.data.batch.Batch` object and its files
- ``reference_format`` the reference's offline format (``hs_{i}.safetensors`` + Arrow rows)
- ``pipeline``      ``build_batches`` / ``write_batches`` / ``load_batches``
- ``command``       the ``dflash-audit data`` command (no torch until it runs)

Only the error classes are imported here, so ``import dflash_audit.data`` stays cheap.
"""

from dflash_audit.data.errors import (
    BatchFileError,
    ConversationError,
    DataError,
    LayerIdError,
    MaskTokenError,
    TokenizationError,
    VerifierError,
)

__all__ = [
    "BatchFileError",
    "ConversationError",
    "DataError",
    "LayerIdError",
    "MaskTokenError",
    "TokenizationError",
    "VerifierError",
]
