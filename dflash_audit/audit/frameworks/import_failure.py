"""The setup error of a framework whose code cannot import a module: which module, who imports
it, and the fix (exit 2, never a conformance failure: issue 30 item 1)."""

from __future__ import annotations

from typing import Any

from dflash_audit.audit.frameworks.registry import available_adapters
from dflash_audit.audit.sides.launch import CandidateLaunch


def import_failure_message(launch: CandidateLaunch, failure: dict[str, Any]) -> str:
    """The setup error of a framework whose code cannot import a module (the runner's
    ``load_error.json`` with ``missing_module``, ``importer``, ``error``, maybe ``case``):
    which module, who imports it, and the fix -- the adapter's REQUIREMENTS, ``pip install``
    into the interpreter that runs the candidate, or ``--candidate-python``."""
    import shlex

    info = dict(launch.framework or {})
    label = f"{info.get('name', 'the framework')} {info.get('version', '')}".strip()
    shown = f"{launch.shown} ({label})" if launch.framework else label  # as the user named it
    module = str(failure.get("missing_module") or "?")
    top = module.split(".")[0]
    where = f" ({failure['importer']} imports it)" if failure.get("importer") else ""
    when = (f" in case {failure['case']}" if failure.get("case") else
            " when its candidate loaded, before any case")
    text = (f"{shown} cannot import {module!r}{where}{when}: {failure.get('error', '')}. "
            "This is the audit's setup, not a conformance finding: ")
    python = shlex.quote(launch.executable)
    if launch.python is not None:
        return text + (f"install it into the --candidate-python interpreter (`{python} -m pip "
                       f"install {top}`, the distribution that provides {top!r}) and rerun.")
    adapter = available_adapters().get(str(info.get("key")), {})
    requirements = list(adapter.get("REQUIREMENTS") or [])
    if requirements:
        text += (f"the adapter's REQUIREMENTS ({', '.join(requirements)}; installed --no-deps "
                 f"into {info.get('install', 'the tool cache')}) lack it. Add the pinned "
                 f"distribution that provides {top!r} to REQUIREMENTS in "
                 f"{adapter.get('path', 'the adapter module')} (the cached install is redone "
                 f"when they change), or install it where the candidate runs (`{python} -m pip "
                 f"install {top}`), or pass --candidate-python PATH, an interpreter that has "
                 f"{label} and what it imports.")
    else:
        text += (f"install it where the candidate runs (`{python} -m pip install {top}`, the "
                 f"distribution that provides {top!r}), or pass --candidate-python PATH, an "
                 f"interpreter that has it.")
    return text
