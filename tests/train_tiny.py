"""Tiny, self-contained training fixtures (no download): a character-level ChatML tokenizer, a
4-layer random Llama verifier saved as a HF folder, synthetic conversations, batch files, a
profile and a passing audit report with the right fingerprints.

Used by tests/test_train_*.py (imported as a plain module; pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
WORDS = ("hello how are you today fine thanks what about the weather it is sunny and warm do "
         "like music yes I play guitar sometimes nice we should meet soon sure see you").split()
TARGET_LAYERS = [1, 2, 3]  # of a 4-layer verifier, speculators convention

PROFILE_TOML = """\
name = "tiny"
description = "tiny CPU test profile"
block_size = 4
gamma = 4.0
loss = "kl_div"
weighting = "fixed-exp-decay"
dpace_alpha = 0.5
max_anchors = 6
target_layers = [1, 2, 3]
num_draft_layers = 1
layer_layout = "full"
sliding_window_non_causal = false
sample_from_anchor = false
optimizer = "adamw"
"""

# A reference identity as resolve_reference would return it (no clone needed in unit tests).
REFERENCE = {"kind": "sdist", "spec": "speculators==0.9.0", "source_dir": "/nonexistent",
             "short_id": "ad5e21eedc89", "resolved_at": "2026-01-01T00:00:00Z", "url": None,
             "ref": "0.9.0", "ref_kind": None, "commit": None, "commit_date": None,
             "describe": None, "sdist_sha256": "ad5e21eedc89f95096d92ceeccb794df88e2439461"
             "5f5e8f02957485aea3d8cf", "sdist_filename": "speculators-0.9.0.tar.gz",
             "version": "0.9.0", "dirty": None, "mirror_fetched_at": None}


def make_tokenizer():
    """Character-level ChatML tokenizer (printable ASCII + newline + 4 specials)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def verifier_config(tokenizer=None):
    """The tiny verifier's LlamaConfig (4 layers, H=32)."""
    from transformers import LlamaConfig

    tokenizer = tokenizer or make_tokenizer()
    return LlamaConfig(vocab_size=len(tokenizer) + 2, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, rope_theta=10000.0,
                       tie_word_embeddings=False, eos_token_id=2, pad_token_id=3,
                       bos_token_id=None)


