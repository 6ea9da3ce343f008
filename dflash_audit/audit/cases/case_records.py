"""The built cases of an audit kept in the tool's cache: a warm audit of the same profile,
options, verifier and data on the same tool and libraries reads them instead of building them
again (the drafter weights' initialisation and fit, the synthetic spread: ~10 s).

A record is a signed record (:mod:`dflash_audit.audit.sides.signed_records`, kind
:data:`KIND`) under ``<cache>/case-records/<key>/``, a folder the candidate's sandbox hides
(:func:`dflash_audit.audit.sides.reference_records.record_dirs`): ``cases.safetensors`` (every
case's inputs and weights; a weight equal to the verifier's frozen one, which the batch cache
holds, is named instead of stored) and ``cases.json`` (each case's config, loss, verifier,
kind and layout facts, and the report's ``inputs`` entries the cases stage adds). Its key
(:func:`cases_key`) covers everything that determines the cases: the options and the profile
that shape them, the real batches' cache key and the verifier's folder and ``config.json``,
a framework's capabilities, dflash-audit's source, the interpreter and library versions, the
device and thread count. A record that is not trusted is removed and the cases built again;
without a sandbox one that changed after this audit started (:class:`~dflash_audit.audit.sides.
signed_records.RecordsWatch`, taken before any candidate code ran) is not read either. A
read record builds the very cases a fresh build gives: the same files are written for both
sides.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dflash_audit.audit.sides.signed_records import (
    RecordsWatch,
    canonical,
    drop,
    prune,
    read_or_drop,
    read_signed,
    sha,
    write_signed,
)

KIND = "cases"
TENSORS_FILE, META_FILE = "cases.safetensors", "cases.json"
#: The most the case records may hold (the least recently used are removed past it).
MAX_BYTES = 1 << 30


def cases_key(fields: dict[str, Any], code: dict[str, str], environment: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of what shapes the cases (``fields``), the tool's
    source (``code``: the ``dflash_audit/`` entries of a :func:`dflash_audit.audit.sides.
    integrity.tool_digest`, without bytecode) and :func:`dflash_audit.audit.sides.
    reference_records.environment_fields`."""
    source = {k: v for k, v in code.items()
              if k.startswith("dflash_audit/") and "/__pycache__/" not in k}
    return sha(canonical({"kind": KIND, "fields": fields, "code": source,
                          "environment": environment}))


def _frozen_name(tensor: Any, key: str, frozen: dict[str, Any]) -> str | None:
    import torch

    ref = frozen.get(key)
    if ref is None or ref.shape != tensor.shape or ref.dtype != tensor.dtype:
        return None
    return key if ref is tensor or torch.equal(ref, tensor) else None


def encode(planned: list[Any], info: dict[str, Any], frozen: dict[str, Any]
           ) -> dict[str, bytes]:
    """The record's files of ``planned`` (:class:`~dflash_audit.audit.cases.plan.PlannedCase`)
    and the cases stage's report entries ``info``; dicts of tensors shared between cases are
    stored once."""
    from safetensors.torch import save

    tensors, groups, refs, cases = {}, {}, {}, []

    def group(d: dict[str, Any], weights: bool) -> str:
        if id(d) not in groups:
            name = groups[id(d)] = f"g{len(groups)}"
            for k, v in d.items():
                ref = _frozen_name(v, k, frozen) if weights else None
                if ref is not None:
                    refs.setdefault(name, {})[k] = ref
                else:
                    tensors[f"{name}/{k}"] = v.detach().contiguous().clone()
            refs.setdefault(name, {})
        return groups[id(d)]

    for p in planned:
        c = p.case
        v = c.verifier
        cases.append({
            "name": c.name, "kind": p.kind, "layout": p.layout, "config": c.config.to_dict(),
            "loss": dataclasses.asdict(c.loss), "description": c.description, "dtype": c.dtype,
            "device": c.device, "tolerances": c.tolerances, "unsupported": list(c.unsupported),
            "inputs": group(c.inputs, False), "weights": group(c.weights, True),
            "verifier": None if v is None else {
                "name": v.name, "config": v.config_dict(), "folder": v.folder,
                "target_layers": v.target_layers}})
    meta = {"cases": cases, "info": info, "frozen": refs,
            "keys": {g: sorted(k[len(g) + 1:] for k in tensors if k.startswith(g + "/"))
                     for g in groups.values()}}
    return {TENSORS_FILE: save(tensors),
            META_FILE: json.dumps(meta, default=str).encode()}


