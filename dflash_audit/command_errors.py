"""One error contract for every command: exit codes and one-line messages, no tracebacks.

Exit codes: 0 success (audit pass), 1 a failed audit (conformance failure: only a written
verdict says so), 2 usage / setup / environment error (bad option, input, data, checkpoint,
cache; an OS error such as a full disk or an unwritable path). :func:`command_boundary`
wraps each typer command (in ``cli.py``) so that every known bad-input exception and every
``OSError`` becomes ``error: <one line naming the path and the fix>`` on stderr and exit 2.
"""

from __future__ import annotations

import errno
import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import typer

EXIT_CODES_HELP = ("Exit codes: 0 success, 1 audit failed (conformance), 2 usage / setup / "
                   "environment error (bad input, unwritable or full disk, corrupt file).")

_FIXES = {
    errno.ENOSPC: "the disk is full: free space or choose a folder on another disk",
    errno.EDQUOT: "the disk quota is exceeded: free space or choose another folder",
    errno.EACCES: "permission denied: choose a path you can write, or fix its permissions",
    errno.EPERM: "operation not permitted: choose a path you can write",
    errno.EROFS: "read-only file system: choose a writable path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EISDIR: "this is a folder where a file is expected: choose a file path",
    errno.EEXIST: "it already exists: remove it or choose another path",
    errno.ENOENT: "no such file or folder: check the path",
    errno.ENAMETOOLONG: "the path is too long: choose a shorter one",
}


#: (defining module, class) of the exceptions that mean bad input or setup (exit 2, one line).
SETUP_ERRORS = (("dflash_audit.candidate", "CandidateError"),
                ("dflash_audit.data.errors", "DataError"),
                ("dflash_audit.limits", "LimitError"),
                ("dflash_audit.model.checkpoint", "CheckpointError"),
                ("dflash_audit.model.config", "ConfigError"),
                ("dflash_audit.profile", "ProfileError"),
                ("dflash_audit.reference_source.identity", "ReferenceSourceError"),
                ("dflash_audit.serve.engines", "ServeCheckError"),
                ("dflash_audit.train.setup", "TrainError"),
                ("dflash_audit.train.optim", "OptimConfigError"),
                ("dflash_audit.train.state", "ResumeError"))


def setup_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input or setup (exit code 2, one-line message): the classes
    of :data:`SETUP_ERRORS` whose module is imported (an exception of a module never imported
    cannot have been raised, and importing them would import torch: seconds for a one-line
    error)."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in SETUP_ERRORS)
    return tuple(cls for cls in found if isinstance(cls, type))


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit with ``code``."""
    from rich.console import Console

    Console(stderr=True).print(f"error: {message}", style="bold red", markup=False,
                               highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def os_error_message(exc: OSError) -> str:
    """One line for an OS error: the path(s), what happened, and the fix."""
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    what = exc.strerror or str(exc)
    fix = _FIXES.get(exc.errno or -1)
    line = f"{paths}: {what}" if paths else what
    return f"{line} ({fix})" if fix else line


def command_boundary(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a typer command: setup errors and ``OSError`` -> one line, exit 2. typer's own
    exits (``typer.Exit``, ``click`` usage errors) pass through unchanged."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except setup_errors() as exc:
            fail(str(exc), 2)
        except OSError as exc:
            fail(os_error_message(exc), 2)

    return wrapper
