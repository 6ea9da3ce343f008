"""Hostile candidates that write into the Python installation the verdict runs on: a module of
the interpreter's site-packages that the reference imports (``tests/hostile/site_packages.py``
appends a hook to ``typing_extensions.py`` that makes the reference compute gamma 7). Without a
sandbox the write succeeds; the audit is exit 2 naming the file, and every later audit is
refused until the file is restored (the record in the cache clears itself then).

The damaged installation is a throwaway venv over the suite's packages with its own copy of
``typing_extensions.py`` (first on its path), never the suite's venv; the reference tree and
the tool are copies too (:class:`test_hostile.World`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_hostile import World, refused_until_restored

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


@pytest.fixture
def venv(tmp_path: Path) -> tuple[str, Path]:
    """``(python, its typing_extensions.py)``: a venv whose site-packages holds a copy of the
    module and a ``.pth`` that adds the suite's site-packages after it."""
    import typing_extensions

    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   capture_output=True, timeout=120)
    (site,) = root.glob("lib/python*/site-packages")
    suite = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    (site / "_suite.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in suite) + "\n")
    shutil.copy2(typing_extensions.__file__, site)
    return str(root / "bin" / "python"), site / "typing_extensions.py"


def test_a_candidate_that_edits_site_packages_is_refused_now_and_later(
        tmp_path: Path, reference_identity, venv: tuple[str, Path]) -> None:
    """Unsandboxed, the candidate appends to typing_extensions.py (the write happens): exit 2
    naming the file and the reinstall, no report, never the PASS the reference would give on
    gamma 7; the next audit is refused before any candidate code runs until the file is
    restored, then audits start again."""
    import typing_extensions

    python, module = venv
    world = World(tmp_path)
    original = module.read_bytes()
    result = world.compare("site_packages", sandbox=False, python=python)
    flat = " ".join(result.stdout.split())
    assert module.read_bytes() != original  # the attack's write went through
    assert result.returncode == 2, result.stdout
    assert str(module) in flat and "Traceback" not in flat, flat
    assert "no verdict can be given" in flat and "--force-reinstall" in flat, flat
    assert "typing_extensions" in flat.split("--force-reinstall")[1], flat
    assert world.reports("site_packages") == []
    refused_until_restored(world, module, Path(typing_extensions.__file__), "--force-reinstall",
                           python=python)


def _hashed(baseline, path: Path) -> str:
    import time

    for _ in range(200):  # the digests are taken in the background
        if str(path) in baseline.sha:
            return baseline.sha[str(path)]
        time.sleep(0.01)
    raise AssertionError(f"{path} was not hashed")


def test_the_baseline_names_a_write_a_new_entry_and_a_file_written_after_it(tmp_path: Path
                                                                            ) -> None:
    """A file appended to, a ``.pth`` added to its folder and a file first seen after the
    baseline but written after it began are changes; a ``__pycache__`` made in the folder (an
    unsandboxed candidate's own bytecode) and an older file first seen later are not, and new
    bytecode there is deleted."""
    import hashlib
    import time

    from dflash_audit.audit.sides.install_guard import InstallBaseline

    site = tmp_path / "site-packages"
    site.mkdir()
    module, older = site / "mod.py", site / "older.py"
    module.write_text("X = 1\n")
    older.write_text("Y = 1\n")
    baseline = InstallBaseline()
    assert baseline.add([str(module)]) == []
    good = hashlib.sha256(b"X = 1\n").hexdigest()
    assert _hashed(baseline, module) == good
    time.sleep(0.05)  # files written from now on are newer than the baseline's clock
    (site / "__pycache__").mkdir()
    assert baseline.changes([str(older)]) == []
    planted = site / "__pycache__" / "mod.cpython-311.pyc"  # new bytecode: deleted, not a change
    planted.write_bytes(b"planted")
    assert baseline.sweep_bytecode() == [str(planted)] and not planted.exists()
    with module.open("a") as f:
        f.write("X = 7\n")
    (site / "evil.pth").write_text("import os\n")
    late = site / "late.py"
    late.write_text("Z = 1\n")
    assert baseline.changes([str(late)]) == sorted([str(module), str(site), str(late)])
    assert baseline.good(str(module)) == f"sha256:{good}"
    assert "+evil.pth" in baseline.describe(str(site)) and "+late.py" in baseline.describe(
        str(site))


def test_the_record_refuses_until_the_good_content_is_back(tmp_path: Path, monkeypatch) -> None:
    """A recorded file stays outstanding until its sha256 is the good one again, an added
    file until it is gone, a folder until its entries are back; then the record clears
    itself. Entries of other installations (not relevant) are kept."""
    import hashlib

    from dflash_audit.audit.sides.install_guard import ABSENT, InstallBaseline
    from dflash_audit.audit.sides.tamper_record import (
        outstanding_tampering,
        record_path,
        record_tampering,
    )

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    module, added, folder = tmp_path / "mod.py", tmp_path / "evil.pth", tmp_path / "pkg"
    module.write_text("X = 7\n")
    added.write_text("import os\n")
    folder.mkdir()
    empty = InstallBaseline()
    empty.add_folders([str(folder)])  # the folder as it was: empty
    (folder / "__init__.py").write_text("")
    good = hashlib.sha256(b"X = 1\n").hexdigest()
    record_tampering({str(module): f"sha256:{good}", str(added): ABSENT,
                      str(folder): empty.good(str(folder)), "/elsewhere/x.py": ABSENT})
    mine = lambda p: str(tmp_path) in p  # noqa: E731
    assert outstanding_tampering(mine) == sorted([str(module), str(added), str(folder)])
    module.write_text("X = 1\n")
    added.unlink()
    assert outstanding_tampering(mine) == [str(folder)]
    (folder / "__init__.py").unlink()
    assert outstanding_tampering(mine) == []
    assert record_path().is_file()  # another installation's entry stays
    assert outstanding_tampering(lambda p: True) == []  # /elsewhere/x.py: absent, as it was
    assert not record_path().exists()


def test_a_record_entry_the_candidate_planted_never_vouches_for_its_change(
        tmp_path: Path, monkeypatch) -> None:
    """Without a sandbox the candidate can write the record before its audit records the
    change: an entry for the file it poisoned whose "good" value is the poisoned content.
    The audit's own good value replaces it, so the next audit refuses until the file is
    really restored."""
    import hashlib

    from dflash_audit.audit.sides.tamper_record import (
        outstanding_tampering,
        record_tampering,
    )

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    module = tmp_path / "mod.py"
    module.write_text("X = 7\n")  # poisoned
    poisoned = hashlib.sha256(b"X = 7\n").hexdigest()
    good = hashlib.sha256(b"X = 1\n").hexdigest()
    record_tampering({str(module): f"sha256:{poisoned}"})  # planted by the candidate
    record_tampering({str(module): f"sha256:{good}"})  # the audit's own record
    mine = lambda p: str(tmp_path) in p  # noqa: E731
    assert outstanding_tampering(mine) == [str(module)]
    module.write_text("X = 1\n")
    assert outstanding_tampering(mine) == []


@pytest.mark.parametrize("block", ["integrity is a file", "lock is a folder",
                                   "temporary name is a folder"])
def test_a_blocked_record_refuses_every_later_audit(tmp_path: Path, monkeypatch,
                                                    block: str) -> None:
    """The candidate blocks the record (its folder made a file, its lock a folder, the
    temporary file's name taken): the change must still be recorded, or -- when the folder
    cannot be used at all -- every later audit refuses naming it, never starts on an
    installation it cannot know is restored."""
    import hashlib

    from dflash_audit.audit.setup_error import CompareSetupError
    from dflash_audit.audit.sides.tamper_record import (
        outstanding_tampering,
        record_path,
        record_tampering,
        refuse_recorded_tampering,
    )

    monkeypatch.setenv("DFLASH_AUDIT_CACHE", str(tmp_path / "cache"))
    folder = record_path().parent
    folder.parent.mkdir(parents=True)
    if block == "integrity is a file":
        folder.write_text("")
    else:
        folder.mkdir()
    if block == "lock is a folder":
        (folder / ".lock").mkdir()
    if block == "temporary name is a folder":
        (folder / f".{record_path().name}.{os.getpid()}").mkdir()
    module = tmp_path / "mod.py"
    module.write_text("X = 7\n")
    good = hashlib.sha256(b"X = 1\n").hexdigest()
    try:
        record_tampering({str(module): f"sha256:{good}"})
    except OSError:
        pass  # the audit that saw the change refuses either way
    mine = lambda p: str(tmp_path) in p  # noqa: E731
    assert outstanding_tampering(mine) != []
    with pytest.raises(CompareSetupError, match="writable folder"
                       if block != "temporary name is a folder" else "mod.py"):
        monkeypatch.setattr("dflash_audit.audit.sides.tamper_record.installation_roots",
                            lambda: [str(tmp_path)])
        refuse_recorded_tampering([])


def test_what_python_runs_at_start_up_is_in_the_baseline(tmp_path: Path, monkeypatch) -> None:
    """Files no module is imported from but Python's start-up runs (in the next audit's own
    process, before any check): an existing ``.pth`` edited, an absent ``sys.path`` entry
    created (``python311.zip`` with an ``encodings`` package runs first, even under ``-I
    -S``), ``pyvenv.cfg`` edited. Each is a change; the current folder is never watched (an
    honest candidate may write there)."""
    import sys
    import time
    import zipfile

    from dflash_audit.audit.sides import install_guard
    from dflash_audit.audit.sides.install_guard import ABSENT, InstallBaseline, startup_paths

    site, prefix, here = tmp_path / "site-packages", tmp_path / "prefix", tmp_path / "here"
    for folder in (site, prefix, here):
        folder.mkdir()
    pth, cfg, zipped = site / "distutils-precedence.pth", prefix / "pyvenv.cfg", \
        tmp_path / "python311.zip"
    pth.write_text("import os\n")
    cfg.write_text("home = /usr/bin\n")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [str(here), str(zipped), str(site)])
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr("dflash_audit.reference_source.runner.site_dirs", lambda: [str(site)])
    monkeypatch.setattr("site.ENABLE_USER_SITE", False)
    paths = startup_paths()
    assert {str(pth), str(cfg), str(zipped)} <= set(paths) and str(here) not in paths
    baseline = InstallBaseline()
    assert baseline.watch(paths) == []
    time.sleep(0.05)
    (here / "json.py").write_text("")  # the current folder: not watched
    (site / ".hypothesis").mkdir()  # nothing an import finds: no change
    assert baseline.changes() == []
    (site / "json").mkdir()
    (site / "json" / "__init__.py").write_text("")  # a package that shadows the stdlib's
    assert baseline.changes() == [str(site)]
    shutil.rmtree(site / "json")
    with pth.open("a") as f:
        f.write("import evil\n")
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("encodings/__init__.py", "import evil\n")
    cfg.write_text("home = /tmp/evil\n")
    assert baseline.changes() == sorted([str(pth), str(zipped), str(cfg)])
    assert baseline.good(str(zipped)) == ABSENT
    monkeypatch.undo()  # the audit's guard on this interpreter takes its own .pth files
    from dflash_audit.reference_source.runner import site_dirs

    real = [str(p) for d in site_dirs() for p in Path(d).glob("*.pth")]
    guard = install_guard.InstallGuard([])
    assert real and set(real) <= set(guard.baseline.files), real


