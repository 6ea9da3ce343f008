"""Refusals of an audit whose files changed while it ran: the reference's code and dflash-audit's
own files (:func:`.integrity.reference_code_digest`), the installation the audit's processes
import (:class:`.install_guard.InstallGuard`), the case files and the reference's outputs. Each
names what changed in one line (:class:`CompareSetupError`, exit 2), discards what the tool can
rebuild and records what it cannot (:mod:`.tamper_record`), so no verdict rests on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError


def refuse_code_changes(identity: Any, before: dict[str, str] | None, when: str,
                        whole_prefix: bool = True, guard: Any = None,
                        reference_files: list[str] = ()) -> None:
    """Compare :func:`.integrity.reference_code_digest` with ``before`` (skipped when None)
    and the installation with ``guard``'s baseline (:class:`.install_guard.InstallGuard`,
    with ``reference_files``: what a reference run listed). On any change discard the damaged
    reference cache (rebuilt by the next resolve) and delete planted bytecode of the tool and
    of the prefix; record changed sources of the tool and changed files of the installation
    (:func:`.tamper_record.record_tampering`: every later audit refuses until they are
    restored); raise :class:`CompareSetupError` naming the files (one line).

    Raises:
        CompareSetupError: anything changed.
    """
    from dflash_audit.audit.sides.tamper_record import record_tampering, repair_hint
    from dflash_audit.audit.sides.integrity import (
        PYCACHE,
        benign_bytecode,
        changed_files,
        reference_code_digest,
        remove_planted_bytecode,
        remove_planted_prefix_bytecode,
        tool_roots,
    )
    from dflash_audit.reference_source import discard_damaged_tree

    changed: list[str] = []
    if before is not None:
        whole = whole_prefix and any(k.startswith("pycache/") for k in before)
        if not whole:  # the reference may add bytecode of modules not compiled yet
            before = {k: v for k, v in before.items() if not k.startswith("pycache/")}
        changed = changed_files(before, reference_code_digest(identity, whole))
    roots = tool_roots()
    changed = [k for k in changed if not (  # bytecode of the tool an honest process rewrote
        k.partition("/")[0] in roots and PYCACHE in Path(k.partition("/")[2]).parts
        and benign_bytecode(roots[k.partition("/")[0]] / k.partition("/")[2]))]
    installed = guard.changes(reference_files) if guard is not None else []
    if not changed and not installed:
        return
    persistent = {str(roots[k.partition("/")[0]] / k.partition("/")[2]):
                  f"sha256:{before[k]}" if before and k in before else "absent"
                  for k in changed if k.partition("/")[0] in roots
                  and PYCACHE not in Path(k.partition("/")[2]).parts}
    persistent.update({p: guard.baseline.good(p) for p in installed})
    try:
        record_tampering(persistent)
    except OSError:  # an unwritable cache: this audit is refused either way
        pass
    messages = []
    if changed:
        # sources first: a changed source also makes its bytecode be rewritten
        changed.sort(key=lambda k: k.startswith("bytecode-"))
        if any(k.startswith("ref/") for k in changed):
            discard_damaged_tree(identity)
        remove_planted_prefix_bytecode(changed, identity)  # compiled again by the next run
        remove_planted_bytecode(changed)
        concurrent = ("; another audit using the same cache at the same time (a cold one) can "
                      "also write there: then rerun"
                      if all(k.startswith("pycache/") for k in changed) else "")
        messages.append(
            f"the audit's code changed {when} ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}): the candidate wrote into the reference's "
            "cached tree or bytecode, or into dflash-audit's own files, so no verdict can be "
            "given. The damaged reference cache and the changed bytecode are discarded (the "
            "next run rebuilds them); reinstall dflash-audit if its sources are named (until "
            f"then every audit refuses){concurrent}.")
    if installed:
        named = [guard.baseline.describe(p) for p in installed[:3]]
        messages.append(
            f"files of the Python installation that the audit's processes import changed "
            f"{when} ({', '.join(named)}{', ...' if len(installed) > 3 else ''}): the candidate "
            "wrote into the interpreter's files, so no verdict can be given, in this audit or "
            f"any later one until they are restored: {repair_hint(installed, roots.values())}.")
    if guard is not None:
        guard.reported = True
    raise CompareSetupError(" ".join([messages[0], *(m[0].upper() + m[1:] for m in messages[1:])])
                            + " Run candidates in the sandbox (bubblewrap).")


def with_code_changes(exc: CompareSetupError, identity: Any, before: dict[str, str] | None,
                      guard: Any) -> CompareSetupError:
    """``exc`` (an audit refused after candidate code may have run), with what
    :func:`refuse_code_changes` finds appended ("Also: ..."; changes recorded as there);
    ``exc`` itself when nothing changed or the changes were reported already."""
    if guard is not None and guard.reported:
        return exc
    try:
        refuse_code_changes(identity, before, "meanwhile", guard=guard)
    except CompareSetupError as more:
        return CompareSetupError(f"{exc} Also: {more}")
    return exc


def refuse_changes(changed: list[str]) -> None:
    """Raise :class:`CompareSetupError` naming the first files of ``changed`` (if any)."""
    if changed:
        raise CompareSetupError(
            f"the audit's files changed during the run ({', '.join(changed[:3])}"
            "): the candidate's process wrote outside its own copy of the cases (into the "
            "reference's inputs, outputs or code), so no verdict can be given. Make the "
            "candidate read its inputs only from run_case's arguments and return its outputs.")
