"""Orchestrate the data pipeline: verifier + conversations -> packed batches with captured
hidden states; batch directories (the ``dflash-audit data`` command is
:mod:`dflash_audit.data.command`).

``build_batches`` is deterministic for a seed: conversations are shuffled with
``random.Random(seed)``, tokenized lazily and packed densely (``pack_fill``: next-fit, the
conversation that overflows a row is truncated to fill it) until ``rows`` rows are full,
then each row is captured (one verifier forward per document).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_audit.data.batch import Batch
from dflash_audit.data.capture import CONVENTION, capture_row
from dflash_audit.data.conversations import (
    Conversation,
    ConversationSet,
    load_conversations,
)
from dflash_audit.data.errors import BatchFileError, DataError
from dflash_audit.data.pack import PackedRow, pack_fill
from dflash_audit.data.tokenize import (
    MaskTokenChoice,
    TokenizedConversation,
    choose_mask_token_id,
    end_of_turn_ids,
    tokenize_conversation,
)
from dflash_audit.data.verifier import Verifier, load_verifier
from dflash_audit.model.layer_ids import resolve_target_layer_ids

BATCH_GLOB = "batch_*.safetensors"
MANIFEST = "manifest.json"
REFERENCE_SUBDIR = "reference"
REGEN_CHUNK = 32  # conversations regenerated together (one generate batch per turn index)


@dataclass
class _Stats:
    available: int = 0
    skipped_no_assistant: int = 0
    dropped_no_supervised: int = 0
    truncated: int = 0
    used: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"conversations_available": self.available,
                "skipped_no_assistant_turn": self.skipped_no_assistant,
                "dropped_no_supervised_token": self.dropped_no_supervised,
                "truncated_documents": self.truncated, "documents_packed": self.used}


def describe_data_stats(stats: dict[str, int], source: str = "the data") -> str:
    """One sentence on where a run's conversations went, for a person: ``stats`` is a batch's
    ``metadata["data_stats"]`` (:meth:`_Stats.to_dict`). Packing stops once the rows are full,
    so conversations after that point were not reached (not rejected).

    Example: "packed 41 of the 3,520 conversations in chitchat with an assistant turn (3,648
    more have none and were skipped; 2 dropped: no supervised token within seq_len; 3
    documents cut at seq_len; the other 3,477 were not needed to fill the rows)"."""
    available = stats.get("conversations_available", 0)
    used = stats.get("documents_packed", 0)
    dropped = stats.get("dropped_no_supervised_token", 0)
    parts = []
    if stats.get("skipped_no_assistant_turn", 0):
        parts.append(f"{stats['skipped_no_assistant_turn']:,} more have none and were skipped")
    if dropped:
        parts.append(f"{dropped:,} dropped: no supervised token within seq_len")
    if stats.get("truncated_documents", 0):
        parts.append(f"{stats['truncated_documents']:,} documents cut at seq_len")
    if available - used - dropped > 0:
        parts.append(f"the other {available - used - dropped:,} were not needed to fill the "
                     "rows")
    more = f" ({'; '.join(parts)})" if parts else ""
    return (f"packed {used:,} of the {available:,} conversations in {source} with an "
            f"assistant turn{more}")


def _progress(enabled: bool) -> Any:
    """A rich progress bar on a terminal, progress lines every ~10 s on a non-TTY stderr
    (:func:`dflash_audit.progress.progress_display`), or a no-op stand-in."""
    if not enabled:
        return nullcontext(None)
    from dflash_audit.progress import progress_display

    return progress_display()


def _conversations(verifier: Verifier, conversations: Sequence[Conversation], seq_len: int,
                   regenerate: bool, max_new_tokens: int, max_turns: int | None,
                   progress: Any
                   ) -> Iterator[Conversation]:
    """Conversations in the given order; with ``regenerate``, chunk by chunk as they are
    needed, assistant turns replaced by the verifier's own greedy replies."""
    if not regenerate:
        yield from conversations
        return
    from dflash_audit.data.regenerate import regenerate_conversations

    # no total: the rows fill after an unknown share of the conversations (a total of all of
    # them made the ETA hours long); the rows' own bar below gives the remaining time
    task = progress.add_task(f"regenerating replies (conversations done; of at most "
                             f"{len(conversations):,}, until the rows are full)"
                             ) if progress else None
    for begin in range(0, len(conversations), REGEN_CHUNK):
        yield from regenerate_conversations(
            verifier, conversations[begin:begin + REGEN_CHUNK], max_new_tokens=max_new_tokens,
            max_turns=max_turns,
            max_context=seq_len,
            progress=(lambda n: progress.advance(task, n)) if task is not None else None)


