"""``--candidate framework:NAME[==VERSION]``: which adapter audits which framework, at which
pinned version, and how its candidate process starts.

Spec forms (after ``framework:``):

- ``NAME`` / ``NAME==VERSION``: the adapter module ``dflash_audit/audit/frameworks/
  <NAME>_adapter.py`` (any module there that defines the contract's ``NAME``, ``VERSION``
  and ``REQUIREMENTS`` as literals plugs in; they are read from its source, never imported
  here); VERSION must be the adapter's pinned one. Its REQUIREMENTS are installed into the
  tool's cache (:mod:`.install`) and that folder goes on the candidate's path.
- ``speculators@REF`` / ``speculators==X.Y.Z`` / ``speculators:path:DIR`` (or
  ``path:DIR``): the reference's own code at another ref or release as the candidate
  (:mod:`.speculators_adapter`), its source resolved and cached as ``--ref`` does.

An adapter in development (``$DFLASH_AUDIT_ADAPTER_PATH``) never passes for a built-in
framework: one that takes a built-in's key or name is refused (:func:`impersonation`).

Errors (unknown name, unsupported version, an adapter not in this build, an interpreter that
cannot run the candidate, an external adapter with a built-in's name) are
:class:`FrameworkError`, a setup error (exit 2) naming the choices.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.audit.sides.launch import CandidateLaunch

PREFIX = "framework:"
FOLDER = Path(__file__).resolve().parent
SUFFIX = "_adapter.py"
ADAPTER_PATH_ENV = "DFLASH_AUDIT_ADAPTER_PATH"
#: Frameworks this project audits, with their pinned versions: named in the choices even when
#: their adapter module is not in this build.
KNOWN: dict[str, tuple[str, str]] = {
    "specforge": ("SpecForge", "0.2.0"),
    "modelopt": ("NVIDIA ModelOpt", "0.47.0"),
    "zlab": ("z-lab dflash", "0.1.0"),
    "nemo": ("NeMo Automodel", "0.7.0"),
}
SPECULATORS = "speculators"
SPECULATORS_FORMS = ("speculators@REF", "speculators==X.Y.Z", "speculators:path:DIR")


class FrameworkError(CompareSetupError):
    """A ``framework:`` spec that cannot be audited here (exit 2); the message says why and
    names the choices."""


@dataclass(frozen=True)
class FrameworkSpec:
    """A parsed ``framework:`` spec: ``key`` (the adapter's file-name prefix), ``version``
    (asked for, or None: the pinned one) and, for speculators, ``ref`` (a ``--ref``-style
    spec: ``speculators@main``, ``speculators==0.9.0``, ``path:DIR``, None: the lock's)."""

    key: str
    version: str | None = None
    ref: str | None = None
    text: str = ""


def is_framework_spec(spec: str | None) -> bool:
    """Whether a ``--candidate`` value names a framework."""
    return bool(spec) and spec.startswith(PREFIX)


def parse_framework_spec(spec: str) -> FrameworkSpec:
    """Split ``framework:...`` into a :class:`FrameworkSpec` (see the module docstring).

    Raises:
        FrameworkError: nothing after ``framework:``, or an empty version / ref.
    """
    body = spec[len(PREFIX):].strip() if spec.startswith(PREFIX) else spec.strip()
    if body.startswith("path:"):
        body = f"{SPECULATORS}:{body}"
    if body == SPECULATORS or body.startswith((f"{SPECULATORS}@", f"{SPECULATORS}==",
                                               f"{SPECULATORS}:")):
        rest = body[len(SPECULATORS):]
        ref = None if not rest else (rest[1:] if rest.startswith(":") else SPECULATORS + rest)
        if ref in ("", f"{SPECULATORS}@", f"{SPECULATORS}=="):
            raise FrameworkError(f"--candidate {spec}: empty ref; use one of "
                                 f"{', '.join(PREFIX + f for f in SPECULATORS_FORMS)}")
        return FrameworkSpec(SPECULATORS, ref=ref, text=spec)
    key, sep, version = body.partition("==")
    key = key.strip().lower()
    if not key or (sep and not version.strip()):
        raise FrameworkError(f"--candidate {spec!r}: expected framework:NAME[==VERSION]; "
                             f"choices: {choices_text()}")
    return FrameworkSpec(key, version.strip() or None, text=spec)


def adapter_constants(path: Path) -> dict[str, Any]:
    """The literal module-level constants (NAME, VERSION, REQUIREMENTS, ...) of an adapter
    module, read from its source with :mod:`ast` (the framework it imports is not
    importable in this process). Values that are not literals are left out."""
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        targets = ([node.target] if isinstance(node, ast.AnnAssign) and node.value is not None
                   else node.targets if isinstance(node, ast.Assign) else [])
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper():
                try:
                    out[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return out


def adapter_folders() -> list[Path]:
    """Where adapter modules are looked for: this package, then the folders of
    ``$DFLASH_AUDIT_ADAPTER_PATH`` (os.pathsep-separated; an adapter in development, run as
    top-level module ``<key>_adapter`` with its folder on the candidate's path)."""
    extra = [Path(p).expanduser() for p in os.environ.get(ADAPTER_PATH_ENV, "").split(
        os.pathsep) if p.strip()]
    return [FOLDER, *extra]


def available_adapters() -> dict[str, dict[str, Any]]:
    """``{key: constants}`` of every ``<key>_adapter.py`` of :func:`adapter_folders` that
    defines NAME and VERSION (the speculators adapter included; this package's first), with
    ``path`` and ``module`` (its import name) added."""
    out: dict[str, dict[str, Any]] = {}
    for folder in adapter_folders():
        for path in sorted(folder.glob(f"*{SUFFIX}")):
            key = path.name[: -len(SUFFIX)]
            constants = adapter_constants(path)
            if key in out or "NAME" not in constants or "VERSION" not in constants:
                continue
            module = (f"dflash_audit.audit.frameworks.{key}_adapter" if folder == FOLDER
                      else f"{key}_adapter")
            out[key] = {**constants, "path": str(path), "module": module,
                        "folder": None if folder == FOLDER else str(folder)}
    return out


def choices_text() -> str:
    """Every framework spec this build accepts, and the known ones it lacks."""
    found = available_adapters()
    parts = [f"{key}=={c['VERSION']} ({c['NAME']})" for key, c in found.items()
             if key != SPECULATORS]
    parts += [f"{key}=={version} ({name}; not available in this build)"
              for key, (name, version) in KNOWN.items() if key not in found]
    return ", ".join([*(PREFIX + p for p in parts), " | ".join(
        PREFIX + f for f in SPECULATORS_FORMS) + " (the reference at another ref or release)"])


def _normal(text: str) -> str:
    """``text`` as compared for impersonation: lower case, letters and digits only."""
    return re.sub(r"[^0-9a-z]", "", str(text).casefold())


def _word_runs(text: str) -> set[str]:
    """Every run of consecutive words of ``text`` (split at anything but letters and digits,
    and between a digit and a letter), each run :func:`_normal`-ised: "NVIDIA NeMo
    Automodel" gives "nemo", "nemoautomodel", "nvidianemo", ...; "Mnemonic" only itself."""
    words = re.findall(r"[a-z]+|[0-9]+", str(text).casefold())
    return {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}


#: The longest NAME or VERSION an adapter may declare (characters).
MAX_LABEL = 80


def _label_text(value: Any) -> bool:
    """Whether ``value`` can be a NAME / VERSION: one short line of printable text."""
    text = str(value)
    return bool(text.strip()) and text.isprintable() and len(text) <= MAX_LABEL


def builtin_frameworks() -> tuple[set[str], list[str]]:
    """``(keys, names)`` of the built-in frameworks: every adapter of this package (the
    speculators one included) and every :data:`KNOWN` one, whether in this build or not;
    the names include the keys."""
    paths = sorted(FOLDER.glob(f"*{SUFFIX}"))
    keys = {p.name[: -len(SUFFIX)] for p in paths} | set(KNOWN) | {SPECULATORS}
    names = [str(adapter_constants(p).get("NAME", "")) for p in paths]
    names += [name for name, _ in KNOWN.values()] + sorted(keys)  # "ModelOpt" too
    return keys, sorted({n for n in names if _normal(n)})


def impersonation(key: str, name: Any, version: Any) -> str | None:
    """Why an external adapter (``$DFLASH_AUDIT_ADAPTER_PATH``) with file key ``key``,
    ``NAME`` and ``VERSION`` would pass for a built-in framework in a report: it takes a
    built-in's key, or a built-in's name is a run of whole words of its label (``NAME
    VERSION``; case, spaces and punctuation ignored: ``Spec Forge``, ``SpecForge 0.2.0``,
    ``NVIDIA NeMo Automodel``, ``My SpecForge``, but not ``Mnemonic``); None when not."""
    keys, names = builtin_frameworks()
    if key in keys:
        return f"its file {key}{SUFFIX} takes the key of the built-in framework {key!r}"
    label = _normal(f"{name}{version}")
    runs = _word_runs(f"{name} {version}")
    for builtin in names:
        if label.startswith(_normal(builtin)) or _normal(builtin) in runs:
            return (f"its label {f'{name} {version}'.strip()!r} (NAME, VERSION) takes the name "
                    f"of the built-in framework {builtin!r}")
    return None


def _impersonation_error(path: Any, why: str) -> FrameworkError:
    return FrameworkError(
        f"the adapter {path} (from ${ADAPTER_PATH_ENV}) cannot be audited: {why}, so its report "
        "would pass for the built-in framework's. Give it a file name and a NAME of its own "
        "(e.g. NAME = \"MyFramework\" in myframework_adapter.py), or remove it from "
        f"${ADAPTER_PATH_ENV} to audit the built-in one")


def lookup(fs: FrameworkSpec) -> dict[str, Any]:
    """The constants of the adapter for ``fs``, its version checked.

    Raises:
        FrameworkError: unknown framework, adapter not in this build, version not pinned; an
            external adapter that takes a built-in framework's key or name
            (:func:`impersonation`), or an external ``<key>_adapter.py`` beside the built-in
            ``fs.key`` (which one runs would not be clear).
    """
    for folder in adapter_folders()[1:]:
        shadow = folder / f"{fs.key}{SUFFIX}"
        if fs.key in builtin_frameworks()[0] and shadow.is_file():
            raise _impersonation_error(shadow, impersonation(fs.key, "", ""))
    found = available_adapters()
    if fs.key not in found:
        if fs.key in KNOWN:
            name, version = KNOWN[fs.key]
            raise FrameworkError(
                f"--candidate {fs.text}: {name} {version} is not available in this build (its "
                f"adapter {FOLDER / (fs.key + SUFFIX)} is missing); choices: {choices_text()}")
        raise FrameworkError(f"--candidate {fs.text}: unknown framework {fs.key!r}; choices: "
                             f"{choices_text()}")
    constants = found[fs.key]
    why = constants.get("folder") and impersonation(fs.key, constants["NAME"],
                                                    constants["VERSION"])
    if why:
        raise _impersonation_error(constants["path"], why)
    if fs.version is not None and fs.version != str(constants["VERSION"]):
        raise FrameworkError(
            f"--candidate {fs.text}: {constants['NAME']} {fs.version} is not supported; its "
            f"adapter is pinned to {constants['VERSION']} (--candidate "
            f"{PREFIX}{fs.key}=={constants['VERSION']})")
    return constants


def framework_launch(spec: str, *, python: str | None = None, offline: bool = False,
                     url: str | None = None, cache_dir: Path | None = None) -> CandidateLaunch:
    """How to start the candidate process for ``--candidate framework:...``: the adapter
    module as the candidate, with the framework on its path -- the speculators tree resolved
    like ``--ref`` (``url``: the git URL of ``speculators@REF``), else the framework's
    REQUIREMENTS installed into the tool's cache (not with ``python``: that interpreter has
    the framework installed already).

    Raises:
        FrameworkError: a bad spec, an unknown framework or version, an install or a source
            that cannot be had (offline: what to run), an interpreter that cannot run it.
    """
    fs = parse_framework_spec(spec)
    constants = lookup(fs)
    module = constants["module"]
    info: dict[str, Any] = {"key": fs.key, "name": constants["NAME"], "spec": spec,
                            "version": str(constants["VERSION"]), "module": module}
    if constants.get("folder"):
        info["external"] = constants["path"]  # checked again on the names it loads with
    pythonpath: list[str] = [constants["folder"]] if constants.get("folder") else []
    env: dict[str, str] = {}
    if fs.key == SPECULATORS:
        from dflash_audit.audit.frameworks.speculators_source import (
            display_version,
            resolve_speculators,
        )

        identity, paths, env = resolve_speculators(fs.ref, url=url, offline=offline)
        pythonpath += paths
        info.update(version=display_version(identity), ref=fs.ref or identity.spec,
                    source=identity.to_dict())
    elif python is None:
        from dflash_audit.audit.frameworks.install import install_framework, local_requirements

        folder = install_framework(fs.key, info["version"], local_requirements(
                                   constants.get("REQUIREMENTS") or [],
                                   Path(constants["path"]).parent),
                                   offline=offline, cache_dir=cache_dir)
        pythonpath.append(str(folder))
        info["install"] = str(folder)
    else:
        info["install"] = f"--candidate-python {python}"
    return _checked(CandidateLaunch(spec=f"{module}:candidate", python=python,
                                    pythonpath=pythonpath, env=env, framework=info))


def _checked(launch: CandidateLaunch) -> CandidateLaunch:
    """``launch``, its ``--candidate-python`` interpreter checked (when one is given).

    Raises:
        FrameworkError: that interpreter cannot run the candidate (the reason named).
    """
    if launch.python is not None:
        from dflash_audit.audit.sides.launch import check_interpreter

        try:
            check_interpreter(launch)
        except ValueError as exc:
            raise FrameworkError(str(exc)) from None
    return launch


def check_candidate_spec(spec: str | None) -> None:
    """The checks of a ``--candidate`` value that need no install, no process and no torch,
    so a usage error answers at once: a framework or version this build has not
    (:func:`lookup`), a plain spec that cannot name a candidate
    (:func:`dflash_audit.candidate_spec.spec_problem`).

    Raises:
        FrameworkError: the spec names no candidate here (the message says why).
    """
    from dflash_audit.candidate_spec import spec_problem

    if is_framework_spec(spec):
        lookup(parse_framework_spec(spec))
    elif problem := spec_problem(spec):
        raise FrameworkError(problem)


def candidate_launch(spec: str | None, *, python: str | None = None, offline: bool = False,
                     url: str | None = None, cache_dir: Path | None = None) -> CandidateLaunch:
    """The launch of any ``--candidate`` value: a framework's (:func:`framework_launch`) or a
    plain ``module:attr`` / ``file.py:attr`` / None under ``python`` (None: this one).

    Raises:
        FrameworkError: see :func:`framework_launch`; ``python`` cannot run the candidate; a
            plain spec that cannot name one (:func:`dflash_audit.candidate_spec.spec_problem`).
    """
    if is_framework_spec(spec):
        return framework_launch(spec, python=python, offline=offline, url=url,
                                cache_dir=cache_dir)
    check_candidate_spec(spec)  # before any process starts: one line at once
    return _checked(CandidateLaunch(spec=spec, python=python))


def framework_facts(launch: CandidateLaunch, identity: dict[str, Any]) -> dict[str, Any] | None:
    """What the audit needs about the framework of ``launch`` once its candidate process has
    loaded the adapter (``identity``: the runner's ``candidate.json``, whose ``adapter`` holds
    the module's constants): ``label`` (``SpecForge 0.2.0``), ``provenance``,
    ``capabilities`` (:class:`Capabilities`), ``latent`` (its declared
    :class:`~.latent.LatentDifference` list, :mod:`.latent`) and the launch's facts; None for
    a plain candidate.

    Raises:
        FrameworkError: the module lacks NAME / VERSION, or its CAPABILITIES or LATENT are
            malformed; an
            external adapter loaded with a built-in framework's name (:func:`impersonation`).
    """
    from dflash_audit.audit.frameworks.capabilities import (
        Capabilities,
        CapabilitiesError,
        brief,
    )
    from dflash_audit.audit.frameworks.latent import parse_latent

    if launch.framework is None:
        return None
    info = dict(launch.framework)
    adapter = identity.get("adapter")
    if not isinstance(adapter, dict):
        raise FrameworkError(f"the adapter {info['module']} does not define the contract's "
                             "NAME and VERSION (dflash_audit/audit/frameworks/__init__.py)")
    if adapter.get("error"):  # its constants could not be handed over (candidate_runner)
        raise FrameworkError(f"the adapter {info['module']}: "
                             f"{' '.join(str(adapter['error']).split())[:400]}")
    for key in ("NAME", "VERSION"):  # printed in the terminal and every report
        value = adapter.get(key)
        if value is not None and not _label_text(value):
            raise FrameworkError(
                f"the adapter {info['module']}: NAME and VERSION must be one short line of "
                f"printable text (at most {MAX_LABEL} characters), got {key} = "
                f"{brief(value)}")
    try:
        caps = Capabilities.from_dict(adapter.get("CAPABILITIES"))
        latent = parse_latent(adapter.get("LATENT"), caps)
    except CapabilitiesError as exc:  # LatentError too
        raise FrameworkError(f"the adapter {info['module']}: {exc}") from None
    name = str(adapter.get("NAME") or info["name"])
    version = str(adapter.get("VERSION") or info["version"])
    why = info.get("external") and impersonation(info["key"], name, version)
    if why:  # its module may compute NAME at import: the names it loaded with count
        raise _impersonation_error(info["external"], why)
    provenance = adapter.get("PROVENANCE") or {}
    if not isinstance(provenance, dict) or any(
            v not in ("framework", "adapter") for v in provenance.values()):
        raise FrameworkError(f"the adapter {info['module']}: PROVENANCE must map output keys "
                             f"to 'framework' or 'adapter', got {provenance!r}")
    return {**info, "name": name, "version": version, "label": f"{name} {version}",
            "provenance": dict(provenance), "capabilities": caps, "latent": latent,
            "requirements": list(adapter.get("REQUIREMENTS") or [])}
