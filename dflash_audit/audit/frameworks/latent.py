"""Latent differences: what a framework WOULD do on input it cannot express (an adapter's
``LATENT``, next to its ``CAPABILITIES``).

Where a framework lacks a capability of the reference (:meth:`.capabilities.Capabilities.
lacking`: no document ids, one target layer per draft layer, ...), the planner cuts or leaves
out the cases that need it, so no check can show what the framework does there. A latent
difference says it, as a warning in every report format, the terminal and the conformance
matrix: "SpecForge 0.2.0 has no document mask: packed rows would leak across documents
(specforge/algorithms/common/dflash_family_model.py:72)". It never changes the verdict.

An adapter declares them as a literal list of dicts::

    LATENT = [{"capability": "packed_rows",                 # a field it lacks
               "would": "has no document mask: packed rows would leak across documents ...",
               "source": "specforge/algorithms/common/dflash_family_model.py:72",
               "shows": "mask_context = (kv_indices < S) & (kv_indices < anchor_expanded)"}]

``would`` follows the framework's label ("SpecForge 0.2.0 has ..."); ``source`` is
``PATH:LINE`` or ``PATH:FIRST-LAST``, PATH relative to the root the framework is installed
into (its site folder); ``shows`` is text those lines contain (:func:`check_sources` verifies
it against the installed framework). A capability the framework lacks with no declaration is
still listed ("what it would do is not declared by its adapter"): none is dropped.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from dflash_audit.audit.frameworks.capabilities import Capabilities, CapabilitiesError, brief

#: The keys of one ``LATENT`` entry (all required).
KEYS = ("capability", "would", "source", "shows")
#: The longest value of each key (characters): every one is printed on one terminal line.
MAX_CHARS = {"capability": 64, "would": 600, "source": 200, "shows": 300}
#: The most entries one adapter declares (one per capability it lacks, a few each).
MAX_ENTRIES = 64
_SOURCE = re.compile(r"^(?P<path>[^:\s]+\.[A-Za-z0-9]+):(?P<first>\d+)(?:-(?P<last>\d+))?$")


class LatentError(CapabilitiesError):
    """An adapter's ``LATENT`` is malformed (the entry and what is wrong named)."""


@dataclass(frozen=True)
class LatentDifference:
    """What a framework would do on input that needs ``capability`` (a
    :class:`~.capabilities.Capabilities` field it lacks). ``declared`` False: the adapter did
    not say (``would`` then says so, ``source`` and ``shows`` are empty)."""

    capability: str
    would: str
    source: str = ""
    shows: str = ""
    declared: bool = True

    @property
    def path(self) -> str:
        """The cited file, relative to the framework's install root."""
        return _SOURCE.match(self.source)["path"] if self.source else ""

    @property
    def lines(self) -> tuple[int, int]:
        """The cited lines, 1-based, inclusive (first, last)."""
        m = _SOURCE.match(self.source)
        return int(m["first"]), int(m["last"] or m["first"])

    def text(self, label: str) -> str:
        """One line: ``"<label> <would> (<source>)"``."""
        return f"{label} {self.would}" + (f" ({self.source})" if self.source else "")


