"""The files a Python process runs code from, listed by that process itself: every module's
source or extension file, every shared library it has mapped and the interpreter. :func:`imported_files` uses the standard library only, so its source also runs
inside the reference's processes (:func:`report_source`), which print the list on their stdout
(:data:`MARK`) for the audit to verify (:mod:`dflash_audit.audit.sides.install_guard`).
"""

from __future__ import annotations

import inspect
import json

#: Prefix of the stdout line on which a reference process lists its files (a JSON list).
MARK = "DFLASH_AUDIT_IMPORTED "


def imported_files() -> list[str]:
    """Absolute paths of the regular files this process runs code from: each module's
    ``__file__`` (``.py`` sources, ``.so`` extension modules), each shared library in
    ``/proc/self/maps`` (Linux: the ones extension modules load, such as ``libtorch_cpu.so``)
    and ``sys.executable``. Sorted. (Bytecode next to the sources is swept apart:
    :class:`dflash_audit.audit.sides.install_guard.InstallBaseline`.)"""
    import os
    import sys

    paths = {sys.executable}
    for module in list(sys.modules.values()):
        try:  # its __dict__: a lazy module's __getattr__ would import more
            value = vars(module).get("__file__")
        except TypeError:
            continue
        if isinstance(value, str) and os.path.isabs(value):
            paths.add(value)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.rstrip("\n").split(None, 5)
                path = parts[5].removesuffix(" (deleted)") if len(parts) == 6 else ""
                name = os.path.basename(path)
                if path.startswith("/") and (name.endswith(".so") or ".so." in name):
                    paths.add(path)
    except OSError:
        pass
    return sorted(p for p in paths if os.path.isfile(p))


def report_source() -> str:
    """Python source that defines :func:`imported_files` and a function
    ``report_imported_files()`` printing ``MARK + json list`` on stdout: run it last in a
    reference process (e.g. in a ``finally``)."""
    return (inspect.getsource(imported_files)
            + "\n\ndef report_imported_files():\n    import json, sys\n"
            + f"    sys.stdout.write({MARK!r} + json.dumps(imported_files()) + '\\n')\n"
            + "    sys.stdout.flush()\n")


def parse_imported(stdout: str) -> list[str] | None:
    """The files a reference process listed on ``stdout`` (:func:`report_source`); None when
    it listed none (it died before, or its stdout was not the pipe we read)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            try:
                files = json.loads(line[len(MARK):])
            except ValueError:
                return None
            return [str(f) for f in files] if isinstance(files, list) else None
    return None
