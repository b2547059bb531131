"""The membership view the supervisor publishes and clients follow."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.supervision.notices import Notice

__all__ = ["View", "HealthEvent"]


@dataclass(frozen=True, kw_only=True)
class View:
    """Epoch ``epoch``: train on the slices in ``active``. Every change bumps the epoch.

    ``gave_up`` holds the reason once the supervisor has given up; the view never changes after. ``leaving``: the
    slices this view left because a notice said they will go (not because they failed), and ``notices`` the
    notices behind it: the job leaves them at a step boundary, moving its live state onto ``active``.
    """

    epoch: int = 0
    active: frozenset[int] = frozenset()
    gave_up: str | None = None
    reason: str = "starting"
    leaving: frozenset[int] = frozenset()
    notices: tuple[Notice, ...] = ()


@dataclass(frozen=True, kw_only=True)
class HealthEvent:
    """Slice ``slice`` was seen healthy (``healthy=True``) or lost at monotonic time ``time``."""

    time: float
    slice: int
    healthy: bool
    cause: str = ""
