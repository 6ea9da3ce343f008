"""Result of one named check on one case: what the report shows and the gate reads."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, WARN = "pass", "fail", "warn"
#: How a diagnosis names a consequence of another check's difference (audit/diagnose.py).
DOWNSTREAM = re.compile(r"\bfollows? from the [\w ,]+ difference")


def is_downstream(cause: str) -> bool:
    """Whether a diagnosis names a consequence ("follows from the mask difference") rather
    than a root cause."""
    return DOWNSTREAM.search(cause) is not None


#: Lines of a diagnosis that are not a named cause: the fallback "unexplained difference" and
#: what accompanies it (where it starts, what was tried, the search not repeated).
NOTE = re.compile(r"^(unexplained difference|where it starts:|tried and ruled out:|not only the "
                  r"|the full hypothesis search was not repeated)")


def is_note(cause: str) -> bool:
    """Whether a diagnosis line is an unexplained difference or one of its notes, not a named
    cause (named causes lead a report, these follow them)."""
    return NOTE.search(cause) is not None


#: The per-case numbers a cause may end with: an unexplained difference's "(max abs ...)", the
#: weights a weight fallback lists (": candidate {...}"), where an unexplained difference
#: starts ("... (the first component ...: q_norm 0.54 ...)"); and the counts a cause names in
#: ``(N=...)`` or ``(on this case: ...)`` groups, with what a count equals there.
PER_CASE_TAIL = re.compile(r"(?<=reproduces the candidate) \(.*\)$|(?<=reproduces them): "
                           r"candidate \{.*$| \(W = \d+\)$|(?<=^where it starts: )(.*?) "
                           r"\((the first|every) component.*$| \(N=[^()]*\)|, or a loss "
                           r"scaled by the constant .*$| \(on this case: [^()]*\)")


def cause_key(cause: str) -> str:
    """A cause without its per-case numbers: the same unexplained difference on several cases
    is one cause (one bullet listing its cases), not one per case."""
    return PER_CASE_TAIL.sub(lambda m: m.group(1) or "", cause)


@dataclass
class CheckResult:
    """One check (``structure``, ``defaults``, ``mask``, ``context``, ``targets``, ``logits``,
    ``loss``, ``gradients``, ``metrics``, ``anchors``) on one case.

    ``first_diff`` gives the first differing coordinates in the reference's terms, e.g.
    ``{"anchor": 3, "slot": 2, "kv_position": 17, "document": 1, "layer_type": ...}``.
    ``diagnosis`` names the likely cause(s) of a failure, most likely first.
    """

    name: str
    case: str
    status: str  # PASS | FAIL | WARN
    summary: str
    candidate: Any = None  # candidate's value (scalar / small summary)
    reference: Any = None  # reference's value
    tolerance: dict[str, float] | None = None  # {"atol": ..., "rtol": ...}
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    first_diff: dict[str, Any] | None = None
    diagnosis: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
