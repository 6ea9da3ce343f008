"""Registries of folders the candidate's sandbox must hide, shared by every audit of this user.

A registry is a text file ``~/.cache/dflash-audit/<name>`` (one resolved absolute path a line),
independent of ``$DFLASH_AUDIT_CACHE`` and ``$TMPDIR``, so an audit hides the folders earlier
audits made with other settings too: every work root (``work-roots``,
:func:`dflash_audit.audit.sides.sandbox.work_root`), every report-key folder
(``key-folders``, :func:`dflash_audit.report.fingerprint.key_dirs`) and every folder of the
reference cache's records (``reference-record-folders``,
:func:`dflash_audit.audit.sides.reference_records.record_dirs`). The candidate cannot edit
it (the sandbox binds it read-only).
"""

from __future__ import annotations

from pathlib import Path


def registry_path(name: str) -> Path:
    """``~/.cache/dflash-audit/<name>``."""
    return Path.home() / ".cache" / "dflash-audit" / name


def record_folder(name: str, folder: Path) -> None:
    """Add ``folder`` to the registry ``name`` (under a lock), dropping folders that are gone;
    best effort: a registry that cannot be written leaves the folders each audit knows
    itself (its own and the defaults) hidden."""
    import fcntl

    registry = registry_path(name)
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
    """The absolute paths of the registry ``name`` (none when it is missing or unreadable)."""
    try:
        text = registry_path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    return [Path(line) for line in text.splitlines() if line.startswith("/")]
