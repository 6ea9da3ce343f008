"""Broken batches: ``loss_mask`` on the user turns instead of the assistant's (ChatML: the
tokens after ``<|im_start|>user\\n`` up to and including ``<|im_end|>``).
``check-batches`` names it ``user turns``."""

from __future__ import annotations

from _batches import main, read_folder, write_folder
from transformers import AutoTokenizer

from dflash_audit.data.verifier import resolve_verifier_path


def user_mask(ids: list[int], start: int, header: list[int], end: int) -> list[int]:
    """1 on user content + its end-of-turn token, found by the ChatML markers."""
    mask, t = [0] * len(ids), 0
    while t < len(ids):
        if ids[t] == start and ids[t + 1:t + 1 + len(header)] == header:
            t += 1 + len(header)
            while t < len(ids):
                mask[t] = 1
                if ids[t] == end:
                    break
                t += 1
        t += 1
    return mask


def make(src, out, verifier="smollm2-135m"):
    tok = verifier.tokenizer if hasattr(verifier, "tokenizer") else AutoTokenizer.from_pretrained(
        resolve_verifier_path(verifier)[1])
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tok("user\n", add_special_tokens=False)["input_ids"]
    rows = read_folder(src)
    for _, t, _ in rows:
        mask = user_mask(t["input_ids"][0].tolist(), start, header, end)
        t["loss_mask"][0] = t["loss_mask"].new_tensor(mask)
        t["loss_mask"][t["document_ids"] < 0] = 0
    return write_folder(rows, out)


if __name__ == "__main__":
    main(make, __doc__)