def decode(files: dict[str, bytes], frozen: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The planned cases and report entries of a record's files (:func:`encode`'s inverse).

    Raises:
        KeyError, ValueError, TypeError: the files do not hold what :func:`encode` wrote, or
            a frozen weight they name is not in ``frozen``.
    """
    from safetensors.torch import load

    from dflash_audit.audit.case import Case, CaseVerifier
    from dflash_audit.audit.cases.plan import PlannedCase
    from dflash_audit.model.config import DFlashConfig
    from dflash_audit.model.loss import LossSpec

    tensors = load(files[TENSORS_FILE])
    meta = json.loads(files[META_FILE])
    dicts = {}
    for g, keys in meta["keys"].items():
        dicts[g] = {k: tensors[f"{g}/{k}"] for k in keys}
        dicts[g].update({k: frozen[ref].clone() if k != "embed_tokens.weight" else frozen[ref]
                         for k, ref in meta["frozen"].get(g, {}).items()})
    planned = []
    for c in meta["cases"]:
        v = c["verifier"]
        verifier = None if v is None else CaseVerifier(
            name=v["name"], config=SimpleNamespace(**v["config"]), folder=v["folder"],
            target_layers=v["target_layers"])
        case = Case(name=c["name"], config=DFlashConfig.from_dict(c["config"]),
                    loss=LossSpec(**c["loss"]), inputs=dicts[c["inputs"]],
                    weights=dicts[c["weights"]], description=c["description"],
                    verifier=verifier, dtype=c["dtype"], device=c["device"],
                    tolerances=c["tolerances"], unsupported=list(c["unsupported"]))
        planned.append(PlannedCase(case, c["kind"], c["layout"]))
    return planned, dict(meta["info"])


@dataclass
class CaseCache:
    """The case records of one audit. ``read``: use a trusted record (``--no-reference-cache``:
    False; the cases are built and their record replaced). ``key``: the record's key once
    computed; ``hit``: the cases came from it; ``ignored``: why a record found was not
    trusted; ``note``: why the cache is off; ``watch``: without a sandbox, the records as
    they were before any candidate code ran (only those are trusted)."""

    read: bool
    report_key: bytes | None = None
    root: Path | None = None
    code: dict[str, str] = dataclasses.field(default_factory=dict)
    key: str | None = None
    hit: bool = False
    ignored: str = ""
    note: str = ""
    watch: RecordsWatch | None = None

    @classmethod
    def open(cls, read: bool, code: dict[str, str], watch: RecordsWatch | None = None
             ) -> CaseCache:
        """This run's case records (``code``: the tool's digest taken before any candidate
        code ran), with the report key read now; ``watch``: without a sandbox, taken before
        any candidate code ran (:func:`dflash_audit.audit.sides.reference_cache.
        watch_records`): a record that changed since is not trusted."""
        from dflash_audit.audit.sides.reference_records import CASES_DIR, records_root
        from dflash_audit.report.fingerprint import report_key

        try:
            key = report_key(create=True)
        except OSError as exc:
            return cls(read=False, note=f"the case records are off: {exc}")
        return cls(read=read, report_key=key, root=records_root(CASES_DIR), code=code,
                   watch=watch)

    def lookup(self, fields: dict[str, Any], environment: dict[str, Any],
               frozen: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
        """Set :attr:`key` and return the cases and report entries of a trusted record (None:
        build them)."""
        if self.report_key is None or self.root is None:
            return None
        self.key = cases_key(fields, self.code, environment)
        folder = self.root / self.key
        if not self.read:
            return None
        files, self.ignored = read_or_drop(folder, self.key, self.report_key,
                                           {TENSORS_FILE, META_FILE}, KIND, self.watch)
        if files is None:
            return None
        try:
            found = decode(files, frozen)
        except (KeyError, ValueError, TypeError) as exc:
            self.ignored = f"it does not hold cases ({exc})"
            return None
        self.hit = True
        return found

    def store(self, planned: list[Any], info: dict[str, Any], frozen: dict[str, Any]) -> None:
        """Store the built cases as the record :attr:`key` (skipped when it cannot be
        written), then keep the records within :data:`MAX_BYTES`."""
        if self.report_key is None or self.root is None or self.key is None:
            return
        folder, files = self.root / self.key, encode(planned, info, frozen)
        try:
            write_signed(folder, self.key, files, {}, self.report_key, KIND)
        except OSError:
            return
        if self.watch is not None:  # the candidate's process runs meanwhile: kept only as
            self.watch.own(folder)  # written (a later change is discarded after its run)
            found, _ = read_signed(folder, self.key, self.report_key, set(files), KIND,
                                   self.watch)
            if found is None or found[0] != files:
                drop(folder)
                return
        prune(self.root, MAX_BYTES)

    def summary(self) -> dict[str, Any]:
        """The report's ``inputs.case_cache`` entry."""
        return {"read": self.read, "from_cache": self.hit, "record": self.key,
                "ignored": self.ignored, "note": self.note}
