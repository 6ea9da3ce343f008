"""Every file route at once (for the sandboxed run: each write is refused)."""
import stdlib_prefix_pyc  # noqa: F401 (plants poisoned json bytecode at import)
import tamper
from gamma7_base import Gamma7

for f in tamper.losses_utils():
    tamper.attempt(tamper.plant_pyc, f)
    tamper.attempt(tamper.plant_sitecustomize, f)
    tamper.attempt(tamper.plant_prefix_pyc, f)
    tamper.start_daemon(f)
tamper.attempt(tamper.edit_tool)
tamper.attempt(tamper.forge_record)
candidate = Gamma7
