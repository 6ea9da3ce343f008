"""The reference cache (dflash_audit/audit/sides/reference_cache.py) on real audits: a warm
audit takes the reference's outputs from verified records and gives the same verdict and
values as one that ran the reference; a changed record, a record signed with another key or
one of another case is never trusted (ignored and recomputed: the reference then runs on that
case only); a cached record never turns a failing candidate into a passing one; the records
are hidden from the candidate's sandbox."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cache_support import copy_of_cache, records_lock
from cli_zygote import run_cli

from dflash_audit.audit.sides import reference_records as rc
from dflash_audit.audit.sides.reference_cache import ReferenceCache, watch_records


#: Each test's records are not removed under it by another worker's unsandboxed audit.
pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("records_kept")]

ROOT = Path(__file__).resolve().parents[1]
#: Synthetic cases only, a seed no other test audits: these records are this module's own.
AUDIT = ["compare", "--rows", "0", "--cases", "2", "--seed", "31"]


def audit(tmp: Path, *extra: str) -> tuple[int, dict]:
    """One audit (exit code, report.json) with its report in a fresh folder of ``tmp``."""
    out = tmp / f"reports-{len(list(tmp.glob('reports-*')))}"
    done = run_cli([*AUDIT, "--out", str(out), *extra], tmp)
    reports = list(out.glob("*/report.json"))
    assert reports, done.stdout[-3000:]
    return done.returncode, json.loads(reports[0].read_text())


def values(report: dict) -> list:
    """Every result of every case: status, numbers and wording."""
    return [(case["name"], [(r["name"], r["status"], r.get("max_abs_diff"),
                             r.get("max_rel_diff"), r.get("summary"))
                            for r in case["results"]]) for case in report["cases"]]


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory, reference_identity):
    """An audit that ran the reference (``--no-reference-cache``: whatever the cache held)
    and the same audit again, warm; in a cache of this module's own (for its tests too): an
    unsandboxed audit of another test worker discards every record written while its
    candidate ran, in every registered records folder, the suite's shared one included."""
    tmp = tmp_path_factory.mktemp("reference-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("DFLASH_AUDIT_CACHE", str(copy_of_cache(tmp / "cache")))
    with records_lock(exclusive=True):  # the cold audit's records, read by the warm one
        cold = audit(tmp, "--no-reference-cache")
        warm = audit(tmp)
    yield {"tmp": tmp, "cold": cold, "warm": warm}
    patch.undo()


def test_a_warm_audit_takes_the_reference_outputs_from_the_cache(cold_and_warm):
    (cold_code, cold), (warm_code, warm) = cold_and_warm["cold"], cold_and_warm["warm"]
    assert cold_code == warm_code == 0, (cold["verdict"], warm["verdict"])
    ran, reused = cold["reference"]["cache"], warm["reference"]["cache"]
    assert ran["read"] is False and ran["from_cache"] == 0
    assert {c["outputs"] for c in ran["cases"].values()} == {"run"}
    assert reused["read"] is True and reused["from_cache"] == 2 and not reused["ignored"]
    assert {c["outputs"] for c in reused["cases"].values()} == {"cache"}
    # the record of each case is the one the reference run stored, checked against this key
    assert {n: c["record"] for n, c in reused["cases"].items()} == {
        n: c["record"] for n, c in ran["cases"].items()}
    assert reused["key_id"] == ran["key_id"] and len(reused["key_id"]) == 16
    assert any("from the reference cache" in note for note in warm["notes"])
    assert warm["timing"]["reference"] == 0.0 < cold["timing"]["reference"]
    assert values(warm) == values(cold)
    assert warm["fingerprint"] == cold["fingerprint"]
    assert warm["reference"]["module_file"] == cold["reference"]["module_file"]
    # the built cases and the import check: recomputed cold, read warm, the same records
    assert cold["inputs"]["case_cache"]["read"] is False
    assert cold["reference"]["import_check"]["from_cache"] is False
    assert warm["inputs"]["case_cache"]["from_cache"] is True
    assert warm["reference"]["import_check"]["from_cache"] is True
    assert warm["inputs"]["case_cache"]["record"] == cold["inputs"]["case_cache"]["record"]


def _records(run: dict) -> dict[str, Path]:
    cases = run["cold"][1]["reference"]["cache"]["cases"]
    return {name: rc.records_root() / c["record"] for name, c in cases.items()}


def test_a_changed_or_foreign_record_is_never_trusted(cold_and_warm, tmp_path):
    from dflash_audit.report.fingerprint import report_key

    key = report_key(create=False)
    (first, one), (second, other) = sorted(_records(cold_and_warm).items())
    derives = (one / "derivation.json").is_file()
    record, why = rc.read_record(one, one.name, key, derives)
    assert record is not None and why == "" and set(record.files) >= {"outputs.json"}

    def copy(src: Path) -> Path:
        dest = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        shutil.copytree(src, dest)
        return dest

    changed = copy(one)  # one byte of the outputs changed
    data = bytearray((changed / "outputs.safetensors").read_bytes())
    data[-1] ^= 1
    (changed / "outputs.safetensors").write_bytes(bytes(data))
    assert "sha256 differs" in rc.read_record(changed, one.name, key, derives)[1]
    restamped = copy(one)  # the file's new digest written into the record, by hand
    body = json.loads((restamped / rc.RECORD_FILE).read_text())
    body["files"]["outputs.safetensors"] = rc._sha(bytes(data))
    (restamped / "outputs.safetensors").write_bytes(bytes(data))
    (restamped / rc.RECORD_FILE).write_text(json.dumps(body))
    assert "signature" in rc.read_record(restamped, one.name, key, derives)[1]
    resigned = copy(restamped)  # ... and signed, with a key not this machine's
    body["signature"] = rc.sign_record(body, os.urandom(32))
    (resigned / rc.RECORD_FILE).write_text(json.dumps(body))
    assert "signature" in rc.read_record(resigned, one.name, key, derives)[1]
    # digests and signature right, but the record of the other case moved into place
    assert "another case" in rc.read_record(copy(other), one.name, key, derives)[1]
    assert rc.read_record(tmp_path / "absent", one.name, key, derives) == (None, "")


def test_a_corrupted_record_is_recomputed_and_a_record_never_turns_a_fail_into_a_pass(
        cold_and_warm):
    from dflash_audit.report.fingerprint import report_key

    (first, one), (second, _) = sorted(_records(cold_and_warm).items())
    path = one / "outputs.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # a value of the reference's outputs, not its header
    path.write_bytes(bytes(data))
    # the built cases: another audit's cases (digests right) with this audit's key, unsigned
    cases = rc.records_root(rc.CASES_DIR) / cold_and_warm["warm"][1]["inputs"]["case_cache"][
        "record"]
    _plant_other_cases(cases)
    # the import check: a trusted record of another tree moved into place
    check = rc.records_root(rc.IMPORT_CHECKS_DIR) / cold_and_warm["warm"][1]["reference"][
        "import_check"]["record"]
    foreign = check.with_name("f" * 64)
    shutil.copytree(check, foreign)
    body = json.loads((foreign / rc.RECORD_FILE).read_text())
    body["key"] = foreign.name
    body["signature"] = rc.sign_record(body, report_key(create=False))
    (foreign / rc.RECORD_FILE).write_text(json.dumps(body))
    shutil.rmtree(check)
    foreign.rename(check)
    bug = f"{ROOT / 'examples' / 'candidates' / 'gamma7.py'}:candidate"
    code, report = audit(cold_and_warm["tmp"], "--candidate", bug)
    cache = report["reference"]["cache"]
    assert "sha256 differs" in cache["ignored"][first], cache
    assert cache["cases"][first]["outputs"] == "run"  # the reference ran on that case only
    assert cache["cases"][second]["outputs"] == "cache" and cache["from_cache"] == 1
    assert path.read_bytes() != bytes(data)  # stored again from the new run
    assert "signature" in report["inputs"]["case_cache"]["ignored"]
    assert report["inputs"]["case_cache"]["from_cache"] is False
    assert "another case" in report["reference"]["import_check"]["ignored"]
    assert report["reference"]["import_check"]["from_cache"] is False
    assert [c["name"] for c in report["cases"]] == [c["name"] for c in
                                                    cold_and_warm["warm"][1]["cases"]]
    # the buggy loss fails on the recomputed case and on the one from the cache alike
    assert code == 1 and report["verdict"] == "fail"
    for case in report["cases"]:
        status = {r["name"]: r["status"] for r in case["results"]}
        assert status["loss"] == "fail", (case["name"], status)


def _plant_other_cases(folder: Path) -> None:
    """The case record in ``folder`` changed into cases that pass any candidate's loss (every
    case's loss mask cleared), its files' digests written into record.json, not signed."""
    from safetensors.torch import load, save

    tensors = load((folder / "cases.safetensors").read_bytes())
    tensors = {k: v.zero_() if k.endswith("/loss_mask") else v for k, v in tensors.items()}
    data = save(tensors)
    (folder / "cases.safetensors").write_bytes(data)
    body = json.loads((folder / rc.RECORD_FILE).read_text())
    body["files"]["cases.safetensors"] = rc._sha(data)
    (folder / rc.RECORD_FILE).write_text(json.dumps(body))


def test_records_written_while_an_unsandboxed_candidate_ran_are_discarded(tmp_path,
                                                                           monkeypatch):
    # a candidate without a sandbox can read the key and sign a record of its own: whatever
    # changed in the records while it ran is removed (its own audit read its records before)
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    case = tmp_path / "case"
    case.mkdir()
    (case / "outputs.json").write_text("{}")
    (case / "outputs.safetensors").write_bytes(b"reference")
    cache = ReferenceCache.open(read=True)
    for key in ("a" * 64, "b" * 64, "c" * 64):
        rc.write_record(cache.root / key, key, case, {}, cache.report_key)
    cache.watch = watch_records(False)
    (case / "outputs.safetensors").write_bytes(b"forged")
    rc.write_record(cache.root / ("a" * 64), "a" * 64, case, {}, cache.report_key)  # replaced
    rc.write_record(cache.root / ("d" * 64), "d" * 64, case, {}, cache.report_key)  # new
    (cache.root / ("c" * 64) / "outputs.json").write_text("{ }")  # edited in place
    assert cache.discard_changed() == ["a" * 64, "c" * 64, "d" * 64]
    assert sorted(p.name for p in cache.root.iterdir()) == ["b" * 64]
    record, why = rc.read_record(cache.root / ("b" * 64), "b" * 64, cache.report_key, False)
    assert why == "" and record.files["outputs.safetensors"] == b"reference"


def test_records_an_unsandboxed_candidate_plants_in_another_cache_are_discarded(
        tmp_path, monkeypatch):
    # the candidate can also sign a record with another cache's key (readable without a
    # sandbox) and plant it in that cache's records (the default cache, or one an earlier
    # audit registered), for the next audit that uses that cache: every records folder the
    # sandbox would hide is watched, and what changed there is removed too
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "other"))
    other = ReferenceCache.open(read=True)  # an audit with another cache: registered
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    default = tmp_path / "home" / ".cache" / "dflash-audit" / rc.RECORDS_DIR
    default.mkdir(parents=True)
    case = tmp_path / "case"
    case.mkdir()
    (case / "outputs.json").write_text("{}")
    (case / "outputs.safetensors").write_bytes(b"forged")
    cache = ReferenceCache.open(read=True, watch=watch_records(False))
    rc.write_record(default / ("a" * 64), "a" * 64, case, {}, cache.report_key)
    rc.write_record(other.root / ("b" * 64), "b" * 64, case, {}, other.report_key)
    assert cache.discard_changed() == ["a" * 64, "b" * 64]
    assert list(default.iterdir()) == [] and list(other.root.iterdir()) == []


