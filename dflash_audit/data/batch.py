"""The :class:`Batch`: one packed row with captured hidden states, and its safetensors file.

Tensors (reference key names, DESIGN.md section 3; T packed length, H hidden size, n number
of target layers):

| key                         | dtype   | shape      | pad |
|-----------------------------|---------|------------|-----|
| hidden_states               | float32 | [1, T, n*H]| 0   |
| verifier_last_hidden_states | float32 | [1, T, H]  | 0   |
| input_ids                   | int64   | [1, T]     | 0   |
| loss_mask                   | int64   | [1, T] 0/1 | 0   |
| position_ids                | int64   | [1, T]     | 0   |
| document_ids                | int64   | [1, T]     | -1  |

Metadata (a JSON-able dict) is stored in the safetensors header, one JSON string per key.
Loading validates everything and raises :class:`BatchFileError` naming the file and the
problem; a truncated or corrupt file gives that error too, never a raw traceback. The
per-tensor rules (:func:`tensor_problem`: dtypes, 0/1 loss mask, ids >= 0, finite hidden
states) and the vocabulary bound (:func:`token_id_problem`) are the ones ``check-batches``
applies too, in the same words: what train refuses, the batch audit refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_audit.atomic import save_safetensors
from dflash_audit.data.errors import BatchFileError
from dflash_audit.user_input import loads_json, not_a_file

FORMAT = "dflash-audit-batch"
FORMAT_VERSION = 1

TENSOR_KEYS = ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask",
               "position_ids", "document_ids")
TENSOR_DTYPES = {
    "hidden_states": torch.float32,
    "verifier_last_hidden_states": torch.float32,
    "input_ids": torch.int64,
    "loss_mask": torch.int64,
    "position_ids": torch.int64,
    "document_ids": torch.int64,
}
REQUIRED_METADATA = ("verifier", "target_layer_ids", "layer_id_convention", "tokenizer",
                     "seq_len", "hidden_size", "num_verifier_layers", "mask_token_id",
                     "mask_token_reason", "num_documents")


@dataclass
class Batch:
    """One packed row and its captured hidden states (see the module table), plus metadata:
    ``verifier`` (name, path, config_hash), ``target_layer_ids``, ``layer_id_convention``,
    ``tokenizer``, ``seq_len``, ``hidden_size``, ``num_verifier_layers``, ``mask_token_id``,
    ``mask_token_reason``, ``num_documents`` and free provenance (``documents``, ``data``...).
    """

    hidden_states: torch.Tensor
    verifier_last_hidden_states: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    metadata: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ accessors
    def tensors(self) -> dict[str, torch.Tensor]:
        """The six tensors by reference key name."""
        return {k: getattr(self, k) for k in TENSOR_KEYS}

    @property
    def seq_len(self) -> int:
        """T."""
        return int(self.input_ids.shape[-1])

    @property
    def hidden_size(self) -> int:
        """H."""
        return int(self.verifier_last_hidden_states.shape[-1])

    @property
    def target_layer_ids(self) -> list[int]:
        return [int(i) for i in self.metadata["target_layer_ids"]]

    @property
    def mask_token_id(self) -> int:
        return int(self.metadata["mask_token_id"])

    @property
    def num_documents(self) -> int:
        return int(self.metadata["num_documents"])

    # ----------------------------------------------------------------- validation
    def validate(self, where: str = "batch", layout: bool = True) -> None:
        """Check metadata, dtypes, shapes, values (:func:`tensor_problem`) and, with
        ``layout``, the row layout (document ids, positions, padding: what ``check-batches``
        reports as findings instead).

        Raises:
            BatchFileError: ``"<where>: <what is wrong>"``.
        """
        def fail(msg: str) -> None:
            raise BatchFileError(f"{where}: {msg}")

        md = self.metadata
        missing = [k for k in REQUIRED_METADATA if k not in md]
        if missing:
            fail(f"metadata is missing {missing}")
        for key in TENSOR_KEYS:
            problem = tensor_problem(key, getattr(self, key))
            if problem:
                fail(problem)
        for key in ("seq_len", "hidden_size", "num_verifier_layers", "num_documents"):
            if not isinstance(md[key], int) or isinstance(md[key], bool) or md[key] < 0:
                fail(f"metadata {key} must be a non-negative int, got {md[key]!r}")
        T = md["seq_len"]
        for key in ("input_ids", "loss_mask", "position_ids", "document_ids"):
            if tuple(getattr(self, key).shape) != (1, T):
                fail(f"{key} has shape {tuple(getattr(self, key).shape)}, expected (1, {T})")
        ids = md["target_layer_ids"]
        H, N = md["hidden_size"], md["num_verifier_layers"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            fail(f"metadata target_layer_ids must be a non-empty list of ints, got {ids!r}")
        if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > N:  # N: the last layer, pre-norm
            fail(f"metadata target_layer_ids {ids} must be ascending, unique, in [0, {N}]")
        if tuple(self.verifier_last_hidden_states.shape) != (1, T, H):
            fail(f"verifier_last_hidden_states has shape "
                 f"{tuple(self.verifier_last_hidden_states.shape)}, expected (1, {T}, {H})")
        if tuple(self.hidden_states.shape) != (1, T, len(ids) * H):
            fail(f"hidden_states has shape {tuple(self.hidden_states.shape)}, expected "
                 f"(1, {T}, {len(ids) * H}) = len(target_layer_ids)={len(ids)} x H={H}")
        if not isinstance(md["mask_token_id"], int) or md["mask_token_id"] < 0:
            fail(f"metadata mask_token_id must be a non-negative int, got {md['mask_token_id']!r}")
        if layout:
            self._validate_layout(fail)

    def _validate_layout(self, fail: Any) -> None:
        doc = self.document_ids[0]
        valid = doc >= 0
        n_valid = int(valid.sum())
        if not bool(valid[:n_valid].all()):
            fail("document_ids: padding (-1) must only appear at the end of the row")
        if bool((doc < -1).any()):
            fail("document_ids has values below -1")
        k = int(doc.max()) + 1 if n_valid else 0
        if k != self.metadata["num_documents"]:
            fail(f"document_ids hold {k} documents, metadata num_documents is "
                 f"{self.metadata['num_documents']}")
        d = doc[:n_valid]
        if n_valid and (int(d[0]) != 0 or bool(((d[1:] - d[:-1]) < 0).any())
                        or bool(((d[1:] - d[:-1]) > 1).any())):
            fail("document_ids must run 0, 0, ..., 1, 1, ..., k-1 (contiguous, ascending)")
        pos = self.position_ids[0][:n_valid]
        starts = torch.ones(n_valid, dtype=torch.bool)
        if n_valid:
            starts[1:] = d[1:] != d[:-1]
        expected = torch.arange(n_valid) - torch.cummax(
            torch.where(starts, torch.arange(n_valid), 0), 0).values
        if not torch.equal(pos, expected):
            fail("position_ids must restart at 0 for each document and count up by 1")
        pad = ~valid
        for key in ("input_ids", "loss_mask", "position_ids"):
            if bool((getattr(self, key)[0][pad] != 0).any()):
                fail(f"{key} must be 0 on padding positions (document_ids == -1)")

    # ----------------------------------------------------------------------- files
    def save(self, path: str | Path) -> Path:
        """Write the batch as one safetensors file (atomically, via a temp file).

        Raises:
            BatchFileError: the batch is invalid (nothing is written).
        """
        path = Path(path)
        self.validate(str(path))
        metadata = {"format": json.dumps(FORMAT), "format_version": json.dumps(FORMAT_VERSION)}
        metadata.update({k: json.dumps(v, sort_keys=True) for k, v in self.metadata.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_safetensors({k: v.contiguous() for k, v in self.tensors().items()}, tmp,
                         metadata=metadata)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path, layout: bool = True) -> Batch:
        """Read and validate a batch file written by :meth:`save` (``layout``: see
        :meth:`validate`).

        Raises:
            BatchFileError: missing / truncated / corrupt file, wrong format, missing keys,
                or any inconsistency found by :meth:`validate`; the message names the file.
        """
        tensors, metadata = read_batch_file(path, TENSOR_KEYS)
        batch = cls(**tensors, metadata=metadata)
        batch.validate(str(path), layout=layout)
        return batch


def tensor_problem(key: str, t: Any) -> str | None:
    """What makes one tensor of a batch file unusable for training (``train`` refuses it and
    ``check-batches`` refuses it in the same words), or None: not a tensor, another dtype
    than :data:`TENSOR_DTYPES` (float ``input_ids``, bf16 hidden states), negative
    ``input_ids``, a ``loss_mask`` other than 0/1, non-finite hidden states.

    Args:
        key: one of :data:`TENSOR_KEYS`.
        t: the tensor as read (any shape).
    """
    if not isinstance(t, torch.Tensor):
        return f"{key} is not a tensor"
    if t.dtype != TENSOR_DTYPES[key]:
        return f"{key} has dtype {t.dtype}, expected {TENSOR_DTYPES[key]}"
    if key == "input_ids" and bool((t < 0).any()):
        first = (t < 0).nonzero()[0].tolist()
        return (f"input_ids hold a negative token id ({int(t[tuple(first)])} at position "
                f"{_position(first)})")
    if key == "loss_mask" and bool(((t != 0) & (t != 1)).any()):
        bad = ((t != 0) & (t != 1)).nonzero()[0].tolist()
        return f"loss_mask must be 0/1 (holds {int(t[tuple(bad)])} at position {_position(bad)})"
    if key in ("hidden_states", "verifier_last_hidden_states"):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            return (f"{key} contains non-finite values ({nan} NaN, {inf} inf; first at "
                    f"position {_position(bad.nonzero()[0].tolist())})")
    return None


def _position(index: list[int]) -> int:
    """The token position of an element index of a ``[T]``, ``[1, T]`` or ``[1, T, D]``
    tensor."""
    return index[1] if len(index) >= 2 else index[0]


def token_id_problem(input_ids: torch.Tensor, vocab_size: int) -> str | None:
    """A message when ``input_ids`` (int64, any shape) hold an id outside ``[0, vocab_size)``
    (the verifier's embedding rows), else None: the tokens were made with another tokenizer,
    and an embedding lookup would fail or read a row no token trains."""
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if not bool(bad.any()):
        return None
    first = bad.nonzero()[0].tolist()
    return (f"input_ids hold token id {int(input_ids[tuple(first)])} (at position "
            f"{_position(first)}), outside the verifier's vocabulary of {vocab_size} ids: the "
            "batches were made with another tokenizer; pass the verifier they were captured "
            "with")


def read_batch_file(path: str | Path, keys: Sequence[str] = TENSOR_KEYS
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors ``keys`` and the metadata (format and version checked, those two keys
    removed) of a batch file, not validated further.

    Raises:
        BatchFileError: missing / not a regular file / truncated / corrupt, a tensor of
            ``keys`` missing, metadata that is not JSON, another format or format_version.
    """
    path = Path(path)
    if not path.is_file():
        raise BatchFileError(f"{path}: batch file {not_a_file(path)}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = f.metadata() or {}
            found = set(f.keys())
            missing = [k for k in keys if k not in found]
            if missing:
                raise BatchFileError(f"{path}: tensors {missing} are missing "
                                     f"(found {sorted(found)})")
            tensors = {k: f.get_tensor(k) for k in keys}
    except BatchFileError:
        raise
    except Exception as exc:  # safetensors raises several types on a damaged file
        raise BatchFileError(f"{path}: not a readable safetensors batch file (truncated or "
                             f"corrupt?): {type(exc).__name__}: {exc}") from exc
    try:
        metadata = {k: loads_json(v) for k, v in raw_meta.items()}
    except json.JSONDecodeError as exc:
        raise BatchFileError(f"{path}: metadata is not valid JSON: {exc}") from exc
    if metadata.pop("format", None) != FORMAT:
        raise BatchFileError(f"{path}: not a {FORMAT} file (metadata 'format' missing)")
    version = metadata.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise BatchFileError(f"{path}: format_version {version!r}, this dflash-audit reads "
                             f"{FORMAT_VERSION}")
    return tensors, metadata
