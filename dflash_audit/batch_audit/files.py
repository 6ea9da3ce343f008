"""Read a user's batch folder into :class:`Row`s, in either format, without judging content.

Formats (detected from the folder):

- ``dflash-audit``: ``batch_*.safetensors`` written by ``dflash-audit data``
  (:mod:`dflash_audit.data.batch`): packed ``[1, T]`` rows with ``position_ids`` and
  ``document_ids`` and the metadata ``target_layer_ids`` (speculators convention),
  ``mask_token_id``, ``num_verifier_layers``, ``hidden_size``.
- ``reference-offline``: speculators 0.9.0's offline layout (``train/data.py: ArrowDataset``,
  ``data_generation/offline.py``; written here by :mod:`dflash_audit.data.reference_format`):
  a ``datasets`` Arrow folder with ``input_ids`` / ``loss_mask`` per conversation and
  ``hidden_states/hs_{i}.safetensors`` holding ``hidden_states [len, n+1, H]`` (n target layers,
  then the last layer) and ``token_ids [len]``. One row per conversation, no positions (the
  reference's collator makes them). Layer ids come from ``dflash_audit_reference_format.json``
  when our exporter wrote it, else from ``--target-layer-ids``.

Packing conventions (positions, document ids, padding values) are not enforced here: they
are what ``check-batches`` audits and reports as findings. What makes a file unreadable, and
what ``train`` refuses in a file, raise :class:`~dflash_audit.data.errors.BatchFileError`
(exit 2) in train's words: our files go through :meth:`Batch.load` without its layout checks;
the reference format's ``input_ids`` / ``token_ids`` / ``loss_mask`` through the same
:func:`~dflash_audit.data.batch.tensor_problem` (its hidden states may be bf16 there: the
layers check judges their values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_audit.data.batch import Batch, read_batch_file, tensor_problem
from dflash_audit.data.errors import BatchFileError
from dflash_audit.data.pipeline import BATCH_GLOB
from dflash_audit.data.reference_format import HIDDEN_STATES_DIR, INFO_FILE
from dflash_audit.user_input import loads_json

OURS, REFERENCE = "dflash-audit", "reference-offline"


@dataclass
class Row:
    """One row as the files hold it (T tokens, H hidden size, n captured target layers).

    ``hidden_states`` [T, n*H] and ``last`` [T, H] keep the files' dtype; ``input_ids``,
    ``loss_mask`` int64 [T]; ``position_ids`` / ``document_ids`` int64 [T] or ``None`` (the
    reference format has neither: one conversation per row, document 0).
    """

    name: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    last: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    @property
    def documents(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each document (runs of equal ``document_ids >= 0``)."""
        if self.document_ids is None:
            return [(0, int(self.input_ids.numel()))]
        docs, bounds, start = self.document_ids.tolist(), [], None
        for t, d in enumerate(docs + [-2]):
            if start is not None and (t == len(docs) or d != docs[start]):
                bounds.append((start, t))
                start = None
            if start is None and t < len(docs) and d >= 0:
                start = t
        return bounds


@dataclass
class BatchFolder:
    """A batch folder: its format, the row names, a loader per row and what the files say
    (``target_layer_ids`` in the speculators convention, ``mask_token_id``, ...; ``None``
    where the files do not say)."""

    path: Path
    format: str
    names: list[str]
    loaders: list[Callable[[], Row]] = field(repr=False)
    all_input_ids: Callable[[], list[torch.Tensor]] = field(repr=False)
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    num_verifier_layers: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def load(self, i: int) -> Row:
        """Row ``i`` (raises :class:`BatchFileError` naming the file when unreadable)."""
        return self.loaders[i]()


