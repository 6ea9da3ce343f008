"""``report.json``: :meth:`Report.to_dict` as strict JSON (fields: :mod:`.schema`).

Values the checks put into results (tensors, numpy scalars, tuples, non-finite floats) are
made JSON-safe: small tensors become lists, large ones a ``{"shape", "dtype"}`` summary,
NaN / +-inf the strings ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dflash_audit.report.schema import Report

MAX_TENSOR_ELEMENTS = 64


def jsonable(value: Any) -> Any:
    """A strict-JSON-safe copy of ``value`` (see module docstring)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "tolist"):  # torch / numpy
        if len(tuple(shape)) == 0 or math.prod(tuple(shape)) <= MAX_TENSOR_ELEMENTS:
            return jsonable(value.tolist())
        return {"shape": list(shape), "dtype": str(getattr(value, "dtype", ""))}
    if hasattr(value, "item"):
        return jsonable(value.item())
    return repr(value)


def report_json(report: Report) -> str:
    """The text of ``report.json`` (indented, sorted as built, strict JSON), signed with this
    machine's report key (:func:`dflash_audit.report.fingerprint.sign_report`)."""
    from dflash_audit.report.fingerprint import sign_report

    return json.dumps(sign_report(jsonable(report.to_dict())), indent=1, allow_nan=False)


def write_json(report: Report, folder: Path) -> Path:
    """Write ``folder/report.json``; returns its path."""
    path = Path(folder) / "report.json"
    path.write_text(report_json(report) + "\n")
    return path
