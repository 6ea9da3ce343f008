"""The serving engines ``serve-check`` audits, each at a pinned version, and how a probe of
one is started.

An engine is installed like a framework (:func:`~dflash_audit.audit.frameworks.install.
install_framework`: ``pip install --no-deps --target`` into ``<cache>/frameworks/
<key>-<version>/site``, verified on each use) and its probe
(``dflash_audit/serve/probes/<key>_probe.py``) runs in a process of its own with that folder
and this project on ``PYTHONPATH``; the probe writes a
:class:`~dflash_audit.serve.fields.SideRecord`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_audit.audit.setup_error import CompareSetupError
from dflash_audit.serve.fields import SideRecord
from dflash_audit.user_input import loads_json

PROBES = Path(__file__).resolve().parent / "probes"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_ENV = "DFLASH_AUDIT_PROBE_TIMEOUT"
PROBE_TIMEOUT_S = 600.0


class ServeCheckError(CompareSetupError):
    """A usage or setup error of ``serve-check`` (exit 2): bad checkpoint folder, unknown
    engine or version, an engine that cannot be installed, a probe that did not finish."""


@dataclass(frozen=True)
class Engine:
    """One engine adapter: ``key`` (``--engine``), display ``name``, pinned ``version``, pip
    ``requirements`` (installed with ``--no-deps``) and the probe script under ``probes/``
    (what it cannot run on this machine it says itself, in its record's ``not_run``)."""

    key: str
    name: str
    version: str
    requirements: tuple[str, ...]
    probe: str

    @property
    def label(self) -> str:
        """``vLLM 0.33.0``."""
        return f"{self.name} {self.version}"


ENGINES: dict[str, Engine] = {
    "vllm": Engine("vllm", "vLLM", "0.33.0", ("vllm==0.33.0",), "vllm_probe.py"),
    "sglang": Engine("sglang", "SGLang", "0.5.23", ("sglang==0.5.23",), "sglang_probe.py"),
    "zlab": Engine("zlab", "z-lab dflash", "0.1.0", ("dflash==0.1.0",), "zlab_probe.py"),
}


def resolve_engine(spec: str) -> Engine:
    """``vllm`` / ``vllm==0.33.0`` -> the :class:`Engine`.

    Raises:
        ServeCheckError: unknown engine, or a version other than the pinned one.
    """
    key, _, version = spec.strip().partition("==")
    engine = ENGINES.get(key.strip().lower())
    choices = ", ".join(f"{e.key} ({e.label})" for e in ENGINES.values())
    if engine is None:
        raise ServeCheckError(f"--engine {spec!r}: unknown engine; choose one of {choices}")
    if version and version.strip() != engine.version:
        raise ServeCheckError(f"--engine {spec!r}: this build audits {engine.label} only (its "
                              f"adapter is pinned to that version); use --engine {engine.key}")
    return engine


def install_engine(engine: Engine, *, offline: bool = False) -> Path:
    """The engine's site folder in the tool's cache, installed on first use.

    Raises:
        ServeCheckError: offline without an entry, or pip failed (the message says what to run).
    """
    from dflash_audit.audit.frameworks.install import FrameworkInstallError, install_framework

    try:
        return install_framework(engine.key, engine.version, list(engine.requirements),
                                 offline=offline)
    except FrameworkInstallError as exc:
        raise ServeCheckError(str(exc)) from None


def probe_timeout() -> float:
    """Seconds a probe may run: ``$DFLASH_AUDIT_PROBE_TIMEOUT``, else 600 scaled with the
    machine's load (:func:`dflash_audit.limits.limit_s`).

    Raises:
        ServeCheckError: a variable that is not a positive number.
    """
    from dflash_audit.limits import LimitError, limit_s

    try:
        return limit_s(PROBE_TIMEOUT_S, PROBE_TIMEOUT_ENV)
    except LimitError as exc:
        raise ServeCheckError(str(exc)) from None


def run_script(script: Path, args: list[str], site: Path | None, what: str,
               python: str | None = None) -> dict[str, Any]:
    """Run ``script ARGS OUT_JSON`` in a fresh process (the engine's ``site`` and this project
    on ``PYTHONPATH``, offline, in a temporary folder) and return the JSON it wrote to OUT.

    Args:
        what: who runs, for messages (``the vLLM 0.33.0 probe``).

    Raises:
        ServeCheckError: it did not finish in :func:`probe_timeout` (the message names the
            setting to raise), or exited without writing readable JSON (with the end of its
            output).
    """
    paths = [str(p) for p in ([site] if site else []) + [PROJECT_ROOT]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONNOUSERSITE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    timeout = probe_timeout()
    with tempfile.TemporaryDirectory(prefix="dflash-serve-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [python or sys.executable, str(script), *map(str, args), str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, cwd=tmp)
        except subprocess.TimeoutExpired:
            from dflash_audit.limits import exceeded

            raise ServeCheckError(exceeded(what, timeout, PROBE_TIMEOUT_ENV)) from None
        if out.is_file():
            try:
                return loads_json(out.read_text())
            except ValueError as exc:
                raise ServeCheckError(f"{what} wrote unreadable JSON ({exc})") from None
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise ServeCheckError(f"{what} failed (exit {proc.returncode}) without a record:\n"
                              f"{tail}")


def run_probe(script: Path, checkpoint: Path, site: Path | None, label: str,
              python: str | None = None) -> SideRecord:
    """Run the probe ``script CHECKPOINT OUT_JSON`` (:func:`run_script`) and read its record.

    Args:
        script: the probe (runs in the engine's or the reference's process).
        checkpoint: the drafter checkpoint folder.
        site: the engine's site folder (first on ``PYTHONPATH``), or None.
        label: who is probed, for messages (``vLLM 0.33.0``).
        python: the interpreter (default: this one).

    Raises:
        ServeCheckError: see :func:`run_script`; or a record that is not a SideRecord.
    """
    d = run_script(script, [str(checkpoint)], site, f"the {label} probe", python)
    try:
        return SideRecord.from_dict(d)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ServeCheckError(f"the {label} probe wrote an unreadable record "
                              f"({type(exc).__name__}: {exc})") from None
