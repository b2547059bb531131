"""The membership view the supervisor publishes and clients follow."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["View", "HealthEvent"]


@dataclass(frozen=True, kw_only=True)
class View:
    """Epoch ``epoch``: train on the slices in ``active``. Every change bumps the epoch.

    ``gave_up`` holds the reason once the supervisor has given up; the view never changes after.
    """

    epoch: int = 0
    active: frozenset[int] = frozenset()
    gave_up: str | None = None
    reason: str = "starting"


@dataclass(frozen=True, kw_only=True)
class HealthEvent:
    """Slice ``slice`` was seen healthy (``healthy=True``) or lost at monotonic time ``time``."""

    time: float
    slice: int
    healthy: bool
    cause: str = ""
