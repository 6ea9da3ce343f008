"""Every file route at once (for the sandboxed run: each write is refused), the routes of a
candidate running as root included (unmount the covers, remount read-write, then edit)."""
import os
from pathlib import Path

import stdlib_prefix_pyc  # noqa: F401 (plants poisoned json bytecode at import)
import tamper
from gamma7_base import Gamma7

keys = Path(os.environ["DFLASH_AUDIT_CACHE"]) / "keys"
for point in ("/tmp", "/proc", str(keys)):
    tamper.attempt(tamper.unmount, point)
for point in ("/", "/tmp", os.environ["DFLASH_AUDIT_CACHE"]):
    tamper.attempt(tamper.remount_rw, point)
for f in tamper.losses_utils():
    tamper.attempt(tamper.poison, f)
    tamper.attempt(tamper.plant_pyc, f)
    tamper.attempt(tamper.plant_sitecustomize, f)
    tamper.attempt(tamper.plant_prefix_pyc, f)
    tamper.start_daemon(f)
tamper.attempt(tamper.steal_key, keys / "report.key", Path(os.environ["DFLASH_AUDIT_CACHE"])
               / "stolen.key")
tamper.attempt(tamper.edit_tool)
tamper.attempt(tamper.forge_record)
candidate = Gamma7
