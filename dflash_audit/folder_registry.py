"""Registries of folders the candidate's sandbox must hide, shared by every audit of this user,
and the other paths a folder is reachable by.

A registry is a text file ``<home>/.cache/dflash-audit/<name>`` (one resolved absolute path a
line), independent of ``$DFLASH_AUDIT_CACHE`` and ``$TMPDIR``, so an audit hides the folders
earlier audits made with other settings too: every work root (``work-roots``,
:func:`dflash_audit.audit.sides.sandbox.work_root`), every report-key folder
(``key-folders``, :func:`dflash_audit.report.fingerprint.key_dirs`) and every folder of the
reference cache's records (``reference-record-folders``,
:func:`dflash_audit.audit.sides.reference_records.record_dirs`). Nor does it depend on
``$HOME`` alone (:func:`homes`): an audit run with another ``$HOME`` records in, and reads,
the account's own home too, and root reads every account's registries (a candidate audited
as root must not read another user's report key either). The candidate cannot edit a
registry (the sandbox binds it read-only).

A folder covered by path can still be reached by another one: a bind mount of it (or of a
folder above it) elsewhere, as a container volume mounted twice. :func:`folders_with_aliases`
finds those paths in ``/proc/self/mountinfo``, so they are covered too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The tool's cache folder in a home (the default ``$DFLASH_AUDIT_CACHE``).
CACHE_IN_HOME = Path(".cache") / "dflash-audit"


def _account_home(uid: int) -> Path | None:
    import pwd

    try:
        return Path(pwd.getpwuid(uid).pw_dir)
    except (KeyError, OSError):
        return None


def own_homes() -> list[Path]:
    """This user's homes: ``$HOME`` and the account's home in the password database (they
    differ when ``$HOME`` was set to something else)."""
    found = [Path.home(), _account_home(os.geteuid())]
    return list(dict.fromkeys(p.absolute() for p in found if p and p.is_absolute()))


def homes() -> list[Path]:
    """Every home whose registries and default cache an audit of this user must honour:
    :func:`own_homes` and, when running as root (who can read every account's files, so a
    candidate audited as root could too), every account's home."""
    found = own_homes()
    if os.geteuid() == 0:
        import pwd

        try:
            found += [Path(p.pw_dir) for p in pwd.getpwall() if p.pw_dir.startswith("/")]
        except OSError:
            pass
    return list(dict.fromkeys(found))


def default_caches() -> list[Path]:
    """``<home>/.cache/dflash-audit`` for every home of :func:`homes`."""
    return [home / CACHE_IN_HOME for home in homes()]


def registry_path(name: str) -> Path:
    """``~/.cache/dflash-audit/<name>`` (``$HOME``'s)."""
    return Path.home() / CACHE_IN_HOME / name


def record_folder(name: str, folder: Path) -> None:
    """Add ``folder`` to the registry ``name`` of each of :func:`own_homes` (under a lock),
    dropping folders that are gone; best effort: a registry that cannot be written leaves the
    folders each audit knows itself (its own and the defaults) hidden."""
    for home in own_homes():
        _record(home / CACHE_IN_HOME / name, folder)


def _record(registry: Path, folder: Path) -> None:
    import fcntl

    try:
        registry.parent.mkdir(parents=True, exist_ok=True)
        with open(registry, "a+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            known = [line for line in f.read().splitlines() if line]
            keep = [line for line in dict.fromkeys(known) if Path(line).is_dir()]
            if str(folder) not in keep:
                keep.append(str(folder))
            if keep != known:
                f.seek(0)
                f.truncate()
                f.write("".join(f"{line}\n" for line in keep))
    except (OSError, UnicodeDecodeError):
        pass


def recorded_folders(name: str) -> list[Path]:
    """The absolute paths of the registries ``name`` of every home of :func:`homes` (none
    from a registry that is missing or unreadable)."""
    out: list[Path] = []
    for home in homes():
        try:
            text = (home / CACHE_IN_HOME / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out += [Path(line) for line in text.splitlines() if line.startswith("/")]
    return list(dict.fromkeys(out))


def _unescape(field: str) -> str:
    """A path of ``/proc/self/mountinfo`` (spaces, tabs, newlines, backslashes as ``\\ooo``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """``(major:minor, root in its file system, mount point)`` of every row of the mount
    table ``mountinfo``; [] when it cannot be read."""
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    # fields: id, parent id, major:minor, root in its file system, mount point, ...
    return [(r[2], _unescape(r[3]), _unescape(r[4])) for r in rows if len(r) > 4]


def _under(path: str, top: str) -> str | None:
    """``path`` relative to ``top`` ("" for ``top`` itself) when ``path`` is ``top`` or
    inside it, else None (both absolute, normalised)."""
    if path == top:
        return ""
    prefix = top.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def folders_with_aliases(folders: list[Path], mountinfo: str = "/proc/self/mountinfo"
                         ) -> list[Path]:
    """The ``folders`` that exist (resolved, in order, once each), then every other path each
    is reachable by through a bind mount: for every mount of the same file system whose root
    holds the folder, its path under that mount point, when that is the same folder (device
    and inode), and the mount point of every mount of a folder inside it (a bind of one of its
    subfolders elsewhere). None are added when the mount table ``mountinfo`` cannot be read.
    (A bind of a single file of the folder elsewhere is not found.)"""
    found = list(dict.fromkeys(Path(p).resolve() for p in folders if Path(p).is_dir()))
    mounts = _mounts(mountinfo) if found else []
    out = list(found)
    for folder in found:
        path = str(folder)
        holders = [m for m in mounts if _under(path, m[2]) is not None]
        if not holders:
            continue
        device, root, point = max(reversed(holders), key=lambda m: len(Path(m[2]).parts))
        inner = os.path.join(root, _under(path, point))  # its path inside its file system
        try:
            info = folder.stat()
        except OSError:
            continue
        inner = inner.rstrip("/") or "/"
        for dev, root, point in mounts:
            if dev != device:
                continue
            rest = _under(inner, root)
            if rest is None:  # not a mount of the folder or above it: one of a folder inside?
                if _under(root, inner) and os.path.isdir(point):
                    out.append(Path(point))  # shows part of the folder: covered as a whole
                continue
            alias = Path(os.path.join(point, rest))
            try:
                if alias != folder and os.path.samestat(alias.stat(), info):
                    out.append(alias)
            except OSError:
                pass
    return list(dict.fromkeys(out))
