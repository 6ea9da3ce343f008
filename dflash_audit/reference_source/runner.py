"""Running the reference: ``python reference/adapter.py ...`` in a subprocess against the resolved
source, and the errors it raises (read from the adapter's ``error.json`` or its stderr)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from dflash_audit.reference_source.identity import (
    PACKAGE,
    SOURCE_ENV,
    ReferenceIdentity,
    ReferenceSourceError,
    adapter_path,
)
from dflash_audit.reference_source.imported_files import (
    OUT_ENV,
    read_imported,
    report_source,
)

#: Import name -> pip requirement, for modules the reference imports at import time.
PIP_NAMES: dict[str, str] = {
    "hs_connectors": "hs-connectors",
    "pydantic_settings": "pydantic-settings",
    "pydantic": "pydantic",
    "loguru": "loguru",
    "openai": "openai",
    "datasets": "datasets<=5.1",
    "transformers": "transformers",
    "torch": "torch",
    "safetensors": "safetensors",
    "huggingface_hub": "huggingface-hub",
    "yaml": "pyyaml",
    "google": "protobuf",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "aiohttp": "aiohttp",
    "httpx": "httpx",
    "psutil": "psutil",
    "tqdm": "tqdm",
    "click": "click",
    "numpy": "numpy",
    "typer": "typer",
    "rich": "rich",
}


class ReferenceRunError(ReferenceSourceError):
    """The reference process failed. ``returncode``/``stderr_tail`` carry what it said."""

    def __init__(self, message: str, *, returncode: int | None = None, stderr_tail: str = ""):
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


class ReferenceMissingDependencyError(ReferenceRunError):
    """The reference cannot be imported: modules are missing. ``missing`` lists them and
    ``install_command`` is the command that installs them."""

    def __init__(self, message: str, *, missing: list[str], install_command: str, **kw: Any):
        super().__init__(message, **kw)
        self.missing = missing
        self.install_command = install_command


class ReferenceApiMismatchError(ReferenceRunError):
    """The reference at this ref lacks a function/attribute/module the adapter needs."""


class ReferenceWrongSourceError(ReferenceRunError):
    """``speculators`` was imported from somewhere other than the resolved source tree."""


class ReferenceTimeoutError(ReferenceRunError):
    """The reference process ran past its time limit and was killed."""


# --- identity ---------------------------------------------------------------------------------

@dataclass
class ReferenceRun:
    """A finished (successful) reference process."""

    command: list[str]
    workdir: Path
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    #: The files it ran code from (:mod:`dflash_audit.reference_source.imported_files`);
    #: None when it listed none.
    imported: list[str] | None = None


#: Runs a script in an isolated interpreter: ``python -I -S -X pycache_prefix=DIR -c BOOT
#: PATHS_JSON SCRIPT ARGS...`` puts PATHS (the script's folder, the reference's ``src``,
#: site-packages) first on ``sys.path``, runs SCRIPT as ``__main__`` and then lists the files
#: the process imported (:mod:`dflash_audit.reference_source.imported_files`).
_BOOT = (report_source()
         + "import json, runpy, sys; paths = json.loads(sys.argv[1]); sys.argv = sys.argv[2:]; "
         "sys.path[:0] = paths\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
         "finally:\n    report_imported_files()\n")
PYCACHE_DIR = "pycache"


def site_dirs() -> list[str]:
    """The site-packages folders of this interpreter (``site.getsitepackages()``; a venv's
    own), without the user site: what the reference may import from besides its source."""
    import site

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def pycache_prefix() -> Path:
    """Where every reference process's bytecode goes: ``<cache>/pycache/<tag>``, written only
    by the tool's own reference processes, never a ``__pycache__`` of the reference tree or of
    site-packages (which a candidate may have written). In the sandbox a candidate cannot
    write there; without one, :func:`compile_reference_bytecode` completes the reference's part
    before any candidate code runs and the audit verifies it byte for byte
    (:func:`bytecode_roots`, :mod:`dflash_audit.audit.sides.integrity`)."""
    from dflash_audit.reference_source.identity import cache_root

    path = cache_root().parent / PYCACHE_DIR / sys.implementation.cache_tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def _code_dirs(identity: ReferenceIdentity) -> dict[str, str]:
    """The folders of code the verdict depends on that the reference process imports, as the
    strings its ``sys.path`` holds (:func:`reference_command`): the reference's ``src`` and
    the adapter's folder."""
    from dflash_audit.reference_source.identity import reference_dir

    return {"ref": str(identity.src_dir), "reference": str(reference_dir().resolve())}


