"""What the verdict runs on must be what was verified: digests of the reference's tree and of
dflash-audit's own files, before and after each side runs, and no process of the candidate
left alive when the reference starts.

- :func:`reference_tree_digest`: sha256 of **every** file of the resolved reference tree
  (``identity.source_dir``: sources, data files, ``__pycache__``, a planted ``.pyc`` or
  ``.so``). The reference process never reads a ``__pycache__`` of the tree (it runs with a
  private ``-X pycache_prefix``, :func:`dflash_audit.reference_source.runner.reference_command`),
  but a file that appears there during a run is still a write by the candidate: no verdict.
- :func:`reference_bytecode_digest`: sha256 of the reference process's own bytecode of the
  reference and of the adapter, in the tool's pycache prefix (compiled completely before any
  candidate code runs, so a change there is a planted ``.pyc``).
- :func:`prefix_signature`: a stat signature of that whole prefix, across an unsandboxed
  candidate's run (stdlib and site-packages bytecode is read from there as well).
- :func:`tool_digest`: sha256 of every file of dflash-audit's installed package and of its
  ``reference/`` folder (the adapter), ``__pycache__`` included: our own process imports
  these, and a planted ``.pyc`` with its source's mtime and size would run in the next audit.
- :func:`enable_subreaper` / :func:`leftover_processes`: compare becomes the Linux "child
  subreaper" of everything it starts (``prctl(PR_SET_CHILD_SUBREAPER)``), so a candidate
  process that ``setsid``s and double-forks is re-parented to compare instead of init and can
  be found and killed before the reference starts -- the guard where no sandbox runs (inside
  the sandbox its PID namespace ends with it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dflash_audit.atomic import file_sha256

PYCACHE = "__pycache__"


def _digest(roots: dict[str, Path], skip_pycache: bool) -> dict[str, str]:
    out = {}
    for name, root in roots.items():
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if skip_pycache and PYCACHE in path.relative_to(root).parts:
                continue
            if path.is_file() or path.is_symlink():
                rel = f"{name}/{path.relative_to(root).as_posix()}"
                try:
                    out[rel] = file_sha256(path) if path.is_file() else f"link:{os.readlink(path)}"
                except OSError as exc:
                    out[rel] = f"unreadable: {exc}"
    return out


def reference_tree_digest(identity: Any, skip_pycache: bool = False) -> dict[str, str]:
    """``{"ref/<path>": sha256}`` of every file of the reference tree (see the module
    docstring; ``skip_pycache``: without its ``__pycache__`` folders, which no reference process
    reads)."""
    return _digest({"ref": Path(identity.source_dir)}, skip_pycache=skip_pycache)


def reference_bytecode_digest(identity: Any) -> dict[str, str]:
    """``{"bytecode-ref/<path>" | "bytecode-reference/<path>": sha256}`` of the reference
    process's bytecode of the reference's sources and of the adapter
    (:func:`dflash_audit.reference_source.runner.bytecode_roots`): the files a planted
    ``.pyc`` would have to replace to run in the reference without a sandbox, compared at
    every step (the rest of the prefix: :func:`prefix_signature`)."""
    from dflash_audit.reference_source.runner import bytecode_roots

    return _digest(bytecode_roots(identity), skip_pycache=False)


def prefix_signature() -> dict[str, str]:
    """``{"pycache/<path>": "inode:size:mtime_ns:ctime_ns"}`` of every file of the reference
    processes' whole bytecode prefix (stdlib and site-packages included, ~5k files: stat
    only; a write or a replacement changes the inode or ctime, which no user can set back).
    Compared across an unsandboxed candidate's run, when no process of the audit writes
    there: bytecode of any module the reference imports, planted in the prefix, would run."""
    from dflash_audit.reference_source.runner import pycache_prefix

    root, out = pycache_prefix(), {}
    for path in sorted(root.rglob("*")):
        try:
            st = path.lstat()
        except OSError:
            continue
        if not path.is_dir():
            rel = path.relative_to(root).as_posix()
            out[f"pycache/{rel}"] = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    return out


def remove_planted_prefix_bytecode(changed: list[str], identity: Any) -> None:
    """Delete the files of the bytecode prefix that ``changed`` names (keys of
    :func:`prefix_signature` and :func:`reference_bytecode_digest`): the next reference
    process compiles them again from the sources; other files, which another audit may be
    using, stay."""
    from dflash_audit.reference_source.runner import bytecode_roots, pycache_prefix

    roots = {"pycache": pycache_prefix(), **bytecode_roots(identity)}
    for key in changed:
        name, _, rel = key.partition("/")
        if name in roots:
            (roots[name] / rel).unlink(missing_ok=True)


def tool_roots() -> dict[str, Path]:
    """dflash-audit's own installed files: the package and its ``reference/`` folder."""
    import dflash_audit

    package = Path(dflash_audit.__file__).resolve().parent
    return {"dflash_audit": package, "reference": package.parent / "reference"}


def tool_digest() -> dict[str, str]:
    """``{"dflash_audit/<path>" | "reference/<path>": sha256}`` of every file of
    :func:`tool_roots`, ``__pycache__`` included."""
    return _digest(tool_roots(), skip_pycache=False)


