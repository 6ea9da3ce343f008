"""Which bubblewrap is trusted, and what the candidate's sandbox proves from inside.

A sandbox is what it proves, not the name of a binary on PATH (DESIGN.md section 9):

- :func:`trusted_bwrap`: the binary is one of :data:`TRUSTED_BWRAP` (never a ``bwrap`` found
  first on PATH), a regular executable file that root owns and no group or other user can
  write, in folders (every one up to ``/``) that root owns and no one else can write;
- :func:`probe_command` / :func:`judge`: :mod:`.sandbox_probe` runs inside the very flags the
  candidate gets and tries what a hostile candidate running as root would try; :func:`judge`
  turns its facts into one ``{"ok", "evidence"}`` per property of :data:`PROPERTIES`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Where a trusted bubblewrap may live, in the order they are tried.
TRUSTED_BWRAP = ("/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap")
#: What the proof establishes (the keys of ``candidate.sandbox.proof`` in ``report.json``).
PROPERTIES = {
    "capabilities": "no capability (CapEff, CapPrm, CapAmb 0; none regained by exec)",
    "read_only": "a write outside its writable folders fails",
    "mounts": "it cannot remount / read-write nor unmount /proc, /tmp or a cover",
    "nested_namespace": "a user namespace of its own does not unlock those mounts",
    "pid_namespace": "its own PID namespace: no host process visible",
    "report_key": "every report-key folder is empty or unreadable inside",
    "network": "no network (loopback only)",
}
#: How many processes the probe's PID namespace may show (bubblewrap's init and the probe).
MAX_PIDS = 4
PROBE_TIMEOUT_S = 60.0


class UntrustedBwrap(Exception):
    """No trusted bubblewrap binary here; the message says what was found and what to do."""


def _unsafe(path: Path) -> str | None:
    """Why ``path`` (a file or folder, not followed) could be replaced by someone else than
    root: not owned by root, or writable by group / others; None when it cannot."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):  # a link's own mode means nothing; its folder is checked
        return None if info.st_uid == 0 else f"{path} is a link owned by uid {info.st_uid}"
    if info.st_uid != 0:
        return f"{path} is owned by uid {info.st_uid}, not root"
    if info.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def bwrap_problem(path: Path) -> str | None:
    """Why the binary ``path`` is not a trusted bubblewrap (see the module docstring); None
    when it is, "" when it does not exist."""
    if not os.path.lexists(path):
        return ""
    real = path.resolve()
    if not real.is_file() or not os.access(real, os.X_OK):
        return f"{path} is not an executable file"
    # every component as written (links included) and every folder of the file it names
    chain = [path, *path.parents, real, *real.parents]
    for p in dict.fromkeys(chain):
        why = _unsafe(p)
        if why:
            return why
    return None


def trusted_bwrap() -> Path:
    """The first of :data:`TRUSTED_BWRAP` that is trusted (see the module docstring).

    Raises:
        UntrustedBwrap: none is; the message names what was found (also a ``bwrap`` on PATH,
            which is never used) and what to do.
    """
    problems = []
    for candidate in TRUSTED_BWRAP:
        why = bwrap_problem(Path(candidate))
        if why is None:
            return Path(candidate)
        if why:
            problems.append(why)
    on_path = shutil.which("bwrap")
    found = (f"; the bwrap on PATH ({on_path}) is not used: only {', '.join(TRUSTED_BWRAP)} "
             "owned by root count" if on_path and on_path not in TRUSTED_BWRAP else "")
    if problems:
        raise UntrustedBwrap(
            f"bubblewrap is not trusted: {'; '.join(problems)}{found}; reinstall it with the "
            "system's package manager (`apt-get install --reinstall -y bubblewrap`) or make it "
            "and its folders root's and not group/other writable")
    raise UntrustedBwrap(
        f"bubblewrap (bwrap) is not installed at {', '.join(TRUSTED_BWRAP)}{found}; `sudo "
        "apt-get install -y bubblewrap` or `bash scripts/setup.sh` adds it")


def bwrap_version(bwrap: Path) -> str:
    """``bwrap --version``'s version (``0.8.0``), or "" when it prints none."""
    try:
        out = subprocess.run([str(bwrap), "--version"], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.split()[-1] if out.split() else ""


def probe_command(read_only: list[Path], hidden: list[Path], mounts: list[str]) -> list[str]:
    """The command of the probe (:mod:`.sandbox_probe`) with its argument: this interpreter in
    isolated mode (no site, no ``PYTHON*`` variables), the probe's source passed with ``-c``.

    Args:
        read_only: folders bound read-only where the probe tries to create a file.
        hidden: the report-key folders that exist (each must be empty inside).
        mounts: mount points it tries to unmount (``/proc``, ``/tmp``, the covers).
    """
    source = (Path(__file__).parent / "sandbox_probe.py").read_text()
    args = {"read_only": [str(p) for p in read_only], "hidden": [str(p) for p in hidden],
            "mounts": list(mounts)}
    return [sys.executable, "-I", "-S", "-c", source, json.dumps(args)]


def run_probe(command: list[str]) -> dict[str, Any]:
    """Run the sandboxed probe ``command`` (``bwrap ... -- probe``) and return its facts.

    Raises:
        RuntimeError: it did not start, ended with an error or printed no facts (the reason:
            its stderr's last line).
    """
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"bwrap cannot start ({exc})") from None
    try:
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        facts = None
    if proc.returncode != 0 or not isinstance(facts, dict):
        tail = " ".join(proc.stderr.split())[-300:] or f"exit {proc.returncode}, no output"
        raise RuntimeError(tail)
    return facts


