"""The engine's own functions, taken from the pinned wheel's source files and run here.

An engine module that cannot be imported on CPU (vLLM's ``qwen3_dflash.py`` imports its GPU
kernels and its runtime before anything else) still holds plain-Python functions that decide
how a checkpoint is served (``_resolve_layer_attention``, ``set_default_rope_theta``,
``update_dflash``...). :func:`engine_functions` compiles exactly those function definitions
from the installed file's text -- the engine's code, byte for byte, with its file name so a
traceback points into it -- and binds the names they use to the values the caller gives (the
replaced runtime, e.g. ``get_current_vllm_config``). Each function's provenance (file, line,
the file's sha256, checked against the wheel's ``RECORD``) is returned with it.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EngineSourceError(RuntimeError):
    """The pinned engine's file or function is not where the adapter expects it (an engine
    version the adapter was not written for), or the file differs from its wheel's RECORD."""


@dataclass(frozen=True)
class Provenance:
    """Where an engine function came from: ``file`` relative to the site folder, its first
    ``line``, and the file's ``sha256`` (hex), verified against the wheel's RECORD."""

    file: str
    function: str
    line: int
    sha256: str

    def __str__(self) -> str:
        return f"{self.file}:{self.function} (line {self.line})"


def site_folder(package: str) -> Path:
    """The folder holding the top-level ``package`` on ``sys.path`` (the engine's cached site).

    Raises:
        EngineSourceError: the package is on no ``sys.path`` entry.
    """
    for entry in sys.path:
        if entry and (Path(entry) / package).is_dir():
            return Path(entry)
    raise EngineSourceError(f"{package} is not installed on this process's path")


def record_sha256(site: Path, relative: str) -> str | None:
    """The sha256 (hex) that the installed wheel's ``*.dist-info/RECORD`` lists for
    ``relative``; None when no RECORD names it."""
    for record in site.glob("*.dist-info/RECORD"):
        for line in record.read_text().splitlines():
            path, _, rest = line.partition(",")
            if path == relative and rest.startswith("sha256="):
                digest = rest.split(",")[0].removeprefix("sha256=")
                return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def engine_functions(relative: str, names: list[str], bindings: dict[str, Any] | None = None,
                     *, package: str | None = None) -> tuple[dict[str, Any], dict[str, Provenance]]:
    """Compile the functions ``names`` (and module-level constants they read) of the
    engine's file ``relative`` (e.g. ``vllm/model_executor/models/qwen3_dflash.py``).

    Args:
        relative: path under the engine's site folder.
        names: top-level ``def`` names to take.
        bindings: globals the functions see besides the file's simple module constants
            (``_SLIDING_ATTENTION = "sliding_attention"``) and each other: the replaced
            runtime names. A name a function reads that is neither raises ``NameError`` when
            that line runs, so nothing is silently invented.
        package: the top-level package to find the site folder by (default: first part of
            ``relative``).

    Returns:
        ``(functions by name, provenance by name)``.

    Raises:
        EngineSourceError: file or function missing, or the file differs from the RECORD.
    """
    site = site_folder(package or relative.split("/")[0])
    path = site / relative
    if not path.is_file():
        raise EngineSourceError(f"{relative} is not in the installed engine ({site})")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    recorded = record_sha256(site, relative)
    if recorded is not None and recorded != digest:
        raise EngineSourceError(f"{path} differs from its wheel's RECORD (sha256 {digest[:12]}"
                                f" vs {recorded[:12]}): reinstall the engine")
    tree = ast.parse(data, filename=str(path))
    wanted = {n.name: n for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names}
    missing = [n for n in names if n not in wanted]
    if missing:
        raise EngineSourceError(f"{relative} defines no {', '.join(missing)}: the adapter was "
                                "written for another version of the engine")
    constants = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 and _is_literal(n.value)]
    module = ast.Module(body=constants + [wanted[n] for n in names], type_ignores=[])
    namespace: dict[str, Any] = {"__name__": f"engine_source:{relative}",
                                 "__builtins__": __builtins__, **(bindings or {})}
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - the engine's own code
    funcs = {n: namespace[n] for n in names}
    return funcs, {n: Provenance(relative, n, wanted[n].lineno, digest) for n in names}


def _is_literal(node: ast.AST | None) -> bool:
    if node is None:
        return False
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


def stub_modules(names: list[str]) -> None:
    """Put empty modules named ``names`` into ``sys.modules`` (for a file whose imports are
    the runtime only, so ``from X import Y`` of an unused ``Y`` succeeds). Only for modules
    none of the functions run; a function that touches a stub fails loudly."""
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