def test_the_least_recently_used_records_go_first_past_the_size_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    case = tmp_path / "case"
    case.mkdir()
    (case / "outputs.json").write_text("{}")
    (case / "outputs.safetensors").write_bytes(bytes(1000))
    cache = ReferenceCache.open(read=True)
    for age, key in enumerate(("a" * 64, "b" * 64, "c" * 64)):  # a newest, c oldest
        rc.write_record(cache.root / key, key, case, {}, cache.report_key)
        os.utime(cache.root / key / rc.RECORD_FILE, (1e9 - age * 100, 1e9 - age * 100))
    rc.touch(cache.root / ("c" * 64))  # read now: the most recently used
    size = sum(p.stat().st_size for p in (cache.root / ("a" * 64)).iterdir())
    assert rc.prune(cache.root, 2 * size) == ["b" * 64]
    assert sorted(p.name for p in cache.root.iterdir()) == ["a" * 64, "c" * 64]


@pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap sandbox: Linux only")
def test_the_records_are_hidden_from_the_candidates_sandbox(tmp_path):
    from dflash_audit.audit.sides.sandbox import sandbox_status, sandboxed

    if not sandbox_status().available:
        pytest.skip("no bubblewrap sandbox on this machine")
    roots = [rc.records_root(kind) for kind in rc.RECORD_KINDS]  # outputs, cases, checks, probes
    assert set(roots) <= set(rc.record_dirs())
    probes = [root / "probe-record" for root in roots]
    for probe in probes:
        probe.mkdir(exist_ok=True)
    (tmp_path / "cases").mkdir()
    (tmp_path / "out").mkdir()
    try:
        cmd = sandboxed([sys.executable, "-I", "-c", "import os, sys; print([os.listdir(p) "
                         "for p in sys.argv[1:]])", *map(str, roots)], None, tmp_path / "cases",
                        tmp_path / "out", env={})
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    finally:
        for probe in probes:
            probe.rmdir()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str([[]] * len(roots))  # every kind hidden