def make_verifier(folder: Path, seed: int = 0) -> Path:
    """A random 4-layer Llama (H=32) + tokenizer saved as a HF folder (safetensors)."""
    from transformers import LlamaForCausalLM

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = verifier_config(tokenizer)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits so greedy decoding is far from ties
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def conversations(n: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` short synthetic user/assistant conversations (2-3 exchanges)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for k in range(2 * rng.randint(2, 3)):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            turns.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
        out.append({"messages": turns})
    return out


def write_conversations(path: Path, n: int = 60, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(n, seed)))
    return path


def write_profile(path: Path, **changes: Any) -> Path:
    text = PROFILE_TOML
    for key, value in changes.items():
        lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key} =")]
        text = "\n".join(lines) + f"\n{key} = {json.dumps(value)}\n"
    path.write_text(text)
    return path


def write_canary(folder: Path, profile_path: Path, verifier_dir: Path, batches: Path,
                 candidate_spec: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Record a canary into ``folder/canary`` as compare does after a PASS: the first batch row
    at the drafter config train builds, on the weights train's model starts from, run by the
    candidate (in this process); returns the report's ``candidate.canary`` entry."""
    import tempfile
    from types import SimpleNamespace

    from dflash_audit.audit.case import Case
    from dflash_audit.audit.sides.canary import publish_canary, stage_canary
    from dflash_audit.audit.sides.run_sides import run_candidate
    from dflash_audit.candidate import load_candidate
    from dflash_audit.data.batch import Batch
    from dflash_audit.data.verifier import load_verifier
    from dflash_audit.model.anchors import select_anchors
    from dflash_audit.profile import Profile
    from dflash_audit.train.setup import build_drafter

    profile = Profile.load(str(profile_path))
    verifier = load_verifier(str(verifier_dir))
    batch = Batch.load(sorted(Path(batches).glob("batch_*.safetensors"))[0])
    config = profile.to_drafter_config(verifier.model.config, batch.mask_token_id,
                                       batch.target_layer_ids)
    candidate = load_candidate(candidate_spec)
    model = build_drafter(candidate, config, verifier.model, seed)
    anchors = select_anchors(batch.loss_mask, profile.max_anchors, config.block_size,
                             torch.Generator().manual_seed(seed))
    inputs = {**batch.tensors(), "anchor_positions": anchors[0], "anchor_valid": anchors[1]}
    case = Case(name="real-00-canary", config=config, loss=profile.loss_spec(), inputs=inputs,
                weights={k: v.detach().clone() for k, v in model.state_dict().items()})
    out, failure = run_candidate(candidate, case)
    assert failure is None, failure.summary
    with tempfile.TemporaryDirectory() as tmp:
        case.write(Path(tmp) / "cases")
        out.write((Path(tmp) / "outputs" / case.name).mkdir(parents=True) or
                  Path(tmp) / "outputs" / case.name)
        entry = stage_canary([SimpleNamespace(case=case, kind="real")], Path(tmp) / "cases",
                             Path(tmp) / "outputs", Path(tmp) / "staging")
        publish_canary(Path(tmp) / "staging", folder)
    return entry


def write_report(reports_dir: Path, profile_path: Path, candidate_spec: str | None = None,
                 verdict: str = "pass", reference: dict[str, Any] | None = None,
                 name: str = "20260101T000000Z-ad5e21eedc89",
                 canary_from: tuple[Path, Path] | None = None, sign: bool = True,
                 **overrides: Any) -> Path:
    """A report.json as `dflash-audit compare` writes it (schema v1), fingerprints computed
    for the candidate/profile/reference given, covering the tiny verifier, signed with this
    machine's report key (``sign``); with ``canary_from`` = (verifier folder, batches folder)
    a real canary (:func:`write_canary`), else a placeholder entry (enough for the gate's
    report lookup, refused by train's canary run); ``overrides`` replace top-level fields."""
    from dflash_audit.candidate import load_candidate
    from dflash_audit.profile import Profile
    from dflash_audit.report.fingerprint import (
        candidate_fingerprint,
        report_fingerprint,
        sign_report,
        verifier_fingerprint,
    )

    profile = Profile.load(str(profile_path))
    reference = dict(reference or REFERENCE)
    cand = candidate_fingerprint(load_candidate(candidate_spec), profile.fingerprint(),
                                 candidate_spec)
    folder = reports_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    cand["canary"] = write_canary(folder, profile_path, *canary_from, candidate_spec) \
        if canary_from else {"case": "placeholder", "folder": "canary", "files": {}}
    report = {"schema_version": 1, "verdict": verdict, "exit_code": 0 if verdict == "pass" else 1,
              "created_at": "2026-01-01T00:00:00Z", "reference": reference,
              "candidate": {"name": "dflash-audit drafter", "spec": candidate_spec, **cand},
              "profile": {"name": profile.name, "source": profile.source,
                          "fingerprint": profile.fingerprint(), "fields": profile.to_dict()},
              "checks": [],
              "verifiers": {verifier_fingerprint(verifier_config()): {"name": "tiny"}}}
    report["fingerprint"] = report_fingerprint(verdict, reference, cand["fingerprint"],
                                               profile.fingerprint(), list(report["verifiers"]),
                                               cand["canary"])
    report.update(overrides)
    (folder / "report.json").write_text(json.dumps(sign_report(report) if sign else report,
                                                   indent=1))
    return folder / "report.json"


def write_batches(verifier_dir: Path, conversations_path: Path, out: Path, rows: int = 4,
                  seq_len: int = 96) -> Path:
    """Batch files from the tiny verifier via the data pipeline."""
    from dflash_audit.data.pipeline import build_batches
    from dflash_audit.data.pipeline import write_batches as write

    batches = build_batches(str(verifier_dir), str(conversations_path), seq_len, rows,
                            target_layer_ids=TARGET_LAYERS, progress=False)
    write(batches, out)
    return out


def setup_run(tmp: Path, rows: int = 4, seq_len: int = 96, n_conversations: int = 60,
              **profile_changes: Any) -> dict[str, Path]:
    """Everything a tiny training run needs under ``tmp``: verifier, conversations, batches,
    profile, reports/ with a passing report."""
    verifier = make_verifier(tmp / "verifier")
    convs = write_conversations(tmp / "conversations.jsonl", n_conversations)
    batches = write_batches(verifier, convs, tmp / "batches", rows=rows, seq_len=seq_len)
    profile = write_profile(tmp / "tiny.toml", **profile_changes)
    write_report(tmp / "reports", profile, canary_from=(verifier, batches))
    return {"verifier": verifier, "conversations": convs, "batches": batches,
            "profile": profile, "reports": tmp / "reports"}


def tiny_config(paths: dict[str, Path], out: Path, **changes: Any):
    """A TrainConfig for :func:`setup_run`'s files (offline, no progress bar)."""
    from dflash_audit.train.loop import TrainConfig

    base = dict(out=str(out), verifier=str(paths["verifier"]), batches=str(paths["batches"]),
                profile=str(paths["profile"]), reports_dir=str(paths["reports"]), steps=6,
                lr=3e-3, warmup_steps=2, save_every=100, eval_at_end=False, progress=False,
                tensorboard=False, eval_prompts=4, eval_max_new_tokens=12)
    base.update(changes)
    return TrainConfig(**base)