def parse_latent(data: Any, caps: Capabilities) -> list[LatentDifference]:
    """The latent differences of an adapter's ``LATENT`` (None: none declared).

    Raises:
        LatentError: not a list of dicts; an entry with a missing or unknown key, an empty
            value, a capability that is no :class:`Capabilities` field or one the framework
            does not lack (its CAPABILITIES say it can run it), or a ``source`` that is not
            ``PATH:LINE`` / ``PATH:FIRST-LAST`` (FIRST <= LAST).
    """
    if data is None:
        return []
    if not isinstance(data, (list, tuple)) or len(data) > MAX_ENTRIES:
        raise LatentError(f"LATENT must be a list of dicts with keys {list(KEYS)} (at most "
                          f"{MAX_ENTRIES}), got {brief(data)}")
    fields, lacking, out = {f.name for f in dataclasses.fields(Capabilities)}, caps.lacking(), []
    for i, entry in enumerate(data):
        where = f"LATENT[{i}]"
        if not isinstance(entry, dict):
            raise LatentError(f"{where} must be a dict with keys {list(KEYS)}, got "
                              f"{brief(entry)}")
        missing = [k for k in KEYS if k not in entry]
        unknown = sorted(str(k) for k in set(entry) - set(KEYS))
        if missing or unknown:
            raise LatentError(f"{where}: missing key(s) {missing}, unknown key(s) "
                              f"{brief(unknown)}; "
                              f"keys: {list(KEYS)}")
        empty = [k for k in KEYS if not isinstance(entry[k], str) or not entry[k].strip()]
        if empty:
            raise LatentError(f"{where}: {empty} must be non-empty strings")
        for key in KEYS:  # printed as is in the terminal and every report: one plain line
            if not entry[key].isprintable():
                raise LatentError(f"{where}[{key!r}] must be one line of printable text (no "
                                  f"newline or control character), got {brief(entry[key])}")
            if len(entry[key]) > MAX_CHARS[key]:
                raise LatentError(f"{where}[{key!r}] is longer than {MAX_CHARS[key]} "
                                  f"characters ({len(entry[key])}): say it in one line")
        capability = entry["capability"]
        if capability not in fields:
            raise LatentError(f"{where}: unknown capability {capability!r}; known: "
                              f"{sorted(fields)}")
        if capability not in lacking:
            raise LatentError(f"{where}: the framework does not lack {capability!r} (its "
                              f"CAPABILITIES lack {lacking or 'nothing'}): a latent difference "
                              "is what it would do on input it cannot express")
        m = _SOURCE.match(entry["source"])
        if (m is None or (m["last"] and int(m["last"]) < int(m["first"]))
                or int(m["first"]) < 1 or not inside(m["path"])):
            raise LatentError(f"{where}: source {entry['source']!r} must be PATH:LINE or "
                              "PATH:FIRST-LAST (PATH relative to the framework's install root, "
                              "without '..')")
        out.append(LatentDifference(capability, entry["would"].strip(), entry["source"],
                                    entry["shows"]))
    return out


def inside(path: str) -> bool:
    """Whether ``path`` (a citation's) names a file under the install root: relative, no
    ``..`` part (symlinks are checked where the file is read, :func:`check_sources`)."""
    parts = PurePosixPath(path).parts
    return bool(parts) and not path.startswith(("/", "\\")) and ".." not in parts \
        and "\\" not in path


def undeclared(caps: Capabilities, declared: list[LatentDifference]) -> list[LatentDifference]:
    """One entry per capability ``caps`` lack that ``declared`` does not cover, saying what
    the framework cannot express and that its adapter does not say what it would do."""
    covered = {d.capability for d in declared}
    return [LatentDifference(key, f"cannot express {key.replace('_', ' ')} (CAPABILITIES "
                                  f"{key}); what it would do on such input is not declared by "
                                  "its adapter (LATENT)", declared=False)
            for key in caps.lacking() if key not in covered]


def latent_findings(label: str, caps: Capabilities, declared: list[LatentDifference],
                    exercised: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """The report's ``latent`` entries: every declared difference and one per undeclared
    lacking capability (:func:`undeclared`), each ``{"capability", "text", "would", "source",
    "shows", "declared", "cases"}``; ``cases`` are the audit's cases that had such input and
    were cut or left out (``exercised``: capability -> case names, from the planner)."""
    exercised = exercised or {}
    return [{"capability": d.capability, "text": d.text(label), "would": d.would,
             "source": d.source, "shows": d.shows, "declared": d.declared,
             "cases": list(exercised.get(d.capability, []))}
            for d in [*declared, *undeclared(caps, declared)]]


def check_sources(latent: list[LatentDifference], root: Path | str) -> list[str]:
    """What does not hold of each declared difference's citation under ``root`` (the
    framework's install root): the file is missing, the lines are past its end, or they do
    not contain ``shows`` (whitespace runs compared as one space). Empty: all hold."""
    problems = []
    for d in latent:
        if not d.declared:
            continue
        path = Path(root) / d.path
        if not inside(d.path) or not path.resolve().is_relative_to(Path(root).resolve()):
            problems.append(f"{d.source}: {path} leads outside the install root {root}")
            continue
        if not path.is_file():
            problems.append(f"{d.source}: {path} does not exist")
            continue
        first, last = d.lines
        lines = path.read_text(errors="replace").splitlines()
        if last > len(lines):
            problems.append(f"{d.source}: {path} has {len(lines)} lines")
            continue
        cited = " ".join(" ".join(lines[first - 1:last]).split())
        if " ".join(d.shows.split()) not in cited:
            problems.append(f"{d.source}: the cited lines do not contain {d.shows!r}: "
                            f"{cited[:300]!r}")
    return problems
