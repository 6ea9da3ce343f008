"""Importing a framework's DFlash modules without the heavy ``__init__`` of the packages around
them (part of the adapter kit, :mod:`.kit`)."""

from __future__ import annotations

import sys
from typing import Any


def skip_package_inits(*packages: str) -> None:
    """Let the framework modules under ``packages`` (dotted package names) import without
    running those packages' ``__init__`` (a meta-path finder: each becomes a bare package
    over its real folder when first imported; nothing is imported now, and a package that is
    not installed stays missing). For a framework whose package ``__init__`` imports far more
    than its DFlash code (NeMo Automodel's ``speculative.dflash`` imports every drafter
    family; its ``datasets`` every dataset): the DFlash modules import what they need
    themselves. Call it once at the adapter's top level (idempotent)."""
    finder = next((f for f in sys.meta_path if isinstance(f, _BarePackages)), None)
    if finder is None:
        finder = _BarePackages()
        sys.meta_path.insert(0, finder)
    finder.names.update(packages)


class _BarePackages:
    """The meta-path finder of :func:`skip_package_inits`."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        import importlib.machinery

        if fullname not in self.names:
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or real.submodule_search_locations is None:
            return real
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=real.origin,
                                              is_package=True)
        spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        """A bare package: its ``__init__`` is not run."""