def _caps(status: dict[str, Any]) -> tuple[bool, str]:
    def value(key: str) -> int:
        try:
            return int(str(status.get(key, "")), 16)
        except ValueError:
            return -1

    eff, prm, amb, bnd = (value(k) for k in ("CapEff", "CapPrm", "CapAmb", "CapBnd"))
    nnp = str(status.get("NoNewPrivs", "")) == "1"
    # with a bounding set left, root would regain it on exec unless no_new_privs holds
    ok = eff == prm == amb == 0 and (bnd == 0 or nnp)
    return ok, (f"uid {status.get('uid')}: CapEff {status.get('CapEff')}, CapPrm "
                f"{status.get('CapPrm')}, CapAmb {status.get('CapAmb')}, CapBnd "
                f"{status.get('CapBnd')}, NoNewPrivs {status.get('NoNewPrivs')}")


def _all_refused(results: dict[str, Any]) -> bool:
    return bool(results) and all(v != "ok" for v in results.values())


def _listing(results: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in results.items())


def judge(facts: dict[str, Any], host_pid: int, host_pidns: str) -> dict[str, dict[str, Any]]:
    """``{property: {"ok": bool, "evidence": str}}`` for every key of :data:`PROPERTIES`,
    from the probe's ``facts`` (:mod:`.sandbox_probe`); ``host_pid`` / ``host_pidns``: this
    process's pid and ``/proc/self/ns/pid`` link. A missing fact is not proven."""
    out: dict[str, dict[str, Any]] = {}
    ok, evidence = _caps(facts.get("status") or {})
    out["capabilities"] = {"ok": ok, "evidence": evidence}
    writes = facts.get("writes") or {}
    out["read_only"] = {"ok": _all_refused(writes),
                        "evidence": f"creating a file refused in {_listing(writes)}"}
    umount, remount = facts.get("umount") or {}, facts.get("remount")
    out["mounts"] = {"ok": _all_refused(umount) and remount not in (None, "ok"),
                     "evidence": f"remount / read-write: {remount}; umount {_listing(umount)}"}
    nested = facts.get("nested") or {}
    if nested.get("unshare") not in (None, "ok"):
        out["nested_namespace"] = {"ok": True, "evidence": "cannot make a user namespace: "
                                                           f"{nested['unshare']}"}
    else:
        n_umount, n_remount = nested.get("umount") or {}, nested.get("remount")
        out["nested_namespace"] = {
            "ok": _all_refused(n_umount) and n_remount not in (None, "ok"),
            "evidence": f"in its own user + mount namespace: remount / read-write: "
                        f"{n_remount}; umount {_listing(n_umount)}"}
    pids, pidns = list(facts.get("pids") or []), str(facts.get("pidns"))
    host_hidden = host_pid not in pids or host_pid <= len(pids)  # a container's pid 1 may clash
    out["pid_namespace"] = {
        "ok": bool(pids) and pidns != host_pidns and len(pids) <= MAX_PIDS and host_hidden,
        "evidence": f"{pidns} (host {host_pidns}); /proc lists pids {pids[:10]}; the auditing "
                    f"process (host pid {host_pid}) is " + ("not visible" if host_hidden
                                                            else "visible")}
    hidden = facts.get("hidden")
    hidden = hidden if isinstance(hidden, dict) else {"(not reported)": None}
    seen = {k: ("empty" if v == [] else f"unreadable ({v})" if isinstance(v, str)
                else f"{len(v)} entries visible" if isinstance(v, list) else "not reported")
            for k, v in hidden.items()}
    out["report_key"] = {"ok": all(v == [] or isinstance(v, str) for v in hidden.values()),
                         "evidence": _listing(seen) or "no report-key folder exists yet"}
    interfaces = list(facts.get("interfaces") or [])
    out["network"] = {"ok": interfaces == ["lo"],
                      "evidence": f"network interfaces: {', '.join(interfaces) or 'none'}"}
    return out


def failed(proof: dict[str, dict[str, Any]]) -> list[str]:
    """``"property (evidence)"`` for every property of ``proof`` that is not proven."""
    return [f"{name}: {entry.get('evidence')}" for name, entry in proof.items()
            if not entry.get("ok")]
