"""Conformance report writers: ``report.json``, ``report.md``, ``report.html``, ``junit.xml``.

``write_report(report, out_dir)`` makes ``<out_dir>/<UTC time>-<reference short id>/`` and
writes all four files there. The report object and the fields of ``report.json`` are in
:mod:`dflash_audit.report.schema`; the fingerprints the training gate reads in
:mod:`dflash_audit.report.fingerprint`.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from dflash_audit.report.schema import CaseRecord, MaskPicture, Report

REPORT_FILES = ("report.json", "report.md", "report.html", "junit.xml")

__all__ = ["REPORT_FILES", "CaseRecord", "MaskPicture", "Report", "new_report_folder",
           "report_folder", "write_report", "write_report_texts"]


def new_report_folder(out_dir: Path | str, suffix: str, created: datetime | None = None
                      ) -> Path:
    """A new folder ``<out_dir>/<YYYYmmddTHHMMSSZ>-<suffix>`` (``-2``, ``-3``... when that
    name exists; characters outside ``[A-Za-z0-9._-]`` of ``suffix`` become ``_``).

    Raises:
        OSError: it cannot be created.
    """
    created = created or datetime.now(timezone.utc)
    name = f"{created:%Y%m%dT%H%M%SZ}-{re.sub(r'[^A-Za-z0-9._-]', '_', suffix)}"
    out_dir = Path(out_dir)
    folder, n = out_dir / name, 1
    while folder.exists():
        n += 1
        folder = out_dir / f"{name}-{n}"
    folder.mkdir(parents=True)
    return folder


def write_report_texts(out_dir: Path | str, suffix: str, texts: dict[str, str]) -> Path:
    """``texts`` (file name -> content, e.g. the four :data:`REPORT_FILES`) written into a new
    folder named as :func:`new_report_folder` names it, atomically: the files go into a hidden
    sibling that is renamed when all are complete, so a killed run or a full disk leaves no
    half report under the name.

    Returns:
        The folder.

    Raises:
        OSError: it cannot be written (a full disk, which names no file, names the folder).
    """
    from dflash_audit.atomic import atomic_folder

    probe = new_report_folder(out_dir, suffix)  # reserves the name, then is replaced whole
    try:
        with atomic_folder(probe) as tmp:
            for name, text in texts.items():
                (tmp / name).write_text(text)
    except OSError as exc:
        if probe.is_dir() and not any(probe.iterdir()):
            probe.rmdir()
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(probe.parent)) from None
        raise
    return probe


def report_folder(report: Report, out_dir: Path | str) -> Path:
    """A new folder ``<out_dir>/<YYYYmmddTHHMMSSZ>-<ref short id>`` for a compare report."""
    try:
        created = datetime.fromisoformat(report.created_at).astimezone(timezone.utc)
    except ValueError:
        created = None
    return new_report_folder(out_dir, str(report.reference.get("short_id") or "unknown"),
                             created)


def write_report(report: Report, out_dir: Path | str) -> Path:
    """Write the four report files into a new :func:`report_folder`; returns the folder.

    Raises:
        OSError: the folder cannot be created or written.
    """
    from dflash_audit.report.html import write_html
    from dflash_audit.report.json import write_json
    from dflash_audit.report.junit import write_junit
    from dflash_audit.report.markdown import write_markdown

    folder = report_folder(report, out_dir)
    for write in (write_json, write_markdown, write_html, write_junit):
        write(report, folder)
    return folder
