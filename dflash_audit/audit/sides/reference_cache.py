"""The reference cache of one audit: the reference's outputs of identical cases, kept in the
tool's cache as signed records (:mod:`.reference_records`), so a warm audit of the same
reference on the same cases runs only the candidate and the checks.

Records are read and verified into memory before the candidate runs a case; an audit without
a sandbox, whose candidate's process (started before the cases are built) can read the report
key and sign records, trusts only records unchanged since before any candidate code ran, and
discards what changed meanwhile (:class:`.signed_records.RecordsWatch`); a record that is
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
    RecordsWatch,
    prune,
    read_record,
    record_dirs,
    record_key,
    records_root,
    touch,
    write_record,
)
from dflash_audit.audit.sides.signed_records import CHANGED, drop

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
    ``watch``: without a sandbox, the records as they were before any candidate code ran
    (only those are trusted; what changed is discarded after the candidate's run).
    """

    read: bool
    report_key: bytes | None = None
    root: Path | None = None
    keys: dict[str, str] = field(default_factory=dict)
    hits: dict[str, Record] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    stored: list[str] = field(default_factory=list)
    note: str = ""
    watch: RecordsWatch | None = None

    @classmethod
    def open(cls, read: bool, watch: RecordsWatch | None = None) -> ReferenceCache:
        """The cache of this run (:func:`records_root`, registered in
        :func:`.reference_records.record_dirs`), with the report key read now;
        unusable (with a ``note``) when the key cannot be read. ``watch``: taken before
        any candidate code ran, in an audit without a sandbox (:func:`watch_records`)."""
        from dflash_audit.report.fingerprint import report_key

        try:
            key = report_key(create=True)
        except OSError as exc:
            return cls(read=False, note=f"the reference cache is off: {exc}", watch=watch)
        record_dirs()  # this cache's folder registered: watched by later audits too
        return cls(read=read, report_key=key, root=records_root(), watch=watch)

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
                                      "derive" in fields, self.watch)
            if record is not None:
                self.hits[name] = record
                touch(self.root / key)
            elif why:
                self.ignored[name] = why
                if why != CHANGED:  # a changed one: removed after the candidate's run
                    drop(self.root / key)

    def discard_changed(self) -> list[str]:
        """Without a sandbox: remove every record that changed, appeared or vanished while
        the candidate could run (:meth:`.signed_records.RecordsWatch.discard_changed`);
        returns their keys."""
        return self.watch.discard_changed() if self.watch is not None else []

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
            if self.watch is not None:
                self.watch.own(self.root / key)
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


def watch_records(sandboxed: bool, extra: list[Path] | None = None) -> RecordsWatch | None:
    """Without a sandbox (``sandboxed`` False): every folder of records the sandbox would hide
    (:func:`.reference_records.record_dirs`: this cache's, the default cache's, those of
    earlier audits with other caches) and the folders ``extra`` (``--cache-dir``'s import
    checks) as they are now, to be taken before any candidate code runs (the candidate can
    then sign records with any of their keys)."""
    return None if sandboxed else RecordsWatch([*record_dirs(), *(extra or [])])


def open_reference_cache(opts: CompareOptions, identity: Any, cases_dir: Path,
                         names: list[str], digests: dict[str, str], threads: int,
                         reference_code: dict[str, str] | None, st: Stages,
                         watch: RecordsWatch | None = None) -> ReferenceCache:
    """The audit's :class:`ReferenceCache`, its records of the cases ``names`` read and
    verified now, before the candidate runs a case (not with ``--no-reference-cache``).
    ``watch`` (:func:`watch_records`, taken before any candidate code ran): without a
    sandbox, only records unchanged since are trusted; None and no sandbox (a caller that
    started no candidate yet): taken now."""
    from dflash_audit.audit.sides.integrity import reference_code_digest
    from dflash_audit.audit.sides.sandbox import sandbox_status

    start = time.perf_counter()
    if watch is None and not sandbox_status().available:
        watch = watch_records(False)
    cache = ReferenceCache.open(read=opts.reference_cache, watch=watch)
    code = reference_code if reference_code is not None else reference_code_digest(identity)
    cache.lookup(cases_dir, names, digests, identity, code, opts.device, threads)
    for name, why in cache.ignored.items():
        st.say(f"the cached reference outputs of {name} were ignored ({why}); recomputed")
    if cache.hits:
        st.say(f"the reference's outputs of {len(cache.hits)} of {len(names)} cases are in "
               "the cache (verified records; --no-reference-cache recomputes them)")
    elif opts.reference_cache and names:
        st.say(f"the reference's outputs of none of the {len(names)} cases are in the cache "
               "(records are kept per reference, cases, interpreter and library versions: a new "
               "virtual environment or release audits once more); the reference runs")
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
