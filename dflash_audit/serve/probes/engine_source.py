"""The engine's own code, taken from the pinned wheel's source files and run here.

An engine module that cannot be imported on CPU (vLLM's ``qwen3_dflash.py`` imports its GPU
kernels and its runtime before anything else; ``sglang/__init__.py`` imports triton and zmq)
still holds plain-Python definitions that decide how a checkpoint is served
(``_resolve_layer_attention``, ``set_default_rope_theta``, ``update_dflash``,
``_get_dflash_layer_attention_params``...). An :class:`EngineFile` is one installed file,
read once and verified against its wheel's ``RECORD``; it compiles exactly the definitions
asked for -- the engine's code, byte for byte, under the file's own name so a traceback
points into it, with its ``from __future__`` flags -- and binds the names they use to the
values the caller gives (the replaced runtime, e.g. ``get_current_vllm_config``). A name
that is neither bound nor defined raises ``NameError`` when that line runs: nothing is
silently invented.
"""

from __future__ import annotations

import __future__ as _future
import ast
import base64
import hashlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EngineSourceError(RuntimeError):
    """The pinned engine's file or definition is not where the adapter expects it (an engine
    version the adapter was not written for), or the file differs from its wheel's RECORD."""


@dataclass(frozen=True)
class Provenance:
    """Where an engine definition came from: ``file`` relative to the site folder, its first
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


def _is_literal(node: ast.AST | None) -> bool:
    if node is None:
        return False
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


class EngineFile:
    """One installed engine file (``relative`` under ``site``, default: the folder holding
    its top-level package on ``sys.path``), parsed once.

    Raises:
        EngineSourceError: the file is missing or differs from its wheel's RECORD.
    """

    def __init__(self, relative: str, site: Path | None = None):
        self.site = site or site_folder(relative.split("/")[0])
        self.relative, self.path = relative, self.site / relative
        if not self.path.is_file():
            raise EngineSourceError(f"{relative} is not in the installed engine ({self.site})")
        data = self.path.read_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        recorded = record_sha256(self.site, relative)
        if recorded is not None and recorded != self.sha256:
            raise EngineSourceError(f"{self.path} differs from its wheel's RECORD (sha256 "
                                    f"{self.sha256[:12]} vs {recorded[:12]}): reinstall the "
                                    "engine")
        self.text = data.decode()
        self.tree = ast.parse(data, filename=str(self.path))
        self.flags = 0
        for n in self.tree.body:
            if isinstance(n, ast.ImportFrom) and n.module == "__future__":
                for a in n.names:
                    self.flags |= getattr(_future, a.name).compiler_flag

    def _missing(self, what: str) -> EngineSourceError:
        return EngineSourceError(f"{self.relative} defines no {what}: the adapter was written "
                                 "for another version of the engine")

    def provenance(self, name: str, node: ast.AST) -> Provenance:
        """The :class:`Provenance` of definition ``name`` at ``node``."""
        return Provenance(self.relative, name, getattr(node, "lineno", 0), self.sha256)

    def definitions(self, names: list[str], bindings: dict[str, Any] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Provenance]]:
        """The top-level functions, classes and assignments ``names``, compiled together with
        the file's literal module constants, in a module of their own (registered in
        ``sys.modules``: a dataclass with string annotations looks it up).

        Returns:
            ``(objects by name, provenance by name)``.
        """
        found: dict[str, ast.stmt] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name in names:
                found[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id in names:
                        found[t.id] = node
        missing = [n for n in names if n not in found]
        if missing:
            raise self._missing(", ".join(missing))
        chosen = {id(n) for n in found.values()}
        body = [n for n in self.tree.body if id(n) in chosen or (
            isinstance(n, (ast.Assign, ast.AnnAssign)) and _is_literal(n.value))]
        module = types.ModuleType(f"engine_source:{self.relative}")
        sys.modules[module.__name__] = module
        namespace = module.__dict__
        namespace.update({"__builtins__": __builtins__, **(bindings or {})})
        self._exec(body, namespace)
        return ({n: namespace[n] for n in names},
                {n: self.provenance(n, found[n]) for n in names})

    def node(self, cls: str, method: str | None = None) -> ast.AST:
        """The class ``cls`` (or its method ``method``) of the file."""
        for n in self.tree.body:
            if isinstance(n, ast.ClassDef) and n.name == cls:
                if method is None:
                    return n
                for m in n.body:
                    if isinstance(m, ast.FunctionDef) and m.name == method:
                        return m
        raise self._missing(f"{cls}.{method}" if method else cls)

    def method(self, cls: str, name: str, bindings: dict[str, Any]) -> tuple[Any, int]:
        """The method ``cls.name`` compiled as a plain function (``self`` its first argument),
        and its line."""
        node = self.node(cls, name)
        fn = ast.FunctionDef(name=node.name, args=node.args, body=node.body, decorator_list=[],
                             returns=None, type_comment=None)
        ast.copy_location(fn, node)
        return self._compile(fn, name, bindings), node.lineno

    def statement(self, cls: str, method: str, contains: str, params: list[str],
                  bindings: dict[str, Any]) -> tuple[Any, int]:
        """The first ``if`` statement of ``cls.method`` whose test mentions ``contains``, as a
        function of ``params`` (the engine's statement, byte for byte), and its line."""
        for n in ast.walk(self.node(cls, method)):
            if isinstance(n, ast.If) and contains in (ast.get_source_segment(self.text, n.test)
                                                      or ""):
                args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=p) for p in params],
                                     kwonlyargs=[], kw_defaults=[], defaults=[])
                fn = ast.FunctionDef(name="_statement", args=args, body=[n, ast.Pass()],
                                     decorator_list=[], returns=None, type_comment=None)
                ast.copy_location(fn, n)
                return self._compile(fn, "_statement", bindings), n.lineno
        raise EngineSourceError(f"{self.relative}: {cls}.{method} has no `if` on {contains!r}")

    def constant(self, name: str, bindings: dict[str, Any] | None = None) -> Any:
        """A module-level ``name = <expression>`` of the file, evaluated."""
        for n in self.tree.body:
            if (isinstance(n, ast.Assign) and len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name):
                expr = ast.Expression(n.value)
                return eval(compile(expr, str(self.path), "eval", flags=self.flags,  # noqa: S307
                                    dont_inherit=True),
                            {"__builtins__": __builtins__, **(bindings or {})})
        raise self._missing(name)

    def imported_names(self) -> list[str]:
        """The names the file's top-level ``from ... import`` statements bind."""
        return [a.asname or a.name for n in self.tree.body if isinstance(n, ast.ImportFrom)
                for a in n.names]

    def _compile(self, fn: ast.stmt, name: str, bindings: dict[str, Any]) -> Any:
        namespace: dict[str, Any] = {"__name__": f"engine_source:{self.relative}",
                                     "__builtins__": __builtins__, **bindings}
        self._exec([fn], namespace)
        return namespace[name]

    def _exec(self, body: list[ast.stmt], namespace: dict[str, Any]) -> None:
        module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
        exec(compile(module, str(self.path), "exec", flags=self.flags,  # noqa: S102 - the
                     dont_inherit=True), namespace)  # engine's own code


def engine_functions(relative: str, names: list[str], bindings: dict[str, Any] | None = None,
                     ) -> tuple[dict[str, Any], dict[str, Provenance]]:
    """``EngineFile(relative).definitions(names, bindings)``: the definitions ``names`` of the
    installed engine file ``relative`` (e.g. ``vllm/model_executor/models/qwen3_dflash.py``).

    Raises:
        EngineSourceError: file or definition missing, or the file differs from the RECORD.
    """
    return EngineFile(relative).definitions(names, bindings)

