"""Atomic folder writes: build in a temporary sibling, then rename into place.

A reader never sees a half-written checkpoint, cache entry or converted verifier; a crash
or a kill leaves at most a hidden ``.<name>.tmp-*`` folder behind, never a broken target.

Also: per-folder manifests (size + sha256 of each file, :func:`write_manifest` /
:func:`manifest_problems`) that checkpoints and cache entries carry, a structural length
check of ``.safetensors`` files (:func:`safetensors_problem`), a safetensors writer that
reports a full disk as the ``OSError`` it is (:func:`save_safetensors`), and a writable-folder
probe run before long work (:func:`ensure_writable_dir`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_audit.user_input import loads_json


@contextmanager
def atomic_folder(target: str | Path, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``target``; when the block ends without an
    exception it becomes ``target`` (mode 0755), otherwise it is removed.

    Args:
        target: the folder to publish.
        keep_existing: when ``target`` already exists (another process finished first),
            keep it and discard the new one; otherwise replace it.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.chmod(0o755)  # mkdtemp creates 0700
    if not target.exists():
        os.replace(tmp, target)
    elif keep_existing:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------- manifests
MANIFEST_NAME = "dflash_audit_manifest.json"
#: (path, size, mtime, ctime, inode, device) -> sha256 of the files that matched, this process
_verified: dict[tuple, str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes (read in 4 MiB chunks)."""
    import hashlib

    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: str | Path) -> Path:
    """Record size and sha256 of every plain file in ``folder`` (not recursive) in
    ``folder/dflash_audit_manifest.json``. Call it on the temporary folder of
    :func:`atomic_folder`, so the manifest is published with the files it describes."""
    import json

    folder = Path(folder)
    files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}
    tmp = folder / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST_NAME)
    return folder / MANIFEST_NAME


class ManifestError(ValueError):
    """A manifest that is not ``{"files": {name: {"size": int, "sha256": hex}}}``."""


def read_manifest(folder: str | Path) -> dict[str, dict[str, object]] | None:
    """The one reader of ``folder/dflash_audit_manifest.json`` (checkpoints and caches):
    ``{file name: {"size": int, "sha256": str}}``, or None when the folder has none.

    Raises:
        ManifestError: unreadable, not JSON, or an entry of another form (named).
    """
    import json

    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = loads_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path} is unreadable ({type(exc).__name__})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ManifestError(f"{path} has no \"files\" object")
    for name, want in files.items():
        if not (isinstance(want, dict) and isinstance(want.get("size"), int)
                and not isinstance(want.get("size"), bool)
                and isinstance(want.get("sha256"), str)):
            raise ManifestError(f"{path}: entry {name!r} is {want!r}, not "
                                "{\"size\": bytes, \"sha256\": hex}")
        if "/" in name or name in ("", ".", ".."):
            raise ManifestError(f"{path}: entry {name!r} is not a file name of the folder")
    return files