def bytecode_roots(identity: ReferenceIdentity) -> dict[str, Path]:
    """``{"bytecode-ref" | "bytecode-reference": folder}``: where the reference process's
    bytecode of :func:`_code_dirs` lies under :func:`pycache_prefix` (Python mirrors a source
    ``/a/b/m.py`` to ``<prefix>/a/b/m.<tag>.pyc``)."""
    prefix = pycache_prefix()
    return {f"bytecode-{name}": prefix / path.lstrip(os.sep)
            for name, path in _code_dirs(identity).items()}


def compile_reference_bytecode(identity: ReferenceIdentity, timeout_s: float | None = None
                               ) -> None:
    """Compile every module of :func:`_code_dirs` into :func:`pycache_prefix` with the
    reference's own interpreter flags (``python -I -S -X pycache_prefix -m compileall``;
    up-to-date files are left alone, so a warm cache costs one small process). Afterwards no
    reference process writes bytecode of the verdict's code, so any change there during an
    audit is a write by someone else. Files that do not compile are left to the reference
    run to report.

    Raises:
        ReferenceTimeoutError: compiling took longer than ``timeout_s`` (None: 300 s scaled
            with the load, :func:`dflash_audit.limits.limit_s`).
    """
    from dflash_audit.limits import exceeded, limit_s

    limit = limit_s(300.0) if timeout_s is None else timeout_s
    cmd = [sys.executable, "-I", "-S", "-X", f"pycache_prefix={pycache_prefix()}", "-m",
           "compileall", "-q", "-q", *_code_dirs(identity).values()]
    try:
        subprocess.run(cmd, capture_output=True, timeout=limit, check=False,
                       cwd=pycache_prefix())
    except subprocess.TimeoutExpired as exc:
        raise ReferenceTimeoutError(
            exceeded(f"compiling the reference ({identity.spec})", limit)) from exc


def reference_command(identity: ReferenceIdentity, script: Path | str, args: list[str],
                      prefix: Path, code: str | None = None) -> list[str]:
    """The command that runs ``script args`` (or ``python -c code args``) in the reference's
    process: Python's isolated mode (``-I``: no user site, no ``PYTHON*`` variables such as
    PYTHONPATH, no script folder on ``sys.path``), no ``site`` module (``-S``: no
    ``sitecustomize`` / ``usercustomize`` / ``.pth`` start-up hooks) and bytecode only under
    ``prefix`` (``-X pycache_prefix``: a planted ``__pycache__/*.pyc`` is never read).
    ``sys.path`` is given explicitly: the script's folder, ``identity.src_dir``, then
    :func:`site_dirs`."""
    import json

    head = [sys.executable, "-I", "-S", "-X", f"pycache_prefix={prefix}"]
    if code is not None:
        paths = json.dumps([str(identity.src_dir), *site_dirs()])
        return [*head, "-c", f"import sys; sys.path[:0] = {paths}\n{code}", *args]
    paths = [str(Path(script).resolve().parent), str(identity.src_dir), *site_dirs()]
    return [*head, "-c", _BOOT, json.dumps(paths), str(script), *map(str, args)]


