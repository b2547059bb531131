"""Notices that slices will go: what a scheduler says before it takes a slice away, and whether the job takes it.

A :class:`Notice` names the slices that will go, by when (``deadline``, wall-clock seconds since the epoch, so that
it means the same in every process of the job), why, and who said so (``source``). Every source (a Python call,
``ElasticJob.notice``; the operator's ``elastic drain``; a Ray node drain; a host's maintenance event) hands its
notice to the supervisor through one method, ``Supervisor.notice`` (the drain watcher inside the supervisor, and an
agent's ``agent_notice``, join the same path past the credential check), which writes it to the job's event stream,
marks the slices *leaving* (not failed) and publishes a view without them.

:func:`refusal` is pure: why a notice cannot be taken (a slice the job does not hold, a deadline already past), or
None. It reads no clock; the caller passes ``now``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from elastic.errors import NoticeError

__all__ = ["Notice", "SOURCES", "make_notice", "move_bound", "past_deadline", "refusal"]

# Where a notice may come from: a Python call (``api``), the operator's ``elastic drain`` (``operator``), a Ray node
# drain read from the GCS (``ray_drain``, :mod:`elastic.supervision.drains`), a host's metadata server
# (``maintenance``, :mod:`elastic.supervision.maintenance`), a signal to a slice's worker process (``sigterm``,
# :mod:`elastic.placements.signal_notice`), a pool of slices taking one back for another job (``pool``,
# :mod:`elastic.pool.member`).
SOURCES = ("api", "ray_drain", "sigterm", "maintenance", "operator", "pool")


@dataclass(frozen=True, kw_only=True)
class Notice:
    """Slices ``slices`` will go by ``deadline`` (wall-clock seconds since the epoch), for ``reason``, as ``source``
    says. ``at``: when the notice was given (wall clock), so ``lead_s`` is the warning it gave."""

    slices: frozenset[int]
    deadline: float
    reason: str
    source: str = "api"
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.slices, frozenset) or not self.slices:
            raise NoticeError(f"a notice names at least one slice, as a frozenset of ints; got {self.slices!r}")
        if any(isinstance(s, bool) or not isinstance(s, int) for s in self.slices):
            raise NoticeError(f"a notice names slices by their index (ints); got {sorted(map(repr, self.slices))}")
        for name in ("deadline", "at"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise NoticeError(f"a notice's {name} is a wall-clock time in seconds; got {value!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise NoticeError("a notice says why the slices go: give a reason")
        if self.source not in SOURCES:
            raise NoticeError(f"a notice's source is one of {', '.join(SOURCES)}; got {self.source!r}")

    @property
    def lead_s(self) -> float:
        """The warning the notice gave: seconds from when it was given to its deadline."""
        return self.deadline - self.at

    def record(self) -> dict[str, object]:
        """The notice as plain data (an event record's fields)."""
        return {
            "slices": sorted(self.slices),
            "deadline": round(self.deadline, 3),
            "reason": self.reason,
            "source": self.source,
            "at": round(self.at, 3),
            "lead_s": round(self.lead_s, 3),
        }


def make_notice(slices: Iterable[int] | int, deadline_s: float, reason: str, source: str = "api") -> Notice:
    """A notice given now whose slices go within ``deadline_s`` seconds (``NoticeError`` for input that is not one)."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not math.isfinite(deadline_s):
        raise NoticeError(f"notice deadline_s is seconds from now; got {deadline_s!r}")
    if deadline_s <= 0:
        raise NoticeError(f"notice refused: its deadline has passed (deadline_s={deadline_s}); the job is unchanged")
    try:
        chosen = frozenset([slices] if isinstance(slices, int) else slices)
    except TypeError as err:
        raise NoticeError(f"notice slices is a slice index or several; got {slices!r}") from err
    at = time.time()
    return Notice(slices=chosen, deadline=at + deadline_s, reason=reason, source=source, at=at)


def _names(slices: AbstractSet[int]) -> str:
    return ", ".join(str(s) for s in sorted(slices))


def refusal(
    notice: Notice, *, active: AbstractSet[int], leaving: AbstractSet[int], now: float, gave_up: bool = False
) -> str | None:
    """Why the job cannot take ``notice`` (one line), or None. ``active``: the slices the job runs on; ``leaving``:
    slices already leaving; ``now``: the wall clock."""
    if gave_up:
        return "notice refused: the job has given up"
    if notice.deadline <= now:
        return f"notice refused: its deadline passed {now - notice.deadline:.1f}s ago; the job is unchanged"
    already = notice.slices & leaving
    if already:
        return f"notice refused: slice(s) {_names(already)} already leaving; the job is unchanged"
    unknown = notice.slices - active
    if unknown:
        held = _names(active) or "none"
        return f"notice refused: the job does not hold slice(s) {_names(unknown)} (it runs on {held}); unchanged"
    return None


def move_bound(wait_s: float | None, notices: Iterable[Notice], now: float) -> float | None:
    """How long a move off leaving slices may wait: ``wait_s`` (None: no bound), but never past the earliest
    deadline of ``notices`` (0 once it has passed: the failure path takes over)."""
    deadlines = [n.deadline for n in notices]
    if not deadlines:
        return wait_s
    left = max(min(deadlines) - now, 0.0)
    return left if wait_s is None else min(wait_s, left)


def past_deadline(notices: Iterable[Notice], now: float) -> str:
    """The slices of ``notices`` whose deadline has passed by ``now``, named ("" when none has)."""
    late: set[int] = set()
    for n in notices:
        if n.deadline <= now:
            late |= n.slices
    return _names(late)
