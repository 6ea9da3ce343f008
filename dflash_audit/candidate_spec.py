"""What a ``--candidate`` value names, checked without importing torch or running any code
(a usage error answers at once:
:func:`dflash_audit.audit.frameworks.registry.check_candidate_spec`)."""

from __future__ import annotations

from pathlib import Path

from dflash_audit.user_input import not_a_file

#: ``--candidate`` values that name our own drafter (as None does).
OUR_DRAFTER_SPECS = ("", "default", "dflash-audit")


def is_our_drafter(spec: str | None) -> bool:
    """Whether ``spec`` names our own drafter (None, ``""``, ``default``, ``dflash-audit``):
    our code, not a user's."""
    return spec is None or spec in OUR_DRAFTER_SPECS


def spec_problem(spec: str | None) -> str | None:
    """Why ``spec`` (``--candidate``) cannot name a candidate, found without running any code
    (its form, a ``file.py`` that is not there); None when it may (our drafter included)."""
    if is_our_drafter(spec):
        return None
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        return f"candidate {spec!r} must look like module:attr or file.py:attr"
    path = Path(target).resolve()
    if target.endswith(".py") and not path.is_file():
        return (f"candidate file {path} {not_a_file(path)} (a relative path is read from the "
                f"working folder {Path.cwd()}); give an existing FILE.py:ATTR or an importable "
                "module:attr")
    return None
