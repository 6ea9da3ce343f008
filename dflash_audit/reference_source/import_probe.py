"""A cheap check, in a small subprocess, that the resolved reference imports (before a full run)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from dflash_audit.reference_source.identity import PACKAGE, ReferenceIdentity
from dflash_audit.reference_source.imported_files import report_source
from dflash_audit.reference_source.runner import (
    ReferenceApiMismatchError,
    ReferenceRunError,
    ReferenceTimeoutError,
    ReferenceWrongSourceError,
    _code_dirs,
    _crash_error,
    _error_from_json,
    _missing_dependency_error,
    _tail,
    pycache_prefix,
    reference_command,
    reference_env,
)

#: Modules speculators 0.9.0 imports at import time (beyond the standard library); when one
#: import fails, all of these that are absent are reported together.
REFERENCE_IMPORT_DEPS: tuple[str, ...] = (
    "torch", "transformers", "safetensors", "pydantic", "pydantic_settings", "loguru",
    "openai", "datasets", "hs_connectors", "huggingface_hub",
)


_IMPORT_PROBE = report_source() + """
import importlib.metadata, importlib.util, json, pathlib, sys
version, known = sys.argv[1], json.loads(sys.argv[2])
try:  # a git checkout has no installed metadata, but speculators reads its version at import
    importlib.metadata.version("speculators")
except importlib.metadata.PackageNotFoundError:  # (reference/adapter.py does the same)
    import os
    dist = os.path.abspath(f"speculators-{version}.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\\nName: speculators\\nVersion: {version}\\n")
    sys.path.append(os.getcwd())
try:
    import speculators.models.dflash.core
    import speculators
    out = {"ok": True, "file": speculators.__file__}
    sys.path.insert(0, sys.argv[3])  # then the adapter's own checks of the API it uses
    import adapter
    try:
        adapter.import_reference(pathlib.Path.cwd())
    except SystemExit:  # it wrote error.json (a kind the reference run reports too)
        out["adapter"] = json.loads(pathlib.Path("error.json").read_text())
    out["files"] = imported_files()  # what the audit verifies before any candidate code
except ModuleNotFoundError as e:
    extra = [m for m in known if importlib.util.find_spec(m) is None]
    out = {"ok": False, "missing": [e.name] + [m for m in extra if m != e.name], "error": repr(e)}
except ImportError as e:  # a name the module does not define
    out = {"ok": False, "import_error": str(e), "name": e.name}
print("DFLASH_AUDIT_PROBE " + json.dumps(out))
"""


#: The reference import check's limit on a quiet machine, and the variable that sets it.
IMPORT_TIMEOUT_S, IMPORT_TIMEOUT_ENV = 180.0, "DFLASH_AUDIT_REFERENCE_IMPORT_TIMEOUT"


def check_reference_importable(identity: ReferenceIdentity, timeout_s: float | None = None
                               ) -> list[str]:
    """Check, in a small subprocess, that ``speculators.models.dflash.core`` imports from the
    resolved source and that the adapter's own import of the reference passes
    (``import_reference`` of ``reference/adapter.py``: the names and methods it uses); cheap
    compared with a full reference run. The process is isolated as
    the reference's (:func:`dflash_audit.reference_source.runner.reference_command`; bytecode
    in :func:`~dflash_audit.reference_source.runner.pycache_prefix`). Returns the files that
    process imported (:func:`~dflash_audit.reference_source.imported_files.imported_files`).

    Raises:
        ReferenceMissingDependencyError: import-time dependencies are missing (the one that
            failed plus every absent one of :data:`REFERENCE_IMPORT_DEPS`, with the install
            command).
        ReferenceApiMismatchError: the source has no ``speculators.models.dflash.core``, a
            name it imports from speculators is missing, or the adapter misses what it uses.
        ReferenceWrongSourceError: speculators was imported from outside the resolved source.
        ReferenceTimeoutError: the import took longer than ``timeout_s`` (default: 180 s
            scaled with the machine's load, or ``$DFLASH_AUDIT_REFERENCE_IMPORT_TIMEOUT``;
            :func:`dflash_audit.limits.limit_s`); the message names the setting to raise.
        ReferenceRunError: any other import failure (with the tail of stderr).
    """
    from dflash_audit.limits import exceeded, limit_s

    timeout_s = timeout_s or limit_s(IMPORT_TIMEOUT_S, IMPORT_TIMEOUT_ENV)
    cmd = reference_command(identity, "", [identity.version or "0.0.0+git",
                                           json.dumps(list(REFERENCE_IMPORT_DEPS)),
                                           _code_dirs(identity)["reference"]],
                            pycache_prefix(),
                            code=_IMPORT_PROBE)
    try:
        with tempfile.TemporaryDirectory(prefix="dflash-audit-probe-") as cwd:
            proc = subprocess.run(
                cmd, env=reference_env(identity), capture_output=True, text=True,
                timeout=timeout_s, cwd=cwd,
            )
    except subprocess.TimeoutExpired as exc:
        raise ReferenceTimeoutError(
            exceeded(f"importing the reference ({identity.spec})", timeout_s,
                     IMPORT_TIMEOUT_ENV)) from exc
    probe = next(
        (json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
         if line.startswith("DFLASH_AUDIT_PROBE ")),
        None,
    )
    if probe is None:  # crashed: an ImportError, a SyntaxError, ...
        raise _crash_error(
            identity, proc,
            f"importing the reference ({identity.spec}) failed (exit {proc.returncode}):\n"
            f"{_tail(proc.stderr)}",
        )
    if not probe["ok"] and "import_error" in probe:
        own = (probe.get("name") or "").startswith(PACKAGE)
        raise (ReferenceApiMismatchError if own else ReferenceRunError)(
            f"importing the reference ({identity.spec}) failed: {probe['import_error']}"
            + (". This ref's API is not supported by the adapter." if own else ""),
            returncode=proc.returncode, stderr_tail=_tail(proc.stderr),
        )
    if not probe["ok"]:
        raise _missing_dependency_error(identity, probe["missing"], proc.returncode, proc.stderr)
    src = identity.src_dir.resolve()
    file = Path(probe["file"]).resolve()
    if not file.is_relative_to(src):
        raise ReferenceWrongSourceError(
            f"speculators was imported from {file}, not from the resolved source {src}. Uninstall "
            "other copies (`pip uninstall speculators`) or remove them from PYTHONPATH.",
            returncode=proc.returncode,
        )
    if probe.get("adapter") is not None:
        raise _error_from_json(identity, probe["adapter"], proc.returncode, proc.stderr)
    return [str(f) for f in probe.get("files") or []]