def _check_args(seq_len: int, rows: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 16:
        raise DataError(f"--seq-len must be an integer >= 16, got {seq_len!r}")
    if not isinstance(rows, int) or rows < 1:
        raise DataError(f"--rows must be a positive integer, got {rows!r}")


def _metadata(verifier: Verifier, row: PackedRow, layer_ids: list[int], mask: MaskTokenChoice,
              data: str, seed: int, regen: dict[str, Any] | None) -> dict[str, Any]:
    tok = verifier.tokenizer
    return {
        "verifier": verifier.identity.to_dict(),
        "target_layer_ids": layer_ids,
        "layer_id_convention": CONVENTION,
        "tokenizer": {"name": verifier.identity.name, "class": type(tok).__name__,
                      "len": len(tok)},
        "seq_len": row.seq_len,
        "hidden_size": verifier.hidden_size,
        "num_verifier_layers": verifier.num_layers,
        "mask_token_id": mask.id,
        "mask_token_reason": mask.reason,
        "num_documents": len(row.documents),
        "documents": [{"source": d.source, "length": len(d), "truncated": d.truncated}
                      for d in row.documents],
        "data": data,
        "seed": seed,
        "regenerate": regen,
    }


def build_batches(verifier: str | Verifier, data: str, seq_len: int, rows: int,
                  target_layer_ids: None | str | Sequence[int] = None, zlab_ids: bool = False,
                  mask_token_id: int | None = None, seed: int = 0, progress: bool = True,
                  regenerate: bool = False, max_new_tokens: int = 64,
                  max_turns: int | None = None,
                  conversations: ConversationSet | None = None) -> list[Batch]:
    """Build ``rows`` packed batches from real conversations, deterministic for ``seed``.

    Args:
        verifier: a spec (local HF folder or ``smollm2-135m``) or a loaded :class:`Verifier`.
        data: ``chitchat`` or a ``.jsonl`` / ``.json`` file (ignored if ``conversations``).
        seq_len: T, tokens per packed row; longer conversations are truncated.
        rows: number of packed rows (batches) wanted; fewer if the data runs out.
        target_layer_ids: ``None``/``"zlab"`` (5 evenly spaced), ``"speculators"``
            (``[2, N//2, N-3]``), ``"1,5,9"`` or a list of ints (our convention).
        zlab_ids: read explicit ids as z-lab ids (ours = z-lab + 1).
        mask_token_id: explicit mask token (see :func:`choose_mask_token_id`).
        seed: shuffles the conversation order.
        progress: show a rich progress bar on stderr.
        regenerate: replace assistant turns by the verifier's greedy replies (cached).
        max_new_tokens: generation bound per reply when regenerating.
        max_turns: when regenerating, keep only the first ``max_turns`` assistant turns.
        conversations: already loaded conversations (tests, callers with their own data).

    Returns:
        One :class:`Batch` per packed row; each Batch's metadata includes ``data_stats``
        (conversations skipped for no assistant turn, dropped without supervised token...).

    Raises:
        DataError (or a subclass): bad arguments, data, verifier, layer ids or mask token;
            or no conversation left with a supervised token.
    """
    _check_args(seq_len, rows)
    convs = conversations if conversations is not None else load_conversations(data)
    if isinstance(verifier, str):
        verifier = load_verifier(verifier)
    layer_ids = resolve_target_layer_ids(verifier.num_layers, target_layer_ids, zlab_ids)
    mask = choose_mask_token_id(verifier.tokenizer, verifier.embedding_rows, mask_token_id)
    stats = _Stats(available=len(convs), skipped_no_assistant=convs.skipped_no_assistant)
    order = list(range(len(convs.conversations)))
    random.Random(seed).shuffle(order)
    ordered = [convs.conversations[i] for i in order]
    regen = {"max_new_tokens": max_new_tokens, "max_turns": max_turns,
             "decoding": "greedy"} if regenerate else None

    packed: list[PackedRow] = []
    with _progress(progress) as bar:
        pack_task = bar.add_task("tokenizing + packing rows", total=rows) if bar else None
        eot = end_of_turn_ids(verifier.tokenizer,
                              getattr(verifier.model, "generation_config", None))

        def tokenize(conv: Conversation, budget: int) -> TokenizedConversation | None:
            doc = tokenize_conversation(verifier.tokenizer, conv.messages, budget,
                                        source=conv.source, eot_ids=eot)
            if doc is None and budget == seq_len:
                stats.dropped_no_supervised += 1
            return doc

        convs_in_order = _conversations(verifier, ordered, seq_len, regenerate, max_new_tokens,
                                        max_turns, bar)
        for row in pack_fill(convs_in_order, tokenize, seq_len):
            packed.append(row)
            if bar:
                bar.advance(pack_task)
            if len(packed) == rows:
                break
        if not packed:
            raise DataError(f"no conversation in {convs.source!r} has a supervised assistant "
                            f"token within seq_len {seq_len} ({stats.to_dict()})")
        stats.used = sum(len(r.documents) for r in packed)
        stats.truncated = sum(d.truncated for r in packed for d in r.documents)
        capture_task = bar.add_task("capturing hidden states", total=len(packed)) if bar else None
        batches = []
        for row in packed:
            hidden, last = capture_row(verifier.model, row.input_ids, row.document_ids,
                                       layer_ids)
            meta = _metadata(verifier, row, layer_ids, mask, convs.source, seed, regen)
            batches.append(Batch(hidden_states=hidden, verifier_last_hidden_states=last,
                                 input_ids=row.input_ids, loss_mask=row.loss_mask,
                                 position_ids=row.position_ids, document_ids=row.document_ids,
                                 metadata=meta))
            if bar:
                bar.advance(capture_task)
    for b in batches:
        b.metadata["data_stats"] = stats.to_dict()
    return batches


def write_batches(batches: Sequence[Batch], out_dir: str | Path,
                  reference_format: bool = False) -> list[Path]:
    """Write ``batch_00000.safetensors``... and ``manifest.json`` into ``out_dir``.

    Older ``batch_*.safetensors`` files in ``out_dir`` are removed first, so a directory
    never mixes two builds. With ``reference_format`` the documents are also written in the
    reference's offline format under ``out_dir/reference``.

    Returns:
        The batch file paths, in order.

    Raises:
        BatchFileError: a batch is invalid.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(BATCH_GLOB):
        old.unlink()
    paths = [b.save(out / f"batch_{i:05d}.safetensors") for i, b in enumerate(batches)]
    first = batches[0].metadata if batches else {}
    manifest = {"files": [p.name for p in paths],
                **{k: first.get(k) for k in ("verifier", "target_layer_ids",
                                             "layer_id_convention", "seq_len", "mask_token_id",
                                             "mask_token_reason", "data", "seed", "regenerate",
                                             "data_stats")}}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if reference_format:
        from dflash_audit.data.reference_format import write_reference_offline
        write_reference_offline(batches, out / REFERENCE_SUBDIR)
    return paths


def publish_batches(batches: Sequence[Batch], out: Path, reference_format: bool = False
                    ) -> list[Path]:
    """:func:`write_batches` into a hidden sibling of ``out`` first, then published: renamed to
    ``out`` when it does not exist, else moved in (old batch files removed, the manifest
    last). An interrupted write (Ctrl-C, SIGTERM, a full disk) leaves ``out`` as it was and
    no partial folder; after a kill -9 the next run removes the stale sibling.

    Returns:
        The published batch file paths, in order.
    """
    out = Path(out)
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            shutil.rmtree(stale, ignore_errors=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        names = [p.name for p in write_batches(batches, staging, reference_format)]
        if not out.exists():
            os.replace(staging, out)
            return [out / n for n in names]
        for old in out.glob(BATCH_GLOB):
            old.unlink()
        for item in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST):
            target = out / item.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
        return [out / n for n in names]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_batches(directory: str | Path) -> list[Batch]:
    """Load and validate every ``batch_*.safetensors`` of a directory, in name order.

    Raises:
        BatchFileError: the directory is missing or has no batch file, or a file is bad.
    """
    d = Path(directory)
    if not d.is_dir():
        raise BatchFileError(f"{d}: batch directory not found")
    files = sorted(d.glob(BATCH_GLOB))
    if not files:
        raise BatchFileError(f"{d}: no {BATCH_GLOB} files (run `dflash-audit data --out {d}`)")
    return [Batch.load(f) for f in files]