def manifest_problems(folder: str | Path, full_hash: bool = True,
                      verified: str | Path | None = None) -> list[str] | None:
    """Check ``folder`` against its manifest.

    Returns:
        None when the folder has no manifest (written before manifests existed); else the
        list of problems (empty: intact; a malformed manifest is one problem naming it), e.g.
        ``"model.safetensors: 1000 bytes, manifest says 2000 (truncated or replaced)"``. Sizes
        are always compared; with ``full_hash`` the sha256 too, not again for a file whose
        size, mtime, ctime, inode and device are those it had when it last matched: in this
        process, or as recorded in the JSON file ``verified`` (``verified`` is rewritten, best
        effort, when a file is hashed). Any write through the file system changes a file's
        ctime, which a user cannot set back (root can, with the clock or debugfs); damage below
        the file system (a bit flipped on the disk) changes none of these and is not found
        again once a record holds the file.
    """
    folder = Path(folder)
    try:
        files = read_manifest(folder)
    except ManifestError as exc:
        return [f"malformed manifest: {exc}"]
    if files is None:
        return None
    memo = _read_verified(verified) if full_hash and verified else {}
    problems, matched = [], {}
    for name, want in sorted(files.items()):
        path = folder / name
        try:
            st = path.stat()
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if st.st_size != want.get("size"):
            problems.append(f"{name}: {st.st_size} bytes, manifest says {want.get('size')} "
                            "(truncated or replaced)")
            continue
        if full_hash:
            signature = _stat_signature(st)
            key = (str(path.resolve()), *signature)
            known = memo.get(name) if isinstance(memo.get(name), dict) else {}
            digest = (known.get("sha256") if known.get("stat") == signature else None) \
                or _verified.get(key) or file_sha256(path)
            if digest != want.get("sha256"):
                problems.append(f"{name}: sha256 differs from the manifest (corrupt)")
                continue
            with contextlib.suppress(OSError):  # not written while it was hashed
                if _stat_signature(path.stat()) == signature:
                    _verified[key] = digest
                    matched[name] = {"stat": signature, "sha256": digest}
    if verified and matched and matched != memo:
        import json

        tmp = Path(verified).with_name(f".{Path(verified).name.lstrip('.')}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(matched))
            os.replace(tmp, verified)
        except OSError:  # best effort: a read-only or full cache hashes again next time
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return problems


def _stat_signature(st: os.stat_result) -> list[int]:
    """What changes when a file is written, replaced or moved: size, mtime, ctime, inode and
    device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _read_verified(path: str | Path) -> dict[str, Any]:
    """The record of :func:`manifest_problems`' last matching hashes (``{name: {"stat",
    "sha256"}}``); {} when it is missing or unreadable."""
    try:
        found = loads_json(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def safetensors_problem(path: str | Path) -> str | None:
    """A cheap structural check of a ``.safetensors`` file: the header parses and the file
    is exactly as long as the header's last tensor ends (a truncated or padded file is
    not). Returns a description of the problem, or None when the file looks whole."""
    import json
    import struct

    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"{path}: {size} bytes, too short for a safetensors header (truncated)"
            (n,) = struct.unpack("<Q", raw)
            if n > min(size, 100 << 20):
                return f"{path}: header length {n} exceeds the file ({size} bytes; truncated?)"
            header = loads_json(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{path}: unreadable safetensors header ({type(exc).__name__})"
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v),
              default=0)
    if 8 + n + end != size:
        return (f"{path}: {size} bytes, its header says {8 + n + end} "
                f"({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return None


def save_safetensors(tensors: dict[str, Any], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with a failed write (a full disk, a quota, a
    read-only folder) raised as ``OSError(errno, strerror, path)`` instead of safetensors'
    ``SafetensorError("... I/O error: ... (os error 28)")``, and the partial file of a full
    disk removed.

    Raises:
        OSError: the write failed (``errno`` from the OS: ENOSPC, EDQUOT, EROFS...).
        SafetensorError: anything else safetensors refuses (e.g. non-contiguous tensors).
    """
    import errno
    import re

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        n = int(code.group(1))
        if n in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):  # a half-written file
            Path(path).unlink(missing_ok=True)
        raise OSError(n, os.strerror(n) if n in errno.errorcode else str(exc), str(path)
                      ) from None


def ensure_writable_dir(path: str | Path, option: str = "--out") -> Path:
    """Create ``path`` (and parents) if needed and prove it writable by creating and removing
    a probe file, before any long work writes there.

    Raises:
        OSError: with ``filename`` set and a message naming ``option`` (ENOTDIR when
            ``path`` or a parent is a file; EACCES / EROFS / ENOSPC from the probe).
    """
    import errno

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OSError(errno.ENOTDIR, f"{option} must be a folder, but it is a file", str(path))
    path.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
    os.close(fd)
    os.unlink(probe)
    return path