def _read_safetensors(path: Path, keys: tuple[str, ...]) -> tuple[dict[str, torch.Tensor],
                                                                  dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            found = set(f.keys())
            missing = [k for k in keys if k not in found]
            if missing:
                raise BatchFileError(f"{path}: tensors {missing} are missing (found "
                                     f"{sorted(found)})")
            return {k: f.get_tensor(k) for k in keys}, dict(f.metadata() or {})
    except BatchFileError:
        raise
    except Exception as exc:  # safetensors raises several types on a damaged file
        raise BatchFileError(f"{path}: not a readable safetensors file (truncated or corrupt?):"
                             f" {type(exc).__name__}: {exc}") from exc


def _load_ours(path: Path) -> Row:
    b = Batch.load(path, layout=False)  # train's checks but the layout, which are findings
    return Row(name=path.name, input_ids=b.input_ids[0], loss_mask=b.loss_mask[0],
               hidden_states=b.hidden_states[0], last=b.verifier_last_hidden_states[0],
               position_ids=b.position_ids[0], document_ids=b.document_ids[0])


def _input_ids(path: Path) -> torch.Tensor:
    """``input_ids`` [T] of a batch file, with train's checks of that tensor."""
    t = read_batch_file(path, ("input_ids",))[0]["input_ids"]
    problem = tensor_problem("input_ids", t)
    if problem:
        raise BatchFileError(f"{path}: {problem}")
    return t[0]


def _open_ours(d: Path, files: list[Path]) -> BatchFolder:
    meta = read_batch_file(files[0], ())[1]
    ids = meta.get("target_layer_ids")
    return BatchFolder(
        path=d, format=OURS, names=[f.name for f in files],
        loaders=[(lambda f=f: _load_ours(f)) for f in files],
        all_input_ids=lambda: [_input_ids(f) for f in files],
        target_layer_ids=[int(i) for i in ids] if isinstance(ids, list) else None,
        mask_token_id=meta.get("mask_token_id"),
        num_verifier_layers=meta.get("num_verifier_layers"),
        info={k: meta.get(k) for k in ("verifier", "layer_id_convention", "mask_token_reason",
                                       "hidden_size", "seq_len")})


def _load_reference(hs_path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> Row:
    t, _ = _read_safetensors(hs_path, ("hidden_states", "token_ids"))
    hs, tok = t["hidden_states"], t["token_ids"]
    problem = tensor_problem("input_ids", tok)
    if problem:
        raise BatchFileError(f"{hs_path}: token_ids: {problem}")
    if hs.dim() != 3 or hs.shape[1] < 2 or hs.shape[0] != tok.numel():
        raise BatchFileError(f"{hs_path}: hidden_states has shape {tuple(hs.shape)}, expected "
                             f"[len={tok.numel()}, n+1 >= 2, H]")
    if not torch.equal(tok, input_ids):
        raise BatchFileError(f"{hs_path}: token_ids differ from the dataset row's input_ids "
                             "(the reference's ArrowDataset rejects this row too)")
    return Row(name=hs_path.stem, input_ids=tok, loss_mask=loss_mask,
               hidden_states=hs[:, :-1].flatten(1), last=hs[:, -1])


def _column(d: Path, key: str, rows: Any) -> list[torch.Tensor]:
    """The rows of column ``key`` (``input_ids`` / ``loss_mask``) as int64 tensors, each with
    train's checks of that tensor (:func:`tensor_problem`: int64, ids >= 0, a 0/1 mask)."""
    out = []
    for i, v in enumerate(rows):
        t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
        if t.numel() == 0:
            t = t.long()
        problem = tensor_problem(key, t)
        if problem:
            raise BatchFileError(f"{d}: row {i}: {problem}")
        out.append(t)
    return out


def _open_reference(d: Path) -> BatchFolder:
    try:
        import datasets
        data = datasets.load_from_disk(str(d))
        columns = {k: data[k] for k in ("input_ids", "loss_mask")}
    except Exception as exc:  # missing package, not an Arrow folder, missing column
        raise BatchFileError(f"{d}: not a readable reference offline dataset "
                             f"({type(exc).__name__}: {exc})") from exc
    columns = {k: _column(d, k, col) for k, col in columns.items()}
    hs_dir = d / HIDDEN_STATES_DIR
    n = len(columns["input_ids"])
    try:
        info = loads_json((d / INFO_FILE).read_text()) if (d / INFO_FILE).is_file() else {}
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise BatchFileError(f"{d / INFO_FILE}: unreadable ({exc})") from None
    ids = info.get("target_layer_ids")
    return BatchFolder(
        path=d, format=REFERENCE, names=[f"hs_{i}" for i in range(n)],
        loaders=[(lambda i=i: _load_reference(hs_dir / f"hs_{i}.safetensors",
                                              columns["input_ids"][i], columns["loss_mask"][i]))
                 for i in range(n)],
        all_input_ids=lambda: list(columns["input_ids"]),
        target_layer_ids=[int(i) for i in ids] if isinstance(ids, list) else None,
        mask_token_id=info.get("mask_token_id"), info=info)


def open_batch_folder(directory: str | Path) -> BatchFolder:
    """Detect the format of ``directory`` and open it (rows are read lazily).

    Raises:
        BatchFileError: the folder is missing, holds neither format, or its first file /
            dataset is unreadable; the message names the path and what to pass instead.
    """
    d = Path(directory)
    if not d.is_dir():
        what = ("is a file, not a batch folder; pass the folder that holds it"
                if d.exists() else "batch folder not found")
        raise BatchFileError(f"{d}: {what}; pass a folder written by "
                             "`dflash-audit data --out DIR` (or `--reference-format`), or the "
                             "reference's offline data folder")
    files = sorted(d.glob(BATCH_GLOB))
    if files:
        return _open_ours(d, files)
    if (d / HIDDEN_STATES_DIR).is_dir():
        return _open_reference(d)
    hint = " (its reference/ subfolder holds the reference format)" if (
        d / "reference" / HIDDEN_STATES_DIR).is_dir() else ""
    raise BatchFileError(f"{d}: no {BATCH_GLOB} files and no {HIDDEN_STATES_DIR}/ folder: not a "
                         f"dflash-audit or reference offline batch folder{hint}")
