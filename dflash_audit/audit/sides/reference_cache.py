"""The reference cache of one audit: the reference's outputs of identical cases, kept in the
tool's cache as signed records (:mod:`.reference_records`), so a warm audit of the same
reference on the same cases runs only the candidate and the checks.

Records are read and verified into memory before any candidate code runs (a candidate
without a sandbox that writes one then affects no verdict of its own audit, and what it
changed in the cache meanwhile is discarded: :meth:`ReferenceCache.watch`); a record that is
not trusted (a changed byte, signed elsewhere or by hand, another case's record moved into
place, a missing file) is ignored, removed and recomputed, so a record never decides a
verdict that the reference's own run would not have given. The restored files go through the
same check as a fresh run's (:func:`dflash_audit.audit.sides.integrity.
reference_output_changes`), the reference runs on the other cases only
(:func:`dflash_audit.audit.sides.run_sides.run_reference_on`), and their verified outputs are stored
(:func:`finish_reference_cache`). The records' folder is hidden from the candidate's sandbox
(:func:`.reference_records.record_dirs`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_audit.audit.sides.reference_records import (
    MAX_BYTES,
    Record,
    case_fields,
    code_fields,
    environment_fields,
    prune,
    read_record,
    record_dirs,
    record_key,
    records_root,
    stat_signature,
    touch,
    write_record,
)

if TYPE_CHECKING:
    from dflash_audit.audit.options import CompareOptions
    from dflash_audit.audit.progress import Stages

#: The folder of the subset of cases the reference runs on when others come from the cache.
SUBSET_DIR = ".reference-run"
#: The cache's report entry, written into the cases folder (:func:`finish_reference_cache`).
CACHE_SUMMARY = "reference-cache.json"


@dataclass
class ReferenceCache:
    """The reference cache of one audit.

    ``read``: use trusted records (``--no-reference-cache``: False; the reference then runs
    on every case and its verified outputs replace the records). ``keys``: each case's
    record key; ``hits``: the records read for cases; ``ignored``: ``{case: why}`` for
    records found and not trusted (removed); ``note``: why the cache was not used at all.
    """

    read: bool
    report_key: bytes | None = None
    root: Path | None = None
    keys: dict[str, str] = field(default_factory=dict)
    hits: dict[str, Record] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    stored: list[str] = field(default_factory=list)
    note: str = ""
    _watched: dict[Path, dict[str, str]] | None = None

    @classmethod
    def open(cls, read: bool) -> ReferenceCache:
        """The cache of this run (:func:`records_root`, registered in
        :func:`.reference_records.record_dirs`), with the report key read now (before any
        candidate code runs); unusable (with a ``note``) when the key cannot be read."""
        from dflash_audit.report.fingerprint import report_key

        try:
            key = report_key(create=True)
        except OSError as exc:
            return cls(read=False, note=f"the reference cache is off: {exc}")
        record_dirs()  # this cache's folder registered: watched by later audits too
        return cls(read=read, report_key=key, root=records_root())

    def lookup(self, cases_dir: Path, names: list[str], digests: dict[str, str],
               identity: Any, reference_code: dict[str, str], device: str,
               threads: int) -> None:
        """Compute each case's key and, when reading, load its trusted record into memory
        (:attr:`hits`); untrusted ones are removed and named in :attr:`ignored`."""
        if self.report_key is None or self.root is None:
            return
        code = code_fields(reference_code)
        environment = environment_fields(device, threads)
        for name in names:
            try:
                fields = case_fields(cases_dir, name, digests)
            except (OSError, ValueError):
                continue  # no key: this case is neither read nor stored
            key = self.keys[name] = record_key(code, environment, fields,
                                               str(identity.source_dir))
            if not self.read:
                continue
            record, why = read_record(self.root / key, key, self.report_key,
                                      "derive" in fields)
            if record is not None:
                self.hits[name] = record
                touch(self.root / key)
            elif why:
                self.ignored[name] = why
                shutil.rmtree(self.root / key, ignore_errors=True)

    def watch(self) -> None:
        """Take a stat signature of the records of every records folder the sandbox hides
        (:func:`.reference_records.record_dirs`: this cache's, the default cache's, those of
        earlier audits with other caches), before a candidate without a sandbox runs, which
        can sign records with any of their keys; :meth:`discard_changed` removes what
        changed meanwhile."""
        if self.root is not None:
            self._watched = {root: stat_signature(root)
                             for root in dict.fromkeys([self.root, *record_dirs()])}

    def discard_changed(self) -> list[str]:
        """Remove every record whose files changed, appeared or vanished since :meth:`watch`
        in any of the watched folders (written by the candidate, or by another audit at the
        same time: recomputed when next needed); returns their keys. This audit's own hits
        were read before."""
        if self.root is None or self._watched is None:
            return []
        changed = set()
        for root, before in self._watched.items():
            now = stat_signature(root)
            for key in {k.split("/", 1)[0] for k in before.keys() | now.keys()
                        if before.get(k) != now.get(k)}:
                changed.add(key)
                target = root / key
                if target.is_symlink() or target.is_file():
                    target.unlink(missing_ok=True)
                else:
                    shutil.rmtree(target, ignore_errors=True)
        self._watched = None
        return sorted(changed)

    def restore(self, cases_dir: Path) -> str:
        """Write the hits' files into their case folders; returns the lines the adapter
        would have printed for them (``{"dflash_audit_outputs": case, "sha256": {...}}``),
        for :func:`dflash_audit.audit.sides.integrity.reference_output_changes`."""
        lines = []
        for name, record in self.hits.items():
            for file, data in record.files.items():
                path = cases_dir / name / file
                path.unlink(missing_ok=True)  # a new file, never through a planted link
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            lines.append(json.dumps({"dflash_audit_outputs": name, "sha256": record.digests}))
        return "\n".join(lines)

    def reference_facts(self) -> dict[str, Any] | None:
        """``reference.json``'s facts (``module_file``, ``version``) from a hit, None when
        there is none."""
        for record in self.hits.values():
            if record.reference:
                return dict(record.reference)
        return None

    def store(self, cases_dir: Path, names: list[str], reference: dict[str, Any]) -> None:
        """Store the verified outputs of the cases ``names`` (computed by this audit's
        reference run) as records (a record that cannot be written is skipped), then keep the
        records within :data:`.reference_records.MAX_BYTES`."""
        if self.report_key is None or self.root is None:
            return
        facts = {k: reference.get(k) for k in ("module_file", "version")}
        for name in names:
            key = self.keys.get(name)
            if key is None or not (cases_dir / name / "outputs.json").is_file():
                continue
            try:
                write_record(self.root / key, key, cases_dir / name, facts, self.report_key)
            except OSError:
                continue
            self.stored.append(name)
        prune(self.root, MAX_BYTES)

    def summary(self, names: list[str]) -> dict[str, Any]:
        """The report's ``reference.cache`` entry: whether records were read, the id of the
        key they were checked against, per case where its outputs came from (``"cache"`` or
        ``"run"``) and its record key, the records ignored and why."""
        from dflash_audit.report.fingerprint import key_id

        cases = {name: {"outputs": "cache" if name in self.hits else "run",
                        "record": self.keys.get(name)} for name in names}
        return {"read": self.read, "key_id": key_id(self.report_key) if self.report_key
                else None, "from_cache": sum(name in self.hits for name in names),
                "cases": cases, "ignored": dict(self.ignored), "note": self.note}


def open_reference_cache(opts: CompareOptions, identity: Any, cases_dir: Path,
                         names: list[str], digests: dict[str, str], threads: int,
                         reference_code: dict[str, str] | None, st: Stages) -> ReferenceCache:
    """The audit's :class:`ReferenceCache`, its records of the cases
    ``names`` read and verified now (before any candidate code runs; not with
    ``--no-reference-cache``), watched while a candidate without a sandbox runs."""
    from dflash_audit.audit.sides.integrity import reference_code_digest
    from dflash_audit.audit.sides.sandbox import sandbox_status

    start = time.perf_counter()
    cache = ReferenceCache.open(read=opts.reference_cache)
    code = reference_code if reference_code is not None else reference_code_digest(identity)
    cache.lookup(cases_dir, names, digests, identity, code, opts.device, threads)
    for name, why in cache.ignored.items():
        st.say(f"the cached reference outputs of {name} were ignored ({why}); recomputed")
    if cache.hits:
        st.say(f"the reference's outputs of {len(cache.hits)} of {len(names)} cases are in "
               "the cache (verified records; --no-reference-cache recomputes them)")
    if not sandbox_status().available:
        cache.watch()
    st.timing["reference_cache"] = time.perf_counter() - start
    return cache


def finish_reference_cache(cache: ReferenceCache, cases_dir: Path, names: list[str],
                           computed: list[str]) -> None:
    """After the reference's outputs were verified: store the ``computed`` ones as records,
    write ``reference.json`` from a record when the reference did not run, and the cache's
    report entry into ``cases_dir/`` :data:`CACHE_SUMMARY`."""
    ran = cases_dir / "reference.json"
    facts: dict[str, Any] = {}
    if ran.is_file():
        try:
            facts = json.loads(ran.read_text())
        except ValueError:
            facts = {}  # named by the report's reading of it
    if computed and isinstance(facts, dict):
        cache.store(cases_dir, computed, facts)
    if not computed and cache.reference_facts() is not None:
        ran.write_text(json.dumps({**cache.reference_facts(), "cases": len(names)}))
    (cases_dir / CACHE_SUMMARY).write_text(json.dumps(cache.summary(names)))
