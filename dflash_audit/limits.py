"""Wall-clock limits that scale with the machine and can be set, and the message when one is
hit.

A limit is a base in seconds measured on a quiet 2-core machine. :func:`limit_s` returns it
times the machine's load (the 1-minute load average per core, at least 1: a machine busy with
other jobs gets proportionally longer), or times ``$DFLASH_AUDIT_TIMEOUT_SCALE`` when that is
set, or the limit's own variable (seconds) when that is set. :class:`Watch` times a wait
against such a limit and stretches it while the load rises. :func:`exceeded` words what a
person needs when one is hit: how long it waited, the load, and the exact setting to raise.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

SCALE_ENV = "DFLASH_AUDIT_TIMEOUT_SCALE"


class LimitError(ValueError):
    """A limit's environment variable is not a positive number of seconds (or factor)."""


def load_factor() -> float:
    """The 1-minute load average per core, at least 1 (1 where the OS gives none)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 1.0
    return max(1.0, load / max(os.cpu_count() or 1, 1))


def _positive(env: str) -> float | None:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise LimitError(f"{env}={raw!r}: give a positive number, e.g. {env}=3"
                         if env == SCALE_ENV else
                         f"{env}={raw!r}: give seconds above 0, e.g. {env}=900")
    return value


def limit_s(base_s: float, env: str | None = None) -> float:
    """The limit in seconds: ``$env`` when set, else ``base_s`` times ``$DFLASH_AUDIT_TIMEOUT_
    SCALE`` when set, else times :func:`load_factor`.

    Raises:
        LimitError: a variable that is set but not a positive finite number.
    """
    own = _positive(env) if env else None
    if own is not None:
        return own
    scale = _positive(SCALE_ENV)
    return base_s * (scale if scale is not None else load_factor())


def exceeded(what: str, waited_s: float, env: str | None = None, *,
             option: str | None = None, scaled: bool = True) -> str:
    """One line for a limit that was hit: ``{what} did not finish in N s (load L on C cores:
    the machine may be busy); raise the limit with OPTION M (or ENV=M or
    DFLASH_AUDIT_TIMEOUT_SCALE=3 for every limit)``, M three times N.

    Args:
        env: the limit's own variable; option: the command-line option that sets it.
        scaled: False where the limit was given as seconds (an option): only that is named.
    """
    try:
        load = f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except (OSError, AttributeError):
        load = f"{os.cpu_count()} cores"
    more = int(waited_s * 3)
    settings = [*([f"{option} {more}"] if option else []),
                *([f"{env}={more}"] if env and scaled else [])]
    if scaled or not settings:
        settings.append(f"{SCALE_ENV}=3" + (" for every limit" if settings else ""))
    other = f" (or {' or '.join(settings[1:])})" if settings[1:] else ""
    return (f"{what} did not finish in {waited_s:.0f} s ({load}: the machine may be busy); "
            f"raise the limit with {settings[0]}{other}")


@dataclass
class Watch:
    """A wait timed against a limit: ``fixed_s`` seconds when given, else :func:`limit_s` of
    ``base_s`` / ``env``, re-read when it runs out so that a machine that got busier meanwhile
    gets the longer limit (never a shorter one than at the start).

    Raises:
        LimitError: (on creation) a variable that is set but not a positive number.
    """

    base_s: float
    env: str | None = None
    fixed_s: float | None = None
    since: float = field(init=False, default=0.0)
    limit: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Start timing again from now (the limit is read again)."""
        self.since = time.monotonic()
        self.limit = self.fixed_s if self.fixed_s is not None else limit_s(self.base_s, self.env)

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.since

    def over(self) -> bool:
        """Whether the wait ran past the limit (:attr:`limit`, stretched with the load)."""
        if self.elapsed() <= self.limit:
            return False
        if self.fixed_s is None:
            self.limit = max(self.limit, limit_s(self.base_s, self.env))
        return self.elapsed() > self.limit
