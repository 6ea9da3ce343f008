"""The options of one audit (``dflash-audit compare``'s flags) and their defaults, checked
before any work: what every stage of a compare receives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dflash_audit.audit.setup_error import CompareSetupError

#: Seconds one case may take in the candidate's process before it fails, on a quiet machine
#: (scaled with the load: :mod:`dflash_audit.limits`); ``--candidate-timeout`` or
#: ``$DFLASH_AUDIT_CANDIDATE_TIMEOUT`` sets it in seconds.
DEFAULT_CANDIDATE_TIMEOUT_S = 600.0
CANDIDATE_TIMEOUT_ENV = "DFLASH_AUDIT_CANDIDATE_TIMEOUT"
#: Seconds the candidate's process may take to start (import torch, load the candidate) before
#: a case, on a quiet machine (scaled with the load); ``$DFLASH_AUDIT_CANDIDATE_START_TIMEOUT``.
CANDIDATE_START_TIMEOUT_S = 300.0
CANDIDATE_START_TIMEOUT_ENV = "DFLASH_AUDIT_CANDIDATE_START_TIMEOUT"
DEFAULT_PROFILE = "reference-model"
DEFAULT_VERIFIER = "smollm2-135m"
DEFAULT_DATA = "chitchat"
DEFAULT_SEQ_LEN = 256
DEFAULT_ROWS = 1
DEFAULT_CASES = 12
DEFAULT_ANCHORS = 16
#: Largest block_size audited: synthetic cases have up to ~4 B^2 draft queries (DFlash
#: drafters use 4-16).
MAX_BLOCK_SIZE = 64
#: Seeds data order, weights, anchors and synthetic cases. With 8 the first packed chitchat
#: row of 256 SmolLM2 tokens holds 3 conversations (126 supervised tokens), so the real case
#: crosses document boundaries.
DEFAULT_SEED = 8
#: Seconds the reference's run on all cases may take, on a quiet machine (scaled with the
#: load); ``$DFLASH_AUDIT_REFERENCE_TIMEOUT`` sets it in seconds.
REFERENCE_TIMEOUT_S = 1800.0
REFERENCE_TIMEOUT_ENV = "DFLASH_AUDIT_REFERENCE_TIMEOUT"
MAX_MASK_PICTURES = 8


@dataclass
class CompareOptions:
    """Arguments of one audit (the CLI's options; see :func:`compare_command`)."""

    ref: str | None = None
    ref_url: str | None = None
    candidate: str | None = None
    profile: str = DEFAULT_PROFILE
    cases: int = DEFAULT_CASES
    verifier: str = DEFAULT_VERIFIER
    data: str = DEFAULT_DATA
    seq_len: int = DEFAULT_SEQ_LEN
    rows: int = DEFAULT_ROWS
    anchors: int = DEFAULT_ANCHORS
    seed: int = DEFAULT_SEED
    out: Path = Path("reports")
    offline: bool = False
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    cache_dir: Path | None = None  # batch cache + import marker (default: the user cache)
    reference_timeout_s: float | None = None  # None: REFERENCE_TIMEOUT_S scaled with the load
    weights: Path | None = None  # a user's drafter checkpoint folder for the real cases
    dtype: str | None = None  # fp32 | bf16; None: the profile's dtype
    device: str = "cpu"  # cpu | cuda (both sides on the GPU, their flex-attention paths)
    #: per case, candidate process; None: DEFAULT_CANDIDATE_TIMEOUT_S scaled with the load
    candidate_timeout_s: float | None = None
    #: interpreter of the candidate's process (where the framework is installed); None: ours
    candidate_python: str | None = None
    #: refuse (exit 2) when the candidate's sandbox cannot start; None: on when CI=true
    require_sandbox: bool | None = None
    #: reuse the reference's verified outputs, the built cases and the passed import check
    #: kept in the cache (``--no-reference-cache``: recompute them, and replace the records)
    reference_cache: bool = True

    @property
    def sandbox_required(self) -> bool:
        """``require_sandbox``, defaulting to on under CI (``$CI`` = true)."""
        if self.require_sandbox is not None:
            return self.require_sandbox
        return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def check_options(opts: CompareOptions) -> None:
    """Validate the options that need no verifier, reference or candidate.

    Raises:
        CompareSetupError: a count out of range, nothing to audit, an unwritable ``--out``,
            a bad ``--verifier`` spec, ``--device`` or ``--dtype``, a limit's variable that
            is not a positive number (:mod:`dflash_audit.limits`).
    """
    from dflash_audit.limits import LimitError, limit_s

    try:  # read again when used: checked here, before any work
        for base, env in ((DEFAULT_CANDIDATE_TIMEOUT_S, CANDIDATE_TIMEOUT_ENV),
                          (CANDIDATE_START_TIMEOUT_S, CANDIDATE_START_TIMEOUT_ENV),
                          (REFERENCE_TIMEOUT_S, REFERENCE_TIMEOUT_ENV)):
            limit_s(base, env)
    except LimitError as exc:
        raise CompareSetupError(str(exc)) from None
    for name, value, low in (("--cases", opts.cases, 0), ("--rows", opts.rows, 0),
                             ("--anchors", opts.anchors, 1)):
        if value < low:
            raise CompareSetupError(f"{name} must be >= {low}, got {value}")
    if opts.rows == 0 and opts.cases == 0:
        raise CompareSetupError("nothing to audit: --rows 0 and --cases 0")
    if opts.rows and opts.seq_len < 16:
        raise CompareSetupError(f"--seq-len must be an integer >= 16, got {opts.seq_len}")
    existing = Path(opts.out).expanduser().absolute()
    while not existing.exists():  # nothing is created before the run: only checked
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise CompareSetupError(f"--out {opts.out}: cannot write reports there ({existing} is "
                                f"{'a file' if not existing.is_dir() else 'not writable'}); "
                                "choose a writable folder")
    from dflash_audit.data.errors import VerifierError
    from dflash_audit.data.verifier import check_verifier_spec

    try:  # checked before seconds of imports and batch work
        check_verifier_spec(opts.verifier)
    except VerifierError as exc:
        raise CompareSetupError(str(exc)) from None
    from dflash_audit.audit.precision import check_device_and_dtype

    try:
        check_device_and_dtype(opts.device, opts.dtype)
    except ValueError as exc:
        raise CompareSetupError(str(exc)) from None
