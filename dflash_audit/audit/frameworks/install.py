"""A framework installed by the tool at its pinned version, into the tool's cache -- never into
the user's environment -- for the candidate process to import (like the reference's sdist,
:mod:`dflash_audit.reference_source.sdist`).

Cache entry ``<cache>/frameworks/<name>-<version>/`` (``<cache>`` = ``$DFLASH_AUDIT_CACHE``
or ``~/.cache/dflash-audit``)::

    site/            pip install --no-deps --target of the adapter's REQUIREMENTS, compiled
                     (:func:`compile_site`)
    manifest.json    {"requirements", "local_files": {wheel path: sha256}, "python",
                     "installed_at", "files": {path: sha256}, "bytecode": {pyc path: sha256}}

The entry is built in a temporary sibling and renamed (a crash never leaves half of one).
Each use checks ``site/`` against the manifest (its sources, and the bytecode the install
compiled where it is still there; other bytecode aside: importing may write it); a damaged
entry, or one made for other requirements, is installed again -- offline it is an
error that names the folder and the command to run.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from dflash_audit.atomic import atomic_folder, file_sha256
from dflash_audit.audit.setup_error import CompareSetupError

CACHE_ENV = "DFLASH_AUDIT_CACHE"
SITE = "site"
MANIFEST = "manifest.json"
PIP_TIMEOUT_S, PIP_TIMEOUT_ENV = 900.0, "DFLASH_AUDIT_PIP_TIMEOUT"


class FrameworkInstallError(CompareSetupError):
    """The framework cannot be installed into (or found in) the tool's cache (exit 2)."""


def frameworks_cache(cache_dir: Path | str | None = None) -> Path:
    """``<cache>/frameworks``: ``cache_dir``, else ``$DFLASH_AUDIT_CACHE``, else
    ``~/.cache/dflash-audit``."""
    base = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-audit"
    return Path(base).expanduser() / "frameworks"


