"""Signed records under attack (dflash_audit/audit/sides/signed_records.py): a record planted
or swapped after the audit started without a sandbox is never trusted (the reference's outputs
and the cases alike: the candidate's process is started before either is read); a FIFO, a huge
file or an unreadable record is a record not trusted, never a hang, a memory blow-up or a
traceback; a store on a full disk leaves no record a later read trusts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from dflash_audit.audit.sides import reference_records as rc
from dflash_audit.audit.sides import signed_records as sr
from dflash_audit.audit.sides.reference_cache import ReferenceCache


#: Each test's records are not removed under it by another worker's unsandboxed audit.
pytestmark = pytest.mark.usefixtures("records_kept")


KEY = "a" * 64
FILES = {"outputs.json": b"{}", "outputs.safetensors": b"reference"}


def stored(root: Path, report_key: bytes, key: str = KEY, data: bytes = b"reference") -> Path:
    sr.write_signed(root / key, key, {**FILES, "outputs.safetensors": data}, {}, report_key)
    return root / key


def within(seconds: float, fn, *args):
    """``fn(*args)``'s value; fails the test (instead of hanging it) past ``seconds``."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"{fn.__name__} still blocked after {seconds} s"
    return box[0]


def test_a_reference_record_planted_after_an_unsandboxed_audit_started_is_not_read(tmp_path):
    # the candidate's process starts (and runs its import) before the reference's records are
    # read: one it signs then (it can read the key without a sandbox) must not be trusted
    key = os.urandom(32)
    root = tmp_path / "records"
    kept = stored(root, key, "b" * 64)  # there before the audit started: trusted
    watch = sr.RecordsWatch([root])  # taken before any candidate code runs
    planted = stored(root, key, KEY, b"forged")  # "the candidate"
    cache = ReferenceCache(read=True, report_key=key, root=root, watch=watch)
    record, why = rc.read_record(planted, KEY, key, False, watch=cache.watch)
    assert record is None and "changed after this audit started" in why
    record, why = rc.read_record(kept, "b" * 64, key, False, watch=cache.watch)
    assert why == "" and record.files["outputs.safetensors"] == b"reference"
    # replaced in place (same key, a new signed file) is the same as planted
    stored(root, key, "b" * 64, b"forged")
    assert "changed after" in rc.read_record(kept, "b" * 64, key, False, watch=watch)[1]
    # and what changed is removed after the candidate's run (never reused by a later audit)
    assert watch.discard_changed() == ["a" * 64, "b" * 64] and not any(root.iterdir())


def test_a_record_swapped_while_it_is_read_is_not_trusted(tmp_path, monkeypatch):
    key = os.urandom(32)
    root = tmp_path / "records"
    folder = stored(root, key)
    forged = stored(tmp_path / "forged", key, KEY, b"forged")
    watch = sr.RecordsWatch([root])
    real_read = sr.read_regular

    def swapping(path: Path, limit=None):  # the candidate renames a forged record in for
        if path.name == sr.RECORD_FILE:     # the time it is read, then puts the original back
            os.rename(folder, tmp_path / "aside")
            os.rename(forged, folder)
        data = real_read(path, limit)
        if path.name == "outputs.safetensors":  # the last file read
            os.rename(folder, forged)
            os.rename(tmp_path / "aside", folder)
        return data

    monkeypatch.setattr(sr, "read_regular", swapping)
    found, why = sr.read_signed(folder, KEY, key, set(FILES), watch=watch)
    assert found is None and "changed after this audit started" in why


def test_a_fifo_a_huge_file_or_a_link_in_a_record_is_refused_not_waited_on(tmp_path):
    key = os.urandom(32)
    folder = stored(tmp_path, key)
    good = sr.read_signed(folder, KEY, key, set(FILES))
    assert good[1] == ""
    os.unlink(folder / "outputs.safetensors")
    os.mkfifo(folder / "outputs.safetensors")  # open() of a FIFO waits for a writer
    found, why = within(20, sr.read_signed, folder, KEY, key, set(FILES))
    assert found is None and "not a regular file" in why
    os.unlink(folder / sr.RECORD_FILE)
    os.mkfifo(folder / sr.RECORD_FILE)
    found, why = within(20, sr.read_signed, folder, KEY, key, set(FILES))
    assert found is None and "not a regular file" in why
    # a sparse file far past any record's size: refused from its size, never read
    folder = stored(tmp_path, key)
    with open(folder / "outputs.safetensors", "wb") as f:
        f.truncate(sr.MAX_FILE_BYTES + 1)
    found, why = within(20, sr.read_signed, folder, KEY, key, set(FILES))
    assert found is None and "larger than" in why
    # a record folder that is a FIFO, a file or a link: not trusted, removed
    for plant in ("fifo", "file", "link"):
        target = tmp_path / "r" / KEY
        target.parent.mkdir(exist_ok=True)
        if plant == "fifo":
            os.mkfifo(target)
        elif plant == "file":
            target.write_bytes(b"x" * 10)
        else:
            target.symlink_to(stored(tmp_path / "elsewhere", key))
        files, why = within(20, sr.read_or_drop, target, KEY, key, set(FILES),
                            sr.REFERENCE_OUTPUTS)
        assert files is None and why and not os.path.lexists(target), plant


def test_a_store_on_a_full_disk_leaves_nothing_a_read_trusts(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        key = os.urandom(32)
        stored(mnt, key, "b" * 64)  # a record that fits
        with pytest.raises(OSError):
            stored(mnt, key, KEY, os.urandom(2 << 20))
        assert sr.read_signed(mnt / KEY, KEY, key, set(FILES)) == (None, "")
        assert sr.read_signed(mnt / ("b" * 64), "b" * 64, key, set(FILES))[1] == ""
        assert sorted(p.name for p in mnt.iterdir()) == ["b" * 64]  # no half-written folder
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to an ordinary user: needs root")
def test_unreadable_records_as_an_ordinary_user_are_no_traceback(tmp_path):
    # chmod 000 does not stop root: the reads run as nobody on a cache of its own
    key = os.urandom(32)
    tmp_path = Path(tempfile.mkdtemp(prefix="dflash-unreadable-"))  # pytest's is root's only
    root = tmp_path / "records"
    stored(root, key, "b" * 64)
    stored(root, key, "c" * 64)
    os.chmod(root / ("b" * 64) / "outputs.json", 0)
    os.chmod(root / ("c" * 64), 0)
    shutil.chown(tmp_path, "nobody")
    for path in [root, *root.iterdir(), *(root / ("b" * 64)).iterdir()]:
        os.lchown(path, 65534, 65534)
    (tmp_path / "key").write_bytes(key)
    os.lchown(tmp_path / "key", 65534, 65534)
    script = (
        "import sys; from pathlib import Path\n"
        "from dflash_audit.audit.sides import signed_records as sr\n"
        "root = Path(sys.argv[1]); key = (root.parent / 'key').read_bytes()\n"
        "watch = sr.RecordsWatch([root])\n"
        "for k in ('b' * 64, 'c' * 64):\n"
        "    files, why = sr.read_or_drop(root / k, k, key, {'outputs.json', "
        "'outputs.safetensors'}, sr.REFERENCE_OUTPUTS, watch=watch)\n"
        "    print(files is None, 'unreadable' in why)\n"
        "sr.prune(root, 0); print(watch.discard_changed())\n")
    os.chmod(root, 0o700)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               sys.executable, "-c", script, str(root)], capture_output=True,
                              text=True, env=env, timeout=120, check=False)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[:2] == ["True True", "True True"], done.stdout
