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
