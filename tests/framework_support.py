"""Helpers of the framework tests: a real wheel built here (a tiny "framework" package pip
installs with --no-deps) and an adapter module in development (found through
$DFLASH_AUDIT_ADAPTER_PATH) that drives our own drafter as its "framework" code."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

ADAPTER = '''"""A test framework adapter: our drafter as the framework, its loss declared the adapter's."""
import demo_fw_pkg

from dflash_audit.candidate import DrafterCandidate

NAME = "TestFW"
VERSION = "1.0"
PROVENANCE = {"loss": "adapter", "loss_weights.": "adapter"}
CAPABILITIES = {CAPS}
REQUIREMENTS = [{WHEEL!r}]


class TestFWCandidate(DrafterCandidate):
    name = f"testfw (package {demo_fw_pkg.VERSION})"


candidate = TestFWCandidate()
'''


def build_wheel(folder: Path, version: str = "1.0") -> Path:
    """``demo_fw_pkg-<version>-py3-none-any.whl`` (module ``demo_fw_pkg`` with ``VERSION``)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"demo_fw_pkg-{version}.dist-info"
    files = {"demo_fw_pkg/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: demo-fw-pkg\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"demo_fw_pkg-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def write_adapter(folder: Path, wheel: Path, caps: str) -> Path:
    """``folder/testfw_adapter.py`` requiring ``wheel`` with CAPABILITIES ``caps`` (a literal)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "testfw_adapter.py"
    path.write_text(ADAPTER.replace("{CAPS}", caps).replace("{WHEEL!r}", repr(str(wheel))))
    return path


def framework_site(key: str, importable: bool = True) -> Path:
    """The tool's own install of framework ``key`` (its adapter's pinned REQUIREMENTS, into
    ``$DFLASH_AUDIT_CACHE/frameworks``, what ``--candidate framework:KEY`` puts on the
    candidate's path), put on this process's ``sys.path`` when ``importable`` (for the tests
    that call the framework in-process). A failed install fails the test (the index is
    reachable in CI)."""
    import sys

    from dflash_audit.audit.frameworks.registry import framework_launch

    launch = framework_launch(f"framework:{key}")
    site = launch.pythonpath[-1]
    if importable and site not in sys.path:
        sys.path.insert(0, site)
    return Path(site)


def framework_compare(key: str, tmp_path_factory, *args: str, timeout: int = 600) -> dict:
    """ONE ``dflash-audit compare --candidate framework:KEY --rows 0 ARGS`` in a subprocess
    (the tool installs the framework into its cache: $DFLASH_AUDIT_CACHE of the suite), run
    once per test session even when xdist spreads the file's tests over several workers (a
    file lock in the session's shared base folder; the others read its report):
    ``{"rc", "json", "md", "stdout", "by"}``, ``by[(case, check)]`` = that case's results of
    that check (a list: mask has one per layer type)."""
    import json

    from session_share import once_per_run, shared_folder

    shared = shared_folder(tmp_path_factory, f"framework-compare-{key}")
    done = once_per_run(tmp_path_factory, f"framework-compare-{key}",
                        lambda folder: _run_compare(key, folder / "reports", args, timeout))
    folders = sorted(p for p in (shared / "reports").iterdir() if (p / "report.json").is_file())
    assert folders, f"exit {done['rc']}: {done['stdout'][-4000:]}"
    data = json.loads((folders[-1] / "report.json").read_text())
    by: dict = {}
    for case in data["cases"]:
        for r in case["results"]:
            by.setdefault((case["name"], r["name"]), []).append(r)
    return {**done, "json": data, "md": (folders[-1] / "report.md").read_text(), "by": by}


def _run_compare(key: str, out: Path, args: tuple[str, ...], timeout: int) -> dict:
    from cli_zygote import run_cli

    out.mkdir(parents=True, exist_ok=True)
    done = run_cli(["compare", "--candidate", f"framework:{key}", "--rows", "0", "--out",
                    str(out), *args], Path(__file__).resolve().parents[1], timeout=timeout)
    return {"rc": done.returncode, "stdout": done.stdout}
