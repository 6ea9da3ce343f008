"""The files a Python process runs code from, listed by that process itself: every module's
source or extension file, every shared library it has mapped and the interpreter.
:func:`imported_files` uses the standard library only, so its source also runs inside the
reference's processes (:func:`report_source`), which write the list into the file that
:data:`OUT_ENV` names, for the audit to verify (:mod:`dflash_audit.audit.sides.install_guard`).
"""

from __future__ import annotations

import inspect
import json
import os

#: The variable naming the file into which a reference process writes its list (JSON).
OUT_ENV = "DFLASH_AUDIT_IMPORTED_OUT"


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
    """Python source that defines :func:`imported_files` and ``report_imported_files()``,
    which writes its JSON list into the file ``$DFLASH_AUDIT_IMPORTED_OUT`` names (nothing
    when unset): run it last in a reference process (e.g. in a ``finally``)."""
    return (inspect.getsource(imported_files)
            + "\n\ndef report_imported_files():\n    import json, os\n"
            + f"    out = os.environ.get({OUT_ENV!r})\n"
            + "    if out:\n        with open(out, 'w') as f:\n"
            + "            json.dump(imported_files(), f)\n")


def read_imported(path: str | os.PathLike[str]) -> list[str] | None:
    """The list a reference process wrote into ``path`` (:func:`report_source`); None when it
    wrote none (it died before) or the file is not a JSON list."""
    try:
        with open(path) as f:
            files = json.load(f)
    except (OSError, ValueError):
        return None
    return [str(f) for f in files] if isinstance(files, list) else None
