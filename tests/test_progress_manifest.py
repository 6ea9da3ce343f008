"""Unit tests of the small helpers behind the error contract: progress lines without a
terminal (dflash_audit.progress), file manifests, the safetensors length check and the
writable-folder probe (dflash_audit.atomic), and OS-error messages (command_errors)."""

from __future__ import annotations

import errno
import io
import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_audit.atomic import (
    MANIFEST_NAME,
    ensure_writable_dir,
    manifest_problems,
    safetensors_problem,
    write_manifest,
)
from dflash_audit.command_errors import os_error_message
from dflash_audit.progress import LineProgress, progress_display


def test_line_progress_prints_done_total_rate_and_eta_at_the_interval():
    stream = io.StringIO()
    bar = LineProgress(stream, interval=3600.0)
    task = bar.add_task("capturing", total=4)
    bar.advance(task)
    bar.advance(task)
    assert stream.getvalue() == ""  # interval not reached, not complete
    bar.advance(task, 2)  # complete: always printed
    line = stream.getvalue().strip()
    assert line.startswith("dflash-audit: capturing: 4/4 (") and "/s" in line
    assert "ETA 0:00" in line
    bar.stop()
    assert stream.getvalue().count("\n") == 1  # final state already printed


def test_line_progress_every_update_with_zero_interval_and_resumed_start():
    stream = io.StringIO()
    with LineProgress(stream, interval=0.0) as bar:
        task = bar.add_task("train", total=10, completed=6, info="")
        bar.update(task, completed=7, info="loss 1.000")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-audit: train: 7/10 (")
    assert lines[0].endswith("| loss 1.000")


def test_progress_display_is_lines_on_a_non_tty():
    assert isinstance(progress_display(stream=io.StringIO()), LineProgress)


def test_manifest_detects_truncation_and_corruption(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "b.json").write_text("{}")
    assert manifest_problems(tmp_path) is None  # no manifest yet
    write_manifest(tmp_path)
    files = json.loads((tmp_path / MANIFEST_NAME).read_text())["files"]
    assert sorted(files) == ["a.bin", "b.json"] and files["a.bin"]["size"] == 100
    assert manifest_problems(tmp_path) == []
    (tmp_path / "a.bin").write_bytes(b"x" * 50)
    assert manifest_problems(tmp_path) == [
        "a.bin: 50 bytes, manifest says 100 (truncated or replaced)"]
    (tmp_path / "a.bin").write_bytes(b"y" * 100)
    assert manifest_problems(tmp_path) == ["a.bin: sha256 differs from the manifest (corrupt)"]
    (tmp_path / "b.json").unlink()
    assert "b.json: missing" in manifest_problems(tmp_path)


def test_a_verified_file_is_not_hashed_again_until_its_stat_changes(tmp_path, monkeypatch):
    """With a ``verified`` record, a file that matched is not hashed again by a later process
    while its size, mtime, ctime and inode are unchanged; a write of the same size whose
    mtime is set back changes its ctime and is found, as is a file replaced by another; an
    unreadable record is ignored (the file is hashed)."""
    import os
    import time

    from dflash_audit import atomic

    (tmp_path / "w").mkdir()
    weights = tmp_path / "w" / "model.bin"
    weights.write_bytes(b"x" * 4096)
    write_manifest(tmp_path / "w")
    record = tmp_path / "verified.json"
    hashed = []
    real = atomic.file_sha256
    monkeypatch.setattr(atomic, "file_sha256", lambda p: hashed.append(p) or real(p))

    def check() -> list[str]:
        atomic._verified.clear()  # another process
        hashed.clear()
        return manifest_problems(tmp_path / "w", verified=record)

    assert check() == [] and hashed == [weights] and record.is_file()
    assert check() == [] and hashed == []
    record.write_text("{not json")
    assert check() == [] and hashed == [weights]
    before = weights.stat()
    time.sleep(0.05)  # past the clock's tick: the write gets another ctime
    with weights.open("r+b") as f:
        f.write(b"y")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    assert check() == ["model.bin: sha256 differs from the manifest (corrupt)"] and hashed
    assert manifest_problems(tmp_path / "w", verified=record) == [
        "model.bin: sha256 differs from the manifest (corrupt)"]  # the same process too
    weights.write_bytes(b"x" * 4096)  # the original bytes: it matches again, hashed once
    assert check() == [] and hashed == [weights]
    assert check() == [] and hashed == []
    record.unlink()  # a read-only cache (EROFS even for the cleanup's unlink): not recorded

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(type(record), "write_text", read_only)
    monkeypatch.setattr(type(record), "unlink", read_only)
    assert check() == [] and hashed == [weights] and not record.exists()


def test_safetensors_length_check(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(64)}, path)
    assert safetensors_problem(path) is None
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    assert "truncated" in safetensors_problem(path)
    path.write_bytes(data + b"\0")
    assert "trailing bytes" in safetensors_problem(path)
    path.write_bytes(data[:5])
    assert "too short" in safetensors_problem(path)