def reference_env(
    identity: ReferenceIdentity, base: dict[str, str] | None = None
) -> dict[str, str]:
    """Environment for a reference subprocess: ``<source>/src`` prepended to PYTHONPATH and
    ``$DFLASH_AUDIT_REFERENCE_SOURCE`` set to it."""
    env = dict(os.environ if base is None else base)
    src = str(identity.src_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env[SOURCE_ENV] = src
    return env


def install_command(modules: Iterable[str]) -> str:
    """The command that installs the pip packages providing ``modules`` (import names)."""
    pkgs = []
    for mod in modules:
        top = mod.split(".")[0]
        pkg = PIP_NAMES.get(top, top.replace("_", "-"))
        if pkg not in pkgs:
            pkgs.append(pkg)
    return f"{shlex.quote(sys.executable)} -m pip install " + " ".join(map(shlex.quote, pkgs))


_MISSING_RE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def _missing_modules(stderr: str) -> list[str]:
    return list(dict.fromkeys(_MISSING_RE.findall(stderr)))


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _missing_dependency_error(
    identity: ReferenceIdentity, missing: list[str], returncode: int | None, stderr: str
) -> ReferenceRunError:
    """Missing modules -> ReferenceMissingDependencyError, or ReferenceApiMismatchError when the
    missing module is part of speculators itself (this ref's layout is not supported)."""
    own = [m for m in missing if m == PACKAGE or m.startswith(PACKAGE + ".")]
    if own:
        return ReferenceApiMismatchError(
            f"the reference at {identity.spec} has no module {own[0]}; this ref's API is not "
            "supported by the adapter. Use a ref the adapter knows (e.g. speculators==0.9.0).",
            returncode=returncode, stderr_tail=_tail(stderr),
        )
    cmd = install_command(missing)
    return ReferenceMissingDependencyError(
        f"the reference ({identity.spec}) cannot be imported: missing module(s) "
        f"{', '.join(missing)}. Install them into the interpreter that runs it:\n  {cmd}",
        missing=missing, install_command=cmd, returncode=returncode, stderr_tail=_tail(stderr),
    )


def _crash_error(
    identity: ReferenceIdentity, proc: subprocess.CompletedProcess, message: str
) -> ReferenceRunError:
    """The error for a reference process that died without a structured report: the
    missing-dependency error when its stderr names a missing module, else a
    ReferenceRunError with ``message`` (which should include the stderr tail)."""
    missing = _missing_modules(proc.stderr)
    if missing:
        return _missing_dependency_error(identity, missing, proc.returncode, proc.stderr)
    return ReferenceRunError(message, returncode=proc.returncode, stderr_tail=_tail(proc.stderr))


def _error_from_json(
    identity: ReferenceIdentity, err: dict[str, Any], returncode: int, stderr: str
) -> ReferenceRunError:
    kind = err.get("kind", "error")
    message = str(err.get("message", "")).strip()
    tail = _tail(stderr)
    if kind == "missing_dependency":
        missing = [str(m) for m in err.get("missing") or []] or _missing_modules(stderr)
        return _missing_dependency_error(identity, missing or ["<unknown>"], returncode, stderr)
    if kind == "api_mismatch":
        return ReferenceApiMismatchError(
            f"the reference at {identity.spec} ({identity.short_id}) lacks what the adapter "
            f"needs: {message}. This ref's API is not supported by the adapter; use a ref it "
            "knows (e.g. speculators==0.9.0).",
            returncode=returncode, stderr_tail=tail,
        )
    if kind == "wrong_source":
        return ReferenceWrongSourceError(
            f"the reference process imported speculators from the wrong place: {message}. "
            f"Expected a module under {identity.src_dir}; uninstall other copies of speculators "
            "(`pip uninstall speculators`) or remove them from PYTHONPATH.",
            returncode=returncode, stderr_tail=tail,
        )
    return ReferenceRunError(
        f"the reference process failed (exit {returncode}): {message}"
        f"\n--- stderr (tail) ---\n{tail}",
        returncode=returncode, stderr_tail=tail,
    )


def _error_files(workdir: Path, adapter_args: list[str]) -> list[Path]:
    """Where the adapter may write error.json: the workdir, then argument directories."""
    dirs = [workdir] + [Path(a) for a in map(str, adapter_args) if Path(a).is_dir()]
    return list(dict.fromkeys(d.resolve() / "error.json" for d in dirs))


def run_reference(
    identity: ReferenceIdentity,
    adapter_args: list[str],
    workdir: Path,
    timeout_s: float,
    *,
    adapter: Path | None = None,
    limit_env: str | None = None,
) -> ReferenceRun:
    """Run ``python reference/adapter.py <adapter_args>`` against the resolved source, in an
    isolated interpreter (:func:`reference_command`).

    The process gets ``<source>/src`` on ``sys.path``, ``$DFLASH_AUDIT_REFERENCE_SOURCE`` and
    ``cwd=workdir``; its bytecode goes to :func:`pycache_prefix`. Exit code 0 is success; on failure the adapter writes ``error.json`` =
    {"kind", "message", "missing"} into ``workdir`` or into a directory named by an adapter
    argument (e.g. its CASES_DIR); stale ones are removed before the run.

    Args:
        adapter: the script to run (default :func:`adapter_path`); injectable for tests.
        limit_env: the variable that sets ``timeout_s``, named when it is hit.

    Raises:
        ReferenceSourceError: the adapter script is absent.
        ReferenceMissingDependencyError: modules are missing (lists them and the install command).
        ReferenceApiMismatchError: the reference lacks a function/attribute the adapter needs.
        ReferenceWrongSourceError: speculators was imported from outside the resolved source.
        ReferenceTimeoutError: it ran past ``timeout_s``.
        ReferenceRunError: any other failure (with the tail of stderr).
    """
    script = Path(adapter) if adapter is not None else adapter_path()
    if not script.is_file():
        raise ReferenceSourceError(f"the reference adapter {script} does not exist.")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    error_files = _error_files(workdir, adapter_args)
    for path in error_files:
        path.unlink(missing_ok=True)
    cmd = reference_command(identity, script, list(map(str, adapter_args)), pycache_prefix())
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="dflash-audit-imported-") as listing:
            out = Path(listing) / "imported.json"
            proc = subprocess.run(
                cmd, cwd=workdir, env={**reference_env(identity), OUT_ENV: str(out)},
                capture_output=True, text=True, timeout=timeout_s,
            )
            imported = read_imported(out)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr or ""
        if isinstance(stderr, bytes):
            stderr = stderr.decode(errors="replace")
        from dflash_audit.limits import exceeded

        raise ReferenceTimeoutError(
            exceeded(f"the reference process ({identity.spec})", timeout_s, limit_env)
            + f"; it was killed\n{_tail(stderr)}",
            stderr_tail=_tail(stderr),
        ) from exc
    wall = time.monotonic() - start
    if proc.returncode == 0:
        return ReferenceRun(cmd, workdir, 0, proc.stdout, proc.stderr, wall, imported)
    error_file = next((p for p in error_files if p.is_file()), None)
    if error_file is not None:
        try:
            err = json.loads(error_file.read_text())
            if not isinstance(err, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise ReferenceRunError(
                f"the reference process failed (exit {proc.returncode}) and wrote an unreadable "
                f"{error_file} ({exc}).\n--- stderr (tail) ---\n{_tail(proc.stderr)}",
                returncode=proc.returncode, stderr_tail=_tail(proc.stderr),
            ) from exc
        raise _error_from_json(identity, err, proc.returncode, proc.stderr)
    raise _crash_error(
        identity, proc,
        f"the reference process failed (exit {proc.returncode}) without writing error.json."
        f"\n--- stderr (tail) ---\n{_tail(proc.stderr)}",
    )
