"""Where training rows come from, with a position that a checkpoint saves and restores.

* :class:`OfflineSource`: batch files written by ``dflash-audit data`` (``batch_*.safetensors``).
  Global row index g (over all ranks and steps) maps to file ``perm_e[g mod N]`` with
  ``e = g // N`` and ``perm_e`` a permutation seeded by ``(seed, e)``: every epoch visits
  every file once, in a new order. Rank r of W takes g = (step * rows_per_step + m) * W + r
  for micro-batch m, so the position is the step counter alone, and a step reads the same
  rows whatever the split: W ranks x R rows equal 1 process x W*R rows (g is the row's key).
* :class:`OnlineSource`: the verifier runs in the loop. Training conversations (the held-out
  ones removed) are shuffled per epoch, cut into chunks of ``chunk_conversations``, and each
  chunk is tokenized, (optionally regenerated,) packed and captured by
  :func:`dflash_audit.data.pipeline.build_batches` when the loop reaches it. Rank r takes
  chunks r, r+W, ... The position is (chunk, row within chunk) per rank; a row's key is
  ``(global chunk << 20) | row``.

Both yield ``(key, Batch)`` pairs (:class:`~dflash_audit.data.batch.Batch`): the key names the
row across ranks and world sizes, and seeds its anchors
(:func:`dflash_audit.train.setup.next_micro_batches`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_audit.data.batch import Batch
from dflash_audit.data.errors import BatchFileError, DataError
from dflash_audit.data.pipeline import BATCH_GLOB


class SourceError(DataError):
    """A training data source is unusable or does not match the run (resume, verifier)."""


def _doc_sources(batch: Batch) -> list[str]:
    return [str(d.get("source", "")) for d in batch.metadata.get("documents", [])]


class OfflineSource:
    """Rows from a directory of batch files (see the module docstring).

    Raises (constructor):
        BatchFileError: no batch files, a bad file, or files that disagree on verifier,
            target layers, mask token or hidden size.
    """

    kind = "offline"

    def __init__(self, directory: str | Path, seed: int = 0, rank: int = 0, world_size: int = 1,
                 rows_per_step: int = 1):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise BatchFileError(f"{self.directory}: batch directory not found (write one with "
                                 f"`dflash-audit data --out {self.directory}`)")
        self.files = sorted(self.directory.glob(BATCH_GLOB))
        if not self.files:
            raise BatchFileError(f"{self.directory}: no {BATCH_GLOB} files (write them with "
                                 f"`dflash-audit data --out {self.directory}`)")
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.rows_per_step = rows_per_step
        self.step = 0
        self.metadata: dict[str, Any] = {}
        self.sources: list[str] = []
        self._rows_for_vocab: list[tuple[torch.Tensor, torch.Tensor]] = []
        keys = ("target_layer_ids", "mask_token_id", "hidden_size", "num_verifier_layers")
        for path in self.files:  # validate every file once, up front
            batch = Batch.load(path)
            if not self.metadata:
                self.metadata = dict(batch.metadata)
            for key in keys:
                if batch.metadata[key] != self.metadata[key]:
                    raise BatchFileError(f"{path}: {key} = {batch.metadata[key]!r} differs from "
                                         f"{self.files[0].name} ({self.metadata[key]!r})")
            if batch.metadata["verifier"].get("config_hash") != \
                    self.metadata["verifier"].get("config_hash"):
                raise BatchFileError(f"{path}: written with another verifier than "
                                     f"{self.files[0].name}")
            self.sources += _doc_sources(batch)
            self._rows_for_vocab.append((batch.input_ids, batch.loss_mask))

    # ----------------------------------------------------------------- properties
    @property
    def target_layer_ids(self) -> list[int]:
        return [int(i) for i in self.metadata["target_layer_ids"]]

    @property
    def mask_token_id(self) -> int:
        return int(self.metadata["mask_token_id"])

    @property
    def data_name(self) -> str | None:
        """The conversation source the batches came from (``chitchat``, a file path)."""
        return self.metadata.get("data")

    def vocab_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of every row, for the draft vocabulary."""
        return self._rows_for_vocab

    def digest(self) -> str:
        """sha256 of the file names and sizes (a resume must see the same files)."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.name}:{f.stat().st_size};".encode())
        return h.hexdigest()

    # ---------------------------------------------------------------------- rows
    def _file(self, g: int) -> Path:
        n = len(self.files)
        epoch, i = divmod(g, n)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return self.files[int(torch.randperm(n, generator=gen)[i])]

    def next_rows(self) -> list[tuple[int, Batch]]:
        """The ``rows_per_step`` ``(global row index, row)`` pairs of this rank for the next
        step."""
        W, r, k = self.world_size, self.rank, self.step
        keys = [(k * self.rows_per_step + m) * W + r for m in range(self.rows_per_step)]
        self.step += 1
        return [(g, Batch.load(self._file(g))) for g in keys]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "digest": self.digest(),
                "files": len(self.files)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position.

        Raises:
            SourceError: the state is not an offline position or the files changed.
        """
        if state.get("kind") != self.kind:
            raise SourceError(f"the checkpoint was trained from a {state.get('kind')} source, "
                              f"this run reads batch files")
        if state.get("digest") != self.digest():
            raise SourceError(f"the batch files in {self.directory} changed since the checkpoint "
                              f"({state.get('files')} files then, {len(self.files)} now): an "
                              "exact resume needs the same files")
        self.step = int(state["step"])