def test_bytecode_an_honest_process_rewrote_is_benign_a_planted_one_is_not(tmp_path: Path
                                                                          ) -> None:
    """The tool's ``__pycache__`` is rewritten by any process that imports a module not compiled
    yet (a test worker, another audit, the candidate's own process): marshal's bytes differ
    between processes, the code does not, so that is no tampering (a fresh clone's CI run was
    refused on it); a .pyc that runs other code than its source is."""
    import importlib.util
    import py_compile

    from dflash_audit.audit.sides.integrity import benign_bytecode

    source = tmp_path / "mod.py"
    source.write_text("def f(x):\n    return {'a': (x, 4.0)}\n")
    pyc = Path(importlib.util.cache_from_source(str(source)))
    subprocess.run([sys.executable, "-c", f"import py_compile; py_compile.compile({str(source)!r})"],
                   check=True)  # written by another process
    assert pyc.is_file() and benign_bytecode(pyc)
    planted = tmp_path / "planted.py"
    planted.write_text("def f(x):\n    return {'a': (x, 7.0)}\n")
    py_compile.compile(str(planted), cfile=str(pyc))  # other code under the source's name
    assert not benign_bytecode(pyc)
    pyc.write_bytes(b"not bytecode")
    assert not benign_bytecode(pyc)
    pyc.unlink()
    assert benign_bytecode(pyc)  # gone: Python compiles the source again