def reference_code_digest(identity: Any, whole_prefix: bool = False) -> dict[str, str]:
    """sha256 of every file the verdict's code is read from: the reference's whole tree
    (:func:`reference_tree_digest`), dflash-audit's own package and adapter
    (:func:`tool_digest`) and the reference process's bytecode of both
    (:func:`reference_bytecode_digest`; compiled first by
    :func:`dflash_audit.reference_source.runner.compile_reference_bytecode`). Taken before any
    candidate code runs, again before the reference starts and after it ends. With
    ``whole_prefix`` (an unsandboxed candidate) also :func:`prefix_signature`,
    compared only across the candidate's run."""
    return {**reference_tree_digest(identity), **tool_digest(),
            **reference_bytecode_digest(identity),
            **(prefix_signature() if whole_prefix else {})}


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Keys whose digest differs, that are gone in ``after``, or that are new in it."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def benign_bytecode(path: Path) -> bool:
    """Whether the bytecode file ``path`` (``__pycache__/<name>.cpython-XY[.opt-N].pyc`` of the
    tool) can only run what its source says: it is gone (Python compiles the source again), or
    its code object equals the source compiled now. An honest process (another audit, a test
    worker, the candidate's own process importing a module not compiled yet) writes such a
    file, and marshal's bytes differ from process to process although the code does not; a
    planted ``.pyc`` runs other code and is not benign."""
    import importlib.util
    import marshal

    if not os.path.lexists(path):
        return True
    try:
        source = Path(importlib.util.source_from_cache(str(path)))
        opt = path.name.split(".opt-")[1].split(".")[0] if ".opt-" in path.name else ""
        code = marshal.loads(path.read_bytes()[16:])
        return code == compile(source.read_bytes(), str(source), "exec", dont_inherit=True,
                               optimize=int(opt) if opt else -1)
    except (OSError, ValueError, EOFError, TypeError, SyntaxError, IndexError):
        return False


def remove_planted_bytecode(changed: list[str]) -> None:
    """Delete the changed / added files of ``changed`` (keys of :func:`tool_digest`) that lie
    in a ``__pycache__`` folder of the tool: Python rebuilds them from the sources."""
    roots = tool_roots()
    for key in changed:
        name, _, rel = key.partition("/")
        if name in roots and PYCACHE in Path(rel).parts:
            (roots[name] / rel).unlink(missing_ok=True)


#: Children this process had before any candidate ran (e.g. the ``tee`` of a shell's
#: ``2> >(tee log)``, forked by the shell's child before it exec'd us): never leftovers.
_OWN_CHILDREN: set[int] = set()


def enable_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); False elsewhere.
    The children it has now are recorded as its own (:func:`leftover_processes` spares them)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    _OWN_CHILDREN.update(_children(os.getpid()))
    return ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # 36 = PR_SET_CHILD_SUBREAPER


def _children(pid: int) -> list[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    kids = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(name))
    return kids


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.decode(errors="replace").split("\0")).strip()[:120] or "?"


def _reap() -> None:
    """Reap children of ours that have exited (orphans re-parented to the subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def leftover_processes(kill: bool = True, grace_s: float = 3.0) -> list[str]:
    """Processes that are children of this process now (with :func:`enable_subreaper`, every
    orphaned descendant is one), as ``"pid N: command"``, after ``grace_s`` seconds in which
    they may end on their own (the sandbox's own processes, killed with their parent, exit
    asynchronously); SIGKILLed and reaped when ``kill``. Call it when no child of ours should
    be alive (the candidate's process ended, the reference has not started)."""
    import time

    def strangers() -> list[int]:
        return [pid for pid in _children(os.getpid()) if pid not in _OWN_CHILDREN]

    deadline = time.monotonic() + grace_s
    while True:
        _reap()
        if not strangers() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    found = []
    for _ in range(5):  # killing one may orphan its children onto us
        kids = strangers()
        if not kids:
            break
        for pid in kids:
            found.append(f"pid {pid}: {_command(pid)}")
            if kill:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError, PermissionError):
                    pass
        if not kill:
            break
    return list(dict.fromkeys(found))


def case_digests(cases_dir: Path, names: list[str]) -> dict[str, str]:
    """sha256 of every file of the case folders ``names``, hashing each hard-linked file once.
    Taken right after the cases are written, and again after the run: every file of the first
    (what the reference reads) must be unchanged; files the reference adds are not compared."""
    seen: dict[tuple[int, int], str] = {}
    digests = {}
    for name in names:
        for path in sorted(p for p in (cases_dir / name).rglob("*") if p.is_file()):
            inode = (path.stat().st_dev, path.stat().st_ino)
            if inode not in seen:
                seen[inode] = file_sha256(path)
            digests[str(path.relative_to(cases_dir))] = seen[inode]
    return digests


#: What reference/adapter.py reads back as a case's outputs (its ``OUTPUT_FILES``).
REFERENCE_OUTPUT_FILES = ("outputs.safetensors", "outputs.json", "derivation.json")


def reference_output_changes(stdout: str, cases_dir: Path, names: list[str]) -> list[str]:
    """Reference output files of the cases ``names`` that are not what the adapter wrote: a
    sha256 other than the one it printed on its stdout (``{"dflash_audit_outputs": case,
    "sha256": {file: digest}}`` lines) or a file it did not write. Empty when all agree."""
    reported: dict[str, dict[str, str]] = {}
    for line in stdout.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "dflash_audit_outputs" in entry:
            reported[str(entry["dflash_audit_outputs"])] = dict(entry.get("sha256") or {})
    changed = []
    for name in names:
        for file in REFERENCE_OUTPUT_FILES:
            path, want = cases_dir / name / file, reported.get(name, {}).get(file)
            if path.is_file() and (want is None or file_sha256(path) != want):
                changed.append(f"{name}/{file}")
            elif want is not None and not path.is_file():
                changed.append(f"{name}/{file} (removed)")
    return changed