def test_ensure_writable_dir_refuses_a_file_and_a_path_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep")
    with pytest.raises(OSError) as exc:
        ensure_writable_dir(f)
    assert exc.value.errno == errno.ENOTDIR and f.read_text() == "keep"
    with pytest.raises(OSError) as exc:
        ensure_writable_dir(f / "sub")
    assert exc.value.errno == errno.ENOTDIR
    assert "not a folder" in os_error_message(exc.value) and str(f) in os_error_message(exc.value)
    assert ensure_writable_dir(tmp_path / "new" / "deep").is_dir()
    assert list((tmp_path / "new" / "deep").iterdir()) == []  # the probe is gone


def test_os_error_message_names_path_and_fix():
    msg = os_error_message(OSError(errno.ENOSPC, "No space left on device", "/x/ckpt"))
    assert msg == ("/x/ckpt: No space left on device (the disk is full: free space or choose "
                   "a folder on another disk)")
    msg = os_error_message(OSError(errno.EROFS, "Read-only file system", "/ro"))
    assert msg.startswith("/ro: Read-only file system (read-only file system")


@pytest.mark.parametrize("files", [{"model.safetensors": 5}, [1, 2], {"model.safetensors":
                                   {"size": "big", "sha256": "x"}}, {"../x": {"size": 1,
                                                                               "sha256": "y"}}])
def test_a_malformed_manifest_is_named_not_a_traceback(tmp_path, files):
    """One reader for checkpoints and caches: entries that are numbers (or any other form)
    are one named problem, so a checkpoint is refused (exit 2) and a cache rebuilt."""
    from dflash_audit.atomic import MANIFEST_NAME, ManifestError, manifest_problems, read_manifest
    from dflash_audit.model.checkpoint import CheckpointError, validate_checkpoint

    (tmp_path / "model.safetensors").write_bytes(b"0" * 5)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"version": 1, "files": files}))
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)
    (problem,) = manifest_problems(tmp_path)
    assert problem.startswith("malformed manifest:") and MANIFEST_NAME in problem
    with pytest.raises(CheckpointError, match="malformed manifest"):
        validate_checkpoint(tmp_path, 4)


def test_a_stage_without_a_bar_says_it_is_running_only_when_it_runs_long(monkeypatch, capsys):
    import time

    import dflash_audit.audit.progress as stages

    monkeypatch.setattr(stages, "STILL_RUNNING_S", 0.05)
    with stages.Stages(enabled=False) as st:
        with st.stage("quick", "a quick stage"):
            pass
        with st.stage("slow", "resolving the reference"):
            time.sleep(0.5)
    time.sleep(0.1)  # a cancelled notice never prints late
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("dflash-audit: a quick stage: ")
    assert lines[1] == "dflash-audit: resolving the reference ..."
    assert lines[2].startswith("dflash-audit: resolving the reference: ") and len(lines) == 3
