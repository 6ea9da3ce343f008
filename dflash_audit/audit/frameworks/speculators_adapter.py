"""``--candidate framework:speculators@REF|==X.Y.Z|:path:DIR``: the reference's own DFlash code
at another ref or release as the candidate -- a behavioural diff between two versions of
speculators (what an upgrade changes in training).

Runs INSIDE the candidate's process, whose ``PYTHONPATH`` starts with the candidate tree's
``src/`` and whose ``$DFLASH_AUDIT_FRAMEWORK_SOURCE`` names it
(:mod:`.speculators_source`). It reuses the glue the reference side runs
(``reference/adapter.py``: ``train_step``, ``structure_summary``, ``api_defaults``,
``derive``), imported, not copied, so both sides drive speculators the same way and any
difference in the report is a difference between the two speculators trees. Everything is
computed by speculators' code (``PROVENANCE`` empty: no output is the adapter's).

Raises at import (the audit's setup error, exit 2): no source named, speculators imported from
elsewhere, or the tree lacks what the glue drives (``DFlashDraftModel._backbone_forward``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dflash_audit.audit.case import SideOutputs
from dflash_audit.audit.frameworks.speculators_source import (
    FRAMEWORK_SOURCE_ENV,
    FRAMEWORK_VERSION_ENV,
)
from dflash_audit.reference_source.identity import adapter_path

NAME = "speculators"
#: The version comes from the resolved tree (below); this literal is what the registry reads.
VERSION = "any ref or release"
#: Every output is computed by speculators' own code.
PROVENANCE: dict[str, str] = {}
#: The reference supports every case the audit builds.
CAPABILITIES: dict[str, Any] = {}
#: Nothing to pip install: the source comes from dflash_audit.reference_source.
REQUIREMENTS: list[str] = []


def _load_glue() -> Any:
    """``reference/adapter.py`` as a module (its sibling ``adapter_numerics`` importable)."""
    path = adapter_path()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("dflash_audit_reference_glue", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SOURCE = os.environ.get(FRAMEWORK_SOURCE_ENV)
if not SOURCE:
    raise ImportError(f"${FRAMEWORK_SOURCE_ENV} is not set: run this adapter through "
                      "`dflash-audit compare --candidate framework:speculators@REF`")
GLUE = _load_glue()
GLUE.ensure_distribution_metadata(Path(SOURCE))

import speculators  # noqa: E402 - from the candidate tree, after its metadata exists
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.dflash import core  # noqa: E402

if not Path(speculators.__file__).resolve().is_relative_to(Path(SOURCE).resolve()):
    raise ImportError(f"speculators was imported from {speculators.__file__}, not from the "
                      f"candidate tree {SOURCE}; uninstall the other copy")
if not hasattr(getattr(core, "DFlashDraftModel", None), "_backbone_forward"):
    raise ImportError(f"the speculators tree {SOURCE} has no DFlashDraftModel."
                      "_backbone_forward: the adapter cannot drive this ref")
#: As the parent resolved it (``0.9.0``, ``main@c05b95b``), else the tree's own.
VERSION = os.environ.get(FRAMEWORK_VERSION_ENV) or getattr(speculators, "__version__", None) \
    or "unknown"
#: The training CLI (``train/cli.py``) holds the derivation the glue runs; trees without it
#: (main@c05b95b) get no ``derive_config`` (the derivation check says "not provided").
HAS_DERIVATION = importlib.util.find_spec("speculators.train.cli") is not None


def FRAMEWORK_FILES() -> list[Path]:  # noqa: N802 - a contract name, like the constants
    """The files whose code the candidate runs: the tree's DFlash model, losses and metrics
    and the glue (hashed into the report's candidate fingerprint)."""
    root = Path(SOURCE) / "speculators"
    files = [p for sub in ("models/dflash", "losses") for p in sorted((root / sub).rglob("*.py"))]
    return [*files, *(root / f for f in ("models/metrics.py", "models/utils.py")
                      if (root / f).is_file()), adapter_path()]


def _verifier_folder(verifier_config: Any, work: Path) -> str:
    """A folder with the verifier's config.json: the one it was loaded from (its tokenizer
    resolves the mask token, as on the reference side), else ``work`` with the config."""
    folder = getattr(verifier_config, "_name_or_path", None) or getattr(
        verifier_config, "name_or_path", None)
    if folder and (Path(str(folder)) / "config.json").is_file():
        return str(folder)
    data = verifier_config.to_dict() if hasattr(verifier_config, "to_dict") else dict(
        vars(verifier_config))
    (work / "config.json").write_text(json.dumps(data, default=str))
    return str(work)


class SpeculatorsCandidate:
    """The candidate tree's ``DFlashDraftModel`` trained one step on a case, exactly as the
    reference side's adapter does it (``reference/adapter.py`` ``train_step``)."""

    name = f"speculators {VERSION} (framework:speculators)"

    def run_case(self, config: Any, loss: Any, weights: dict, inputs: dict) -> SideOutputs:
        """One step of the tree's model on the case: tensors [see dflash_audit.audit.case],
        metrics, structure and defaults from its own code (the case's autocast is the
        runner's)."""
        profile = {"drafter": config.to_dict(), "loss": dataclasses.asdict(loss)}
        with tempfile.TemporaryDirectory(prefix="dflash-audit-speculators-") as work:
            tensors, metrics, model, missing, unexpected = GLUE.train_step(
                Path(work), profile, inputs, weights, core, resolve_loss_config, None,
                inputs["input_ids"].device.type)
        return SideOutputs(
            tensors=tensors, metrics=metrics,
            structure=GLUE.structure_summary(model, missing, unexpected),
            trainable=[n for n, p in model.named_parameters() if p.requires_grad],
            defaults=GLUE.api_defaults(core),
            metadata={"provenance": dict(PROVENANCE), "speculators_version": VERSION})

    def select_anchors(self, loss_mask, max_anchors, block_size):
        """The tree's own sampler (``speculators.models.dflash.core.select_anchors``; global
        RNG, no generator): anchor_positions [A], anchor_valid [A]."""
        return core.select_anchors(loss_mask, max_anchors, block_size)


class SpeculatorsDerivingCandidate(SpeculatorsCandidate):
    """Also the tree's drafter-config derivation (the glue's ``derive``: its training CLI)."""

    def derive_config(self, verifier_config: Any, config: Any) -> dict[str, Any]:
        """The tree's derivation of a drafter config from ``verifier_config`` with the case's
        draft layout (flat dict, as the reference side's ``derivation.json``)."""
        types = config.effective_layer_types
        with tempfile.TemporaryDirectory(prefix="dflash-audit-verifier-") as work:
            return GLUE.derive(_verifier_folder(verifier_config, Path(work)),
                               config.num_hidden_layers, config.sliding_window or 2048,
                               tuple(i for i, t in enumerate(types) if t == "full_attention"))


candidate = SpeculatorsDerivingCandidate() if HAS_DERIVATION else SpeculatorsCandidate()
