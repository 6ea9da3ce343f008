"""The ``dflash-audit data`` command: its options, the checks of ``--out`` before any work,
and SIGTERM handled as Ctrl-C; the work is :func:`dflash_audit.data.pipeline.build_batches`
and :func:`~dflash_audit.data.pipeline.publish_batches` (imported when the command runs, so
``--help`` and usage errors need no torch)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer


def _existing_parent(path: Path) -> Path:
    """``path`` when it exists, else its nearest existing ancestor (nothing is created)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block (main thread only), so cleanup runs
    as it does for Ctrl-C."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def data_command(
    out: Annotated[Path, typer.Option(help="Output directory (batch_*.safetensors).")],
    verifier: Annotated[str, typer.Option(
        help="Local HF causal-LM folder, or the built-in 'smollm2-135m'.")] = "smollm2-135m",
    data: Annotated[str, typer.Option(
        help="'chitchat', or a .jsonl file ({\"messages\": [...]} or ShareGPT per line).")
    ] = "chitchat",
    seq_len: Annotated[int, typer.Option(help="T, tokens per packed row.", min=16)] = 1024,
    rows: Annotated[int, typer.Option(help="Number of packed rows (batch files).", min=1)
                    ] = 16,
    target_layers: Annotated[str, typer.Option(
        help="'zlab' (5 evenly spaced), 'speculators' ([2, N//2, N-3]) or ids like 1,5,9.")
    ] = "zlab",
    zlab_ids: Annotated[bool, typer.Option(
        help="Read explicit --target-layers as z-lab ids (ours = z-lab + 1).")] = False,
    mask_token_id: Annotated[int | None, typer.Option(
        help="Mask token id (default: tokenizer mask token, spare row, reserved token).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Shuffles the conversation order.")] = 0,
    regenerate: Annotated[bool, typer.Option(
        help="Replace assistant turns by the verifier's own greedy replies (cached; slow "
             "on CPU).")] = False,
    max_new_tokens: Annotated[int, typer.Option(
        help="Generation bound per reply with --regenerate.")] = 64,
    max_turns: Annotated[int | None, typer.Option(
        help="With --regenerate: keep only the first N assistant turns of each conversation "
             "(1 is about 4x faster on CPU, and matches the first-turn evaluation prompts).",
        min=1)] = None,
    reference_format: Annotated[bool, typer.Option(
        help="Also write speculators' offline format (hs_{i}.safetensors) to OUT/reference.")
    ] = False,
) -> None:
    """Build packed batches with captured verifier hidden states and write them to --out.
    Exit codes: 0 written; 2 bad input or environment (options, data, verifier, an
    unwritable or full --out), checked before the capture where possible."""
    from rich.console import Console

    from dflash_audit.atomic import ensure_writable_dir

    console = Console(stderr=True)
    parent = _existing_parent(out)  # checked before minutes of capture; nothing created
    if parent != out.expanduser().absolute() and not parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"--out {out}: {parent} is not a folder",
                                 str(parent))
    ensure_writable_dir(parent)
    from dflash_audit.data.pipeline import (  # torch: not for --help
        build_batches,
        describe_data_stats,
        publish_batches,
    )

    with _terminated_as_interrupt():
        batches = build_batches(verifier, data, seq_len, rows, target_layer_ids=target_layers,
                                zlab_ids=zlab_ids, mask_token_id=mask_token_id, seed=seed,
                                progress=True, regenerate=regenerate,
                                max_new_tokens=max_new_tokens, max_turns=max_turns)
        paths = publish_batches(batches, out, reference_format=reference_format)
    meta = batches[0].metadata
    tokens = sum(int(b.loss_mask.sum()) for b in batches)
    console.print(
        f"wrote {len(paths)} batches to {out} (T={meta['seq_len']}, "
        f"target_layer_ids={meta['target_layer_ids']}, mask_token_id={meta['mask_token_id']} "
        f"({meta['mask_token_reason']}), {tokens} supervised tokens)", highlight=False,
        markup=False)
    console.print(describe_data_stats(meta["data_stats"], meta.get("data") or data),
                  highlight=False, markup=False)
    if len(batches) < rows:
        console.print(f"warning: the data filled only {len(batches)} of {rows} rows",
                      markup=False)