def site_manifest(site: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``site`` except bytecode caches."""
    return {p.relative_to(site).as_posix(): file_sha256(p) for p in sorted(site.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def site_bytecode(site: Path, names: Sequence[str] | None = None) -> dict[str, str]:
    """``{relative path: sha256}`` of the bytecode files under ``site`` (``__pycache__/*.pyc``),
    or of those of ``names`` that exist."""
    if names is None:
        found = (p for p in sorted(site.rglob("*.pyc")) if "__pycache__" in p.parts)
    else:
        found = (site / n for n in names)
    return {p.relative_to(site).as_posix(): file_sha256(p) for p in found if p.is_file()}


def is_local(requirement: str) -> bool:
    """Whether a requirement names a local wheel or sdist (a path ending ``.whl`` /
    ``.tar.gz`` / ``.zip``, not a URL)."""
    return requirement.endswith((".whl", ".tar.gz", ".zip")) and "://" not in requirement


def local_digests(requirements: Sequence[str]) -> dict[str, str]:
    """``{path: sha256}`` of the local wheels / sdists among ``requirements`` (absolute
    paths, :func:`local_requirements`): what the cached install was made from, so a wheel
    rebuilt at the same path is installed again.

    Raises:
        FrameworkInstallError: one is missing or not a regular file (a FIFO, a device, a
            folder: pip would block on it or fail).
    """
    out = {}
    for r in requirements:
        if not is_local(r):
            continue
        try:
            regular = Path(r).is_file()  # follows a symlink: /dev/zero behind one is no file
        except OSError as exc:  # e.g. in a folder this user cannot enter
            raise FrameworkInstallError(f"the adapter's local requirement {r} cannot be read "
                                        f"({exc.strerror or exc})") from None
        if not regular:
            raise FrameworkInstallError(
                f"the adapter's local requirement {r} is not a regular file (missing, a folder, "
                "a FIFO or a device): build the wheel there, or name the wheel file in "
                "REQUIREMENTS (relative to the adapter's folder)")
        out[r] = file_sha256(r)
    return out


def entry_problems(entry: Path, requirements: Sequence[str]) -> list[str]:
    """How a cache entry differs from what it must be: "no manifest", "made for other
    requirements", "made for another build of W" (a local wheel W changed since),
    "missing X", "changed Y", "extra Z.py"; empty when intact.

    Raises:
        FrameworkInstallError: a local requirement is no regular file (:func:`local_digests`).
    """
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        expected = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return ["no manifest"]
    if list(manifest.get("requirements", [])) != list(requirements):
        return [f"made for other requirements ({manifest.get('requirements')})"]
    built = manifest.get("local_files") or {}
    changed = [f"made for another build of {path}" for path, digest in
               local_digests(requirements).items() if built.get(path) != digest]
    if changed:
        return changed
    found = site_manifest(entry / SITE) if (entry / SITE).is_dir() else {}
    problems = [f"missing {k}" for k in expected if k not in found]
    problems += [f"changed {k}" for k in expected if k in found and found[k] != expected[k]]
    problems += [f"extra {k}" for k in found if k not in expected and k.endswith(".py")]
    compiled = dict(manifest.get("bytecode") or {})
    problems += [f"changed {k}" for k, digest in
                 site_bytecode(entry / SITE, list(compiled)).items() if digest != compiled[k]]
    return problems


def local_requirements(requirements: Sequence[str], folder: Path | str) -> list[str]:
    """``requirements`` with every local file among them (a wheel or sdist named by a path
    ending ``.whl`` / ``.tar.gz`` / ``.zip``, e.g. ``"dist/fw-1.0-py3-none-any.whl"``) made
    absolute against ``folder`` (the adapter's folder), so an adapter can pin a wheel it ships
    beside it whatever the current directory; index requirements are unchanged."""
    return [str((Path(folder) / r).resolve()) if is_local(r) and not Path(r).is_absolute()
            else r for r in requirements]


def pip_command(requirements: Sequence[str], target: Path,
                pip_args: Sequence[str] = ()) -> list[str]:
    """``python -m pip install --no-deps --target TARGET REQUIREMENTS`` (this interpreter)."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input",
            "--disable-pip-version-check", "--no-compile", "--target", str(target),
            *pip_args, *requirements]


def compile_site(site: Path) -> dict[str, str]:
    """Bytecode for every module under ``site``, written once here: the candidate's process
    never writes it (its sandbox binds the cache read-only, and ``PYTHONDONTWRITEBYTECODE``
    may be set), so without it each audit compiles the framework again (ModelOpt 0.47.0 and
    its requirements: ~1,700 modules, ~3 s of every audit's load). ``checked-hash`` pycs
    (PEP 552): Python checks each against its source's hash at import, so one left from
    another source is never run; the manifest lists their sha256 (:func:`site_bytecode`), so
    one replaced since is found (:func:`entry_problems`). Best effort (a module that does not
    compile, as Python 2 files some wheels ship, stays uncompiled): returns the digests of the
    bytecode written."""
    from dflash_audit.limits import LimitError, limit_s

    cmd = [sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode",
           "checked-hash", str(site)]
    try:
        subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL,
                       timeout=limit_s(PIP_TIMEOUT_S, PIP_TIMEOUT_ENV))
    except (OSError, LimitError, subprocess.TimeoutExpired):
        pass
    return site_bytecode(site)


def _compile_once(entry: Path) -> None:
    """An intact entry installed before entries were compiled: compiled now, once (the
    manifest records it; replaced atomically)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return
    if "bytecode" in manifest or not os.access(entry, os.W_OK):
        return  # compiled, or a cache this user cannot write (the audit compiles as before)
    tmp = entry / f".{MANIFEST}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({**manifest, "bytecode": compile_site(entry / SITE)},
                                  indent=1, sort_keys=True))
        os.replace(tmp, entry / MANIFEST)
    except OSError:
        tmp.unlink(missing_ok=True)


def install_framework(name: str, version: str, requirements: Sequence[str], *,
                      offline: bool = False, cache_dir: Path | str | None = None,
                      pip_args: Sequence[str] = ()) -> Path:
    """The ``site/`` folder holding ``requirements`` for framework ``name`` ``version``,
    installed on first use (and again when the entry is damaged or stale).

    Args:
        requirements: pip requirement strings (pinned), installed with ``--no-deps``.
        offline: use only the cache; a missing or damaged entry is an error saying what to run.
        cache_dir: cache base (default ``$DFLASH_AUDIT_CACHE`` / ``~/.cache/dflash-audit``).
        pip_args: extra pip arguments (e.g. ``--no-index --find-links DIR``).

    Returns:
        ``<cache>/frameworks/<name>-<version>/site`` (put it on the candidate's PYTHONPATH).

    Raises:
        FrameworkInstallError: offline without a usable entry; a local requirement that is
            no regular file; the cache cannot be written; pip failed or timed out.
    """
    entry = frameworks_cache(cache_dir) / f"{name}-{version}"
    try:
        return _install(name, version, requirements, entry, offline, pip_args)
    except OSError as exc:  # an unwritable or unreadable cache (another user's ~/.cache)
        raise FrameworkInstallError(
            f"cannot write the tool's cache for {name} {version} ({entry}: "
            f"{exc.strerror or exc}): set ${CACHE_ENV} to a folder you can write") from None


def _install(name: str, version: str, requirements: Sequence[str], entry: Path,
             offline: bool, pip_args: Sequence[str]) -> Path:
    """:func:`install_framework` into the cache entry ``entry`` (OSError passes through)."""
    digests = local_digests(requirements)  # before anything: a FIFO must not reach pip
    problems = entry_problems(entry, requirements) if entry.exists() else ["not installed"]
    if not problems:
        _compile_once(entry)
        return entry / SITE
    command = shlex.join(pip_command(requirements, entry / SITE, pip_args))
    if offline:
        raise FrameworkInstallError(
            f"offline, and {name} {version} is not usable in the tool's cache ({entry}: "
            f"{'; '.join(problems[:3])}). Run once without --offline (the tool installs it "
            f"there with `{command}`), or drop --offline.")
    if problems != ["not installed"]:
        print(f"dflash-audit: the cached {name} {version} in {entry} is "
              f"{'; '.join(problems[:3])}; installing it again", file=sys.stderr)
    if not requirements:
        raise FrameworkInstallError(f"the {name} adapter declares no REQUIREMENTS to install")
    print(f"dflash-audit: installing {name} {version} into the tool's cache ({entry}; once): "
          f"{', '.join(requirements)}", file=sys.stderr)
    with atomic_folder(entry) as tmp:
        cmd = pip_command(requirements, tmp / SITE, pip_args)
        from dflash_audit.limits import LimitError, exceeded, limit_s

        try:
            timeout = limit_s(PIP_TIMEOUT_S, PIP_TIMEOUT_ENV)
        except LimitError as exc:
            raise FrameworkInstallError(str(exc)) from None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise FrameworkInstallError(
                exceeded(f"installing {name} {version} (`{command}`)", timeout, PIP_TIMEOUT_ENV)
                + "; or check that the package index is reachable") from None
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            raise FrameworkInstallError(
                f"installing {name} {version} into the tool's cache failed (`{command}` exit "
                f"{proc.returncode}):\n{tail}\nCheck that the package "
                "index is reachable, or install the framework into an environment of yours "
                "and pass --candidate-python PATH")
        (tmp / MANIFEST).write_text(json.dumps({
            "requirements": list(requirements), "local_files": digests,
            "python": sys.version.split()[0],
            "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": site_manifest(tmp / SITE), "bytecode": compile_site(tmp / SITE)},
            indent=1, sort_keys=True))
    return entry / SITE