class OnlineSource:
    """Rows captured by the verifier inside the training loop (see the module docstring).

    Args:
        verifier: a loaded :class:`~dflash_audit.data.verifier.Verifier`.
        conversations: the training conversations (held-out ones already removed).
        data_name: the ``--data`` spec (recorded in batch metadata).
        seq_len, target_layer_ids, mask_token_id, regenerate, max_new_tokens, max_turns: as for
            :func:`~dflash_audit.data.pipeline.build_batches`.
        chunk_conversations: conversations packed and captured together.
    """

    kind = "online"

    def __init__(self, verifier: Any, conversations: Sequence[Any], data_name: str,
                 seq_len: int, target_layer_ids: list[int], mask_token_id: int | None,
                 regenerate: bool = False, max_new_tokens: int = 64,
                 max_turns: int | None = None, seed: int = 0,
                 chunk_conversations: int = 32, rank: int = 0, world_size: int = 1,
                 rows_per_step: int = 1):
        if not conversations:
            raise SourceError(f"no training conversations in {data_name!r}")
        if chunk_conversations < 1:
            raise SourceError(f"chunk_conversations must be >= 1, got {chunk_conversations}")
        self.verifier, self.conversations = verifier, list(conversations)
        self.data_name, self.seq_len = data_name, seq_len
        self.target_layer_ids = list(target_layer_ids)
        self._mask_token_id = mask_token_id
        self.regenerate, self.max_new_tokens = regenerate, max_new_tokens
        self.max_turns = max_turns
        self.seed, self.chunk_conversations = seed, chunk_conversations
        self.rank, self.world_size, self.rows_per_step = rank, world_size, rows_per_step
        self.chunk = -1  # local chunk counter (this rank's chunk number)
        self.row = 0
        self._rows: list[Batch] = []
        self._built: tuple[int, list[Batch]] | None = None  # last chunk built (index, rows)
        self.sources = [c.source for c in self.conversations]

    @property
    def chunks_per_epoch(self) -> int:
        return -(-len(self.conversations) // self.chunk_conversations)

    @property
    def mask_token_id(self) -> int:
        if self._mask_token_id is None:
            from dflash_audit.data.tokenize import choose_mask_token_id

            self._mask_token_id = choose_mask_token_id(
                self.verifier.tokenizer, self.verifier.embedding_rows).id
        return self._mask_token_id

    def _chunk_conversations(self, local_chunk: int) -> list[Any]:
        g = local_chunk * self.world_size + self.rank  # global chunk index
        epoch, c = divmod(g, self.chunks_per_epoch)
        order = list(range(len(self.conversations)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        part = order[c * self.chunk_conversations:(c + 1) * self.chunk_conversations]
        return [self.conversations[i] for i in part]

    def _build(self, local_chunk: int) -> list[Batch]:
        if self._built is not None and self._built[0] == local_chunk:
            return self._built[1]
        rows = self._capture(local_chunk)
        self._built = (local_chunk, rows)
        return rows

    def _capture(self, local_chunk: int) -> list[Batch]:
        from dflash_audit.data.conversations import ConversationSet
        from dflash_audit.data.pipeline import build_batches

        convs = ConversationSet(source=self.data_name,
                                conversations=self._chunk_conversations(local_chunk))
        try:
            return build_batches(self.verifier, self.data_name, self.seq_len, rows=1 << 30,
                                 target_layer_ids=self.target_layer_ids,
                                 mask_token_id=self.mask_token_id, seed=local_chunk,
                                 progress=False, regenerate=self.regenerate,
                                 max_new_tokens=self.max_new_tokens, max_turns=self.max_turns,
                                 conversations=convs)
        except DataError as exc:
            if "no conversation" in str(exc):
                return []  # a chunk without supervised tokens: move on
            raise

    def _advance(self) -> None:
        for _ in range(1000):
            self.chunk += 1
            self.row = 0
            self._rows = self._build(self.chunk)
            if self._rows:
                return
        raise SourceError(f"{self.data_name!r}: 1000 consecutive chunks without a supervised "
                          "token; check the data")

    def _next_row(self) -> tuple[int, Batch]:
        if self.chunk < 0 or self.row >= len(self._rows):
            self._advance()
        key = ((self.chunk * self.world_size + self.rank) << 20) | self.row
        row = self._rows[self.row]
        self.row += 1
        return key, row

    def next_rows(self) -> list[tuple[int, Batch]]:
        """The ``rows_per_step`` ``(key, row)`` pairs of this rank for the next step."""
        return [self._next_row() for _ in range(self.rows_per_step)]

    def vocab_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of this rank's first chunk (the draft vocabulary's counts)."""
        return [(b.input_ids, b.loss_mask) for b in self._build(0)]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "chunk": self.chunk, "row": self.row,
                "conversations": len(self.conversations)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position (the current chunk is rebuilt, deterministically).

        Raises:
            SourceError: not an online position, or the conversation count changed.
        """
        if state.get("kind") != self.kind:
            raise SourceError(f"the checkpoint was trained from a {state.get('kind')} source, "
                              "this run captures online")
        if state.get("conversations") != len(self.conversations):
            raise SourceError(f"the training conversations changed since the checkpoint "
                              f"({state.get('conversations')} then, {len(self.conversations)} "
                              "now)")
        self.chunk, self.row = int(state["chunk"]), int(state["row"])
        self._rows = self._build(self.chunk) if self.chunk >= 0 else []
