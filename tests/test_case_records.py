"""The built cases kept as signed records (dflash_audit/audit/cases/case_records.py): a read
record gives the very case files a fresh build writes; a record that is changed, signed with
another key, of another audit's cases or of another kind is never trusted (removed, the cases
built again); the import check's record (audit/sides/import_check.py) likewise."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dflash_audit.audit.cases import case_records as cr
from dflash_audit.audit.cases.plan import plan_synthetic_cases
from dflash_audit.audit.sides import signed_records as sr
from dflash_audit.audit.sides.integrity import case_digests
from dflash_audit.audit.sides.run_sides import write_cases
from dflash_audit.profile import Profile


#: Each test's records are not removed under it by another worker's unsandboxed audit.
pytestmark = pytest.mark.usefixtures("records_kept")


ENV = {"python": "x", "libraries": {"torch": torch.__version__}, "device": "cpu", "threads": 1}


@pytest.fixture(scope="module")
def planned():
    """Three synthetic cases of the default profile; the second and third share one weights
    dict (as the real cases do), one tensor of which equals a "frozen" verifier weight."""
    cases = plan_synthetic_cases(Profile.load("reference-model"), 3, seed=5)
    cases[2].case.weights = cases[1].case.weights
    frozen = {"fc.weight": cases[1].case.weights["fc.weight"].clone()}
    return cases, frozen


def written(cases: list, folder: Path) -> dict[str, str]:
    if folder.exists():
        shutil.rmtree(folder)
    write_cases([p.case for p in cases], folder)
    return case_digests(folder, [p.case.name for p in cases])


def test_a_read_record_writes_the_files_a_fresh_build_writes(planned, tmp_path):
    cases, frozen = planned
    files = cr.encode(cases, {"unsupported": ["x"]}, frozen)
    meta = json.loads(files[cr.META_FILE])
    shared = [g for g, refs in meta["frozen"].items() if refs == {"fc.weight": "fc.weight"}]
    assert len(shared) == 1 and "fc.weight" not in meta["keys"][shared[0]]  # named, not stored
    back, info = cr.decode(files, frozen)
    assert info == {"unsupported": ["x"]}
    assert written(back, tmp_path / "cases") == written(cases, tmp_path / "cases")
    assert [(p.kind, p.layout) for p in back] == [(p.kind, json.loads(json.dumps(p.layout)))
                                                  for p in cases]
    assert back[1].case.weights is back[2].case.weights  # shared as they were
    with pytest.raises(KeyError):  # a frozen weight the batch cache no longer holds
        cr.decode(files, {})


def cache_at(tmp_path: Path, key: bytes, read: bool = True) -> cr.CaseCache:
    return cr.CaseCache(read=read, report_key=key, root=tmp_path / "records",
                        code={"dflash_audit/x.py": "1"})


def test_a_changed_or_foreign_case_record_is_never_trusted(planned, tmp_path):
    cases, frozen = planned
    key = os.urandom(32)
    cache = cache_at(tmp_path, key)
    fields = {"seed": 5}
    assert cache.lookup(fields, ENV, frozen) is None and cache.ignored == ""
    cache.store(cases, {}, frozen)
    assert cache_at(tmp_path, key).lookup(fields, ENV, frozen) is not None
    folder = cache.root / cache.key
    keep = tmp_path / "kept"
    shutil.copytree(folder, keep)

    def planted(change) -> str:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(keep, folder)
        change(folder)
        again = cache_at(tmp_path, key)
        assert again.lookup(fields, ENV, frozen) is None and not again.hit
        assert not folder.exists()  # removed: built and stored again
        return again.ignored

    def digest_right_signature_wrong(path: Path) -> None:
        meta = json.loads((path / cr.META_FILE).read_text())
        meta["cases"][0]["config"]["block_size"] += 1  # another case than was built
        data = json.dumps(meta).encode()
        (path / cr.META_FILE).write_bytes(data)
        body = json.loads((path / sr.RECORD_FILE).read_text())
        body["files"][cr.META_FILE] = sr.sha(data)
        (path / sr.RECORD_FILE).write_text(json.dumps(body))

    assert "signature" in planted(digest_right_signature_wrong)

    def other_audits_record(path: Path) -> None:  # signed right, for another key
        other = cache_at(tmp_path / "other", key)
        other.lookup({"seed": 6}, ENV, frozen)
        other.store(cases[:1], {}, frozen)
        shutil.rmtree(path)
        shutil.copytree(other.root / other.key, path)

    assert "another case" in planted(other_audits_record)

    def signed_elsewhere(path: Path) -> None:
        body = json.loads((path / sr.RECORD_FILE).read_text())
        body["signature"] = sr.sign_record(body, os.urandom(32))
        (path / sr.RECORD_FILE).write_text(json.dumps(body))

    assert "signature" in planted(signed_elsewhere)

    def another_kind(path: Path) -> None:  # a reference record's body, signed, at this key
        files = {n: (path / n).read_bytes() for n in (cr.TENSORS_FILE, cr.META_FILE)}
        shutil.rmtree(path)
        sr.write_signed(path, path.name, files, {}, key)

    assert "another kind" in planted(another_kind)

    def flipped(path: Path) -> None:
        data = bytearray((path / cr.TENSORS_FILE).read_bytes())
        data[-1] ^= 1
        (path / cr.TENSORS_FILE).write_bytes(bytes(data))

    assert "sha256 differs" in planted(flipped)
    # --no-reference-cache: never read, the key still computed (the record is replaced)
    off = cache_at(tmp_path, key, read=False)
    assert off.lookup(fields, ENV, frozen) is None and off.key == cache.key


def test_a_case_record_written_after_an_unsandboxed_audit_started_is_not_read(planned,
                                                                               tmp_path):
    cases, frozen = planned
    key = os.urandom(32)
    cache = cache_at(tmp_path, key)
    cache.watch = sr.RecordsWatch([cache.root])  # taken before the candidate's code ran
    cache.lookup({"seed": 5}, ENV, frozen)
    planted = cache_at(tmp_path, key)
    planted.lookup({"seed": 5}, ENV, frozen)
    planted.store(cases, {}, frozen)  # "the candidate" signs one (it can read the key)
    assert cache.lookup({"seed": 5}, ENV, frozen) is None
    assert "changed after this audit started" in cache.ignored


def test_the_key_covers_what_shapes_the_cases():
    code = {"dflash_audit/a.py": "1", "dflash_audit/__pycache__/a.pyc": "2", "ref/x": "3"}
    base = cr.cases_key({"seed": 5}, code, ENV)
    assert cr.cases_key({"seed": 6}, code, ENV) != base
    assert cr.cases_key({"seed": 5}, {**code, "dflash_audit/a.py": "9"}, ENV) != base
    assert cr.cases_key({"seed": 5}, code, {**ENV, "threads": 2}) != base
    # bytecode and files outside the package do not shape the cases
    assert cr.cases_key({"seed": 5}, {**code, "dflash_audit/__pycache__/a.pyc": "x",
                                      "ref/x": "y"}, ENV) == base


def test_an_import_check_record_is_trusted_only_signed_for_its_tree(tmp_path, monkeypatch):
    from dflash_audit.audit.sides import import_check as ic
    from dflash_audit.report.fingerprint import report_key

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "cache" / "import-checks" / ("a" * 64)
    # no check is started here: the check itself is tests/test_reference_source.py's
    monkeypatch.setattr(ic, "Background", lambda *a, **k: None)
    first = ic.ImportCheck(None, marker, read=False)
    first.remember(["/x/speculators/__init__.py"])
    again = ic.ImportCheck(None, marker)
    assert again.cached and again.files == ["/x/speculators/__init__.py"]
    assert again.summary() == {"from_cache": True, "record": "a" * 64, "ignored": ""}
    body = json.loads((marker / sr.RECORD_FILE).read_text())
    data = json.dumps({"files": []}).encode()  # fewer files to verify: digest right, unsigned
    (marker / ic.IMPORTED_FILE).write_bytes(data)
    body["files"][ic.IMPORTED_FILE] = sr.sha(data)
    (marker / sr.RECORD_FILE).write_text(json.dumps(body))
    forged = ic.ImportCheck(None, marker)
    assert not forged.cached and "signature" in forged.ignored and not marker.exists()
    other = marker.with_name("b" * 64)  # signed right, another tree's record moved here
    sr.write_signed(other, other.name, {ic.IMPORTED_FILE: data}, {}, report_key(), ic.KIND)
    shutil.copytree(other, marker)
    moved = ic.ImportCheck(None, marker)
    assert not moved.cached and "another case" in moved.ignored


def test_the_batch_key_covers_the_verifiers_tokenizer_and_chat_template(tmp_path):
    # the real cases come from cached batches (and the case record's key names the batches'
    # key): a verifier folder whose chat template or tokenizer changed, its config.json and
    # weights the same, tokenizes the conversations differently
    from dflash_audit.audit.cases.real_inputs import cache_key

    folder = tmp_path / "verifier"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ a }}"}')
    (folder / "model.safetensors").write_bytes(b"weights")

    def key() -> str:
        return cache_key(folder, "w", {"sha256": "d"}, 64, 1, "speculators", 0)

    base = key()
    (folder / "model.safetensors").write_bytes(b"other")  # weights: weights_sha256's part
    (folder / ".git").mkdir()
    (folder / ".git" / "index").write_bytes(b"x")  # nothing a tokenizer reads
    assert key() == base
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ b }}"}')
    assert key() != base
    base = key()
    (folder / "chat_template.jinja").write_text("{{ c }}")
    assert key() != base


def test_a_case_record_changed_as_it_is_stored_is_not_kept(planned, tmp_path, monkeypatch):
    # without a sandbox the candidate's process runs while the cases are stored: a record it
    # re-signs between the write and the watch taking it as this audit's own is removed
    cases, frozen = planned
    key = os.urandom(32)
    cache = cache_at(tmp_path, key)
    cache.watch = sr.RecordsWatch([cache.root])
    cache.lookup({"seed": 5}, ENV, frozen)
    real_write = cr.write_signed

    def racing(folder, name, files, extra, report_key, kind):
        real_write(folder, name, files, extra, report_key, kind)
        forged = {**files, cr.META_FILE: files[cr.META_FILE].replace(b'"g0"', b'"g0"', 1)
                  + b" "}
        real_write(folder, name, forged, extra, report_key, kind)  # "the candidate"

    monkeypatch.setattr(cr, "write_signed", racing)
    cache.store(cases, {}, frozen)
    assert not (cache.root / cache.key).exists()
    again = cache_at(tmp_path, key)
    assert again.lookup({"seed": 5}, ENV, frozen) is None and again.ignored == ""
