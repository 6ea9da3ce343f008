"""The record of an installation changed by a candidate (``<cache>/integrity/tampered.json``),
which every later audit refuses on (:func:`refuse_recorded_tampering`) until the files are
restored: :func:`record_tampering` keeps, for each changed path, what it held before
(:meth:`.install_guard.InstallBaseline.good`) and what it holds now; a recorded file counts as
repaired when its sha256 is the good one again (a larger file: when it was replaced since),
a folder when its entries are the good ones again, an added file when it is gone, and then it
is dropped from the record.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

from dflash_audit.atomic import file_sha256
from dflash_audit.audit.sides.install_guard import (
    ABSENT,
    folder_names,
    listing_digest,
    signature,
)
from dflash_audit.reference_source.imported_files import imported_files

RECORD = ("integrity", "tampered.json")


def _state(path: str, good: str) -> str:
    """What ``path`` holds now, in the form of ``good`` (:meth:`InstallBaseline.good`)."""
    if good.startswith("dir:"):
        return f"dir:{listing_digest(folder_names(path))}"
    if good.startswith("sha256:"):
        try:
            return f"sha256:{file_sha256(path)}"
        except OSError:
            return ABSENT
    return f"stat:{signature(path)}" if os.path.exists(path) else ABSENT


def _repaired(path: str, entry: dict) -> bool:
    good = str(entry.get("good", ""))
    if good.startswith("stat:"):  # no digest of the good file: replaced since it was seen
        return os.path.exists(path) and _state(path, good) != entry.get("seen")
    return _state(path, good) == good


def record_path() -> Path:
    """The tamper record of this tool cache (``$DFLASH_AUDIT_CACHE``)."""
    from dflash_audit.data.builtin_verifier import cache_dir

    return cache_dir().joinpath(*RECORD)


def _update_record(change: Callable[[dict[str, dict]], None]) -> None:
    """Read the record, apply ``change`` to its ``files`` and write it back (atomically,
    under a lock: concurrent audits share the cache); an empty record is removed."""
    import fcntl

    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        files = _read_record(path)
        before = json.dumps(files, sort_keys=True)
        change(files)
        if json.dumps(files, sort_keys=True) == before:
            return
        if not files:
            path.unlink(missing_ok=True)
            return
        # a fresh name (O_EXCL): a folder or link planted at a predictable one cannot block it
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"files": files}, indent=1, sort_keys=True))
        os.replace(tmp, path)


def _read_record(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # damaged: refuse until it is looked at
        return {str(path): {"good": ABSENT, "seen": "unreadable"}}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {str(path): {"good": ABSENT, "seen": "unreadable"}}
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


def record_tampering(good: dict[str, str]) -> None:
    """Record ``{path: good value}`` (:meth:`InstallBaseline.good`) as changed by a
    candidate, with what each holds now: every later audit refuses until it is repaired.

    Raises:
        OSError: the record cannot be written (the cache is not writable).
    """
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def change(files: dict[str, dict]) -> None:
        # this audit's good values always win: an entry already there for a path this audit
        # verified was written during it (at its start none was outstanding), by the
        # candidate itself (a "good" value that vouches for its own change) or by another
        # audit whose baseline, taken before the change too, holds the same value
        for path, value in good.items():
            files[path] = {"good": value, "seen": _state(path, value), "at": at}

    _update_record(change)


def outstanding_tampering(relevant: Callable[[str], bool]) -> list[str]:
    """Recorded paths, among those ``relevant`` to this audit, that are not repaired yet
    (sorted); the repaired ones are dropped from the record. The record's own path when it
    cannot be read or its folder cannot be locked or written (a candidate without a sandbox
    may have blocked it: then no later audit would learn what it changed)."""
    found: list[str] = []

    def change(files: dict[str, dict]) -> None:
        for path in sorted(files):
            if path == str(record_path()):
                found.append(path)
            elif relevant(path):
                if _repaired(path, files[path]):
                    del files[path]
                else:
                    found.append(path)

    try:
        _update_record(change)
    except OSError:
        return sorted({*found, str(record_path())})
    return found


def installation_roots() -> list[str]:
    """Where this interpreter's code lives: ``sys.prefix``, ``sys.base_prefix`` and every
    site-packages folder (:func:`dflash_audit.reference_source.runner.site_dirs`)."""
    from dflash_audit.reference_source.runner import site_dirs

    return list(dict.fromkeys([sys.prefix, sys.base_prefix, *site_dirs()]))


def repair_hint(paths: list[str], tool: Iterable[Path] = ()) -> str:
    """What restores ``paths``: reinstalling dflash-audit (under ``tool``), ``pip install
    --force-reinstall`` of the distributions that own site-packages files, removing what was
    added to a folder, or reinstalling Python."""
    from importlib.metadata import packages_distributions

    from dflash_audit.reference_source.runner import site_dirs

    tool_roots = tuple(os.path.join(str(p), "") for p in tool)
    sites = [os.path.join(d, "") for d in site_dirs()]
    owners: dict[str, list[str]] = {}
    hints, dists, other = [], [], False
    for path in paths:
        if path.startswith(tool_roots):
            hints.append("reinstall dflash-audit")
            continue
        if path == str(record_path()):
            hints.append(f"make {record_path().parent} a writable folder and delete an "
                         f"unreadable record {path} there once the files are checked")
            continue
        if os.path.isdir(path) or not os.path.exists(path):
            hints.append(f"remove what was added to {path}" if os.path.isdir(path)
                         else f"restore {path}")
            continue
        site = next((s for s in sites if path.startswith(s)), None)
        if site is None:
            other = True
            continue
        top = path[len(site):].split(os.sep)[0].split(".")[0]
        if not owners:
            owners = packages_distributions()
        dists += owners.get(top, [top])
    if dists:
        hints.append(f"{sys.executable} -m pip install --force-reinstall --no-deps "
                     + " ".join(sorted(set(dists))))
    if other:
        hints.append("reinstall Python (or the system package) that holds the others")
    return "; ".join(dict.fromkeys(hints))


def refuse_recorded_tampering(tool: Iterable[Path]) -> None:
    """Refuse an installation that an earlier audit recorded as changed by its candidate and
    that is not restored yet (:func:`outstanding_tampering`, over this process's files, the
    interpreter's folders and dflash-audit's own files, ``tool``).

    Raises:
        CompareSetupError: naming the files and what restores them.
    """
    from dflash_audit.audit.setup_error import CompareSetupError

    tool = [Path(p) for p in tool]
    roots = tuple(os.path.join(str(r), "") for r in [*installation_roots(), *tool])
    mine = set(imported_files())
    found = outstanding_tampering(
        lambda p: p in mine or p.startswith(roots) or os.path.join(p, "") in roots)
    if not found:
        return
    raise CompareSetupError(
        f"files this installation runs the verdict with were changed by an earlier audit's "
        f"candidate and are not restored ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}"
        f"), so no verdict can be given here: {repair_hint(found, tool)}, then rerun (the "
        f"record {record_path()} clears itself once they are back). Run candidates in the "
        "sandbox (bubblewrap).")
