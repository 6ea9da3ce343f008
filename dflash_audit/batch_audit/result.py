"""What ``check-batches`` found: one :class:`Check` per property (per row or per folder), and
the :class:`BatchReport` that turns them into a verdict and an exit code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

PASS, FAIL, SKIP, WARN = "pass", "fail", "skip", "warn"


@dataclass
class Check:
    """One audited property.

    ``name``: the property in the reference's terms (``hidden_states[2]``,
    ``verifier_last_hidden_states``, ``loss_mask``, ``position_ids``, ``document_ids``,
    ``mask_token_id``, ``target_layer_ids``); ``row``: the file / sample it was checked on
    (``""`` for folder-level checks); ``status``: pass / fail / skip / warn (a difference
    from the reference's format that cannot change training: shown, never failed);
    ``finding``: the named
    hypothesis that explains a failure (``post-norm``, ``layer N-2``, ``shift +1``,
    ``user turns``, ``positions continue``, ``zlab ids read as speculators ids``...), empty on
    pass; ``message``: one line for a human; ``details``: numbers behind it (errors,
    tolerances, positions).
    """

    name: str
    status: str
    message: str
    row: str = ""
    finding: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The check as a JSON-able dict (the ``checks`` entries of ``report.json``)."""
        return asdict(self)


@dataclass
class BatchReport:
    """All checks of one ``check-batches`` run and its context (folder, format, verifier,
    rows checked, tolerances, timings); ``notes``: lines a user must read whatever the verdict
    (e.g. target layer ids computed from a drafter config that names none), printed on the
    terminal and written in every report format."""

    folder: str
    format: str
    verifier: dict[str, Any]
    rows_checked: list[str]
    checks: list[Check] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    created_at: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def failures(self) -> list[Check]:
        """The failed checks, in run order."""
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        """The checks that warn (shown with the findings; the verdict stays pass)."""
        return [c for c in self.checks if c.status == WARN]

    @property
    def verdict(self) -> str:
        """``pass`` when no check failed (skips and warnings allowed), else ``fail``."""
        return FAIL if self.failures else PASS

    @property
    def exit_code(self) -> int:
        """0 pass, 1 findings."""
        return 1 if self.failures else 0

    def to_dict(self) -> dict[str, Any]:
        """``report.json``: verdict, context, the sorted finding names and every check."""
        return {"kind": "dflash-audit check-batches", "verdict": self.verdict,
                "created_at": self.created_at, "folder": self.folder, "format": self.format,
                "verifier": self.verifier, "rows_checked": self.rows_checked,
                "context": self.context, "notes": self.notes,
                "findings": sorted({c.finding for c in self.failures if c.finding}),
                "checks": [c.to_dict() for c in self.checks]}
