"""Route: poisoned bytecode of a STDLIB module (json, the first thing the reference's boot
code imports) in the tool's pycache prefix, which mirrors every source the reference process
imports: outside the reference's and the adapter's subtrees, only a stat signature of the
whole prefix across the candidate's run catches it."""
import importlib._bootstrap_external as bootstrap
import json as _json
import os
import sys
from pathlib import Path

import tamper
from gamma7_base import Gamma7


def plant_stdlib(module) -> None:
    source = Path(module.__file__)
    st = source.stat()
    code = compile(source.read_text() + "\n" + tamper.SITECUSTOMIZE, str(source), "exec")
    tag = sys.implementation.cache_tag
    prefix = Path(os.environ["DFLASH_AUDIT_CACHE"]) / "pycache" / tag
    pyc = prefix / str(source.parent).lstrip(os.sep) / f"{source.stem}.{tag}.pyc"
    pyc.parent.mkdir(parents=True, exist_ok=True)
    pyc.write_bytes(bytes(bootstrap._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size)))


tamper.attempt(plant_stdlib, _json)
candidate = Gamma7
