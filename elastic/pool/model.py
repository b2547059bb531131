"""The pool's data: the jobs it knows, the slices it lends, what happens to them, and what it decides.

All frozen, keyword-only, and plain enough to be written to the pool's log as JSON and read back
(:func:`state_to_dict`, :func:`state_from_dict`). A slice is an index ``0..size-1``; a *lease* is a slice held by a
job. A job's *asked* count is what it wants to run on (``want``, or ``max_slices``), between its ``min_slices`` and
``max_slices``; its ``spares`` are how many of its failed slices the pool replaces by taking slices from
lower-priority jobs (a hot swap).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from elastic.errors import ConfigError

__all__ = [
    "Arrive",
    "Event",
    "JobSpec",
    "JobStatus",
    "Leave",
    "Plan",
    "PoolState",
    "Reclaim",
    "Release",
    "Resize",
    "SliceFailed",
    "SliceReturned",
    "event_from_dict",
    "event_to_dict",
    "new_state",
    "state_from_dict",
    "state_to_dict",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(f"a pool {what} is 1-64 letters, digits, '_', '.' or '-' (not first); got {value!r}")


def _check_int(what: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{what} is an integer >= {low}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A job as it asks the pool for slices: ``user`` owns it; higher ``priority`` goes first."""

    name: str
    user: str
    priority: int = 0
    min_slices: int = 1
    max_slices: int = 1
    spares: int = 0

    def __post_init__(self) -> None:
        _check_name("job name", self.name)
        _check_name("user name", self.user)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"priority is an integer (higher goes first); got {self.priority!r}")
        _check_int("min_slices", self.min_slices, 1)
        _check_int("max_slices", self.max_slices, 1)
        _check_int("spares", self.spares, 0)
        if self.max_slices < self.min_slices:
            raise ConfigError(f"max_slices={self.max_slices} is below min_slices={self.min_slices}: raise max_slices")


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A job the pool knows: its spec, when it arrived (the pool's counter), and the count it asks now."""

    spec: JobSpec
    arrival: int
    want: int
    ran: bool = False  # it has held at least its min_slices: below it again, it is suspended, not waiting

    @property
    def asked(self) -> int:
        return max(self.spec.min_slices, min(self.want, self.spec.max_slices))


@dataclass(frozen=True, kw_only=True)
class PoolState:
    """Slices ``0..size-1``; ``held``: slice -> job; ``reclaiming``: slice -> the job it is wanted for (a notice
    sent to its holder, which still holds it until it releases it); ``failed``: slice -> the job that held it
    (None: free when it failed); ``quotas``: user -> most slices their jobs hold together (absent: no limit)."""

    size: int
    jobs: Mapping[str, Entry] = field(default_factory=dict)
    held: Mapping[int, str] = field(default_factory=dict)
    reclaiming: Mapping[int, str | None] = field(default_factory=dict)
    failed: Mapping[int, str | None] = field(default_factory=dict)
    quotas: Mapping[str, int] = field(default_factory=dict)
    arrivals: int = 0

    def holding(self, job: str) -> frozenset[int]:
        return frozenset(s for s, j in self.held.items() if j == job)

    def free(self) -> list[int]:
        """Healthy slices nobody holds, lowest first."""
        return [s for s in range(self.size) if s not in self.held and s not in self.failed]

    def lost(self, job: str) -> int:
        """The job's slices that failed and have not come back."""
        return sum(1 for j in self.failed.values() if j == job)


def new_state(size: int, quotas: Mapping[str, int] | None = None) -> PoolState:
    """An empty pool of ``size`` slices (``ConfigError`` for a size below 1 or a bad quota)."""
    _check_int("a pool's slices", size, 1)
    for user, quota in (quotas or {}).items():
        _check_name("user name", user)
        _check_int(f"user {user!r}'s quota", quota, 0)
    return PoolState(size=size, quotas=dict(quotas or {}))


# -- events -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Arrive:
    spec: JobSpec
    want: int | None = None  # default: max_slices


@dataclass(frozen=True, kw_only=True)
class Leave:
    job: str


@dataclass(frozen=True, kw_only=True)
class Release:
    """The job left these slices (after a reclaim notice, at a step boundary, or of its own accord)."""

    job: str
    slices: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class Resize:
    """The job asks to run on ``want`` slices (kept within its min and max)."""

    job: str
    want: int


@dataclass(frozen=True, kw_only=True)
class SliceFailed:
    slice: int


@dataclass(frozen=True, kw_only=True)
class SliceReturned:
    slice: int


Event = Arrive | Leave | Release | Resize | SliceFailed | SliceReturned
_EVENTS: dict[str, type] = {c.__name__: c for c in (Arrive, Leave, Release, Resize, SliceFailed, SliceReturned)}


# -- decisions ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Reclaim:
    """A notice to ``job``: leave ``slices`` at a step boundary (they go to ``for_job``, or back to the pool)."""

    job: str
    slices: frozenset[int]
    for_job: str | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """``state``: running (at least its min), waiting (never ran at its min), suspended (it ran, now below its min,
    every slice reclaimed); ``held``: slices it holds now; ``target``: what the pool means it to hold."""

    state: str
    held: int
    target: int
    asked: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What :func:`~elastic.pool.policy.decide` answers: the new ``state``; ``grants`` (free slices lent now);
    ``reclaims`` (notices to send); ``cancels`` (earlier notices withdrawn: the slices stay with their holder);
    every job's ``status``; ``reason``, one line."""

    state: PoolState
    grants: Mapping[str, frozenset[int]]
    reclaims: tuple[Reclaim, ...]
    cancels: Mapping[str, frozenset[int]]
    status: Mapping[str, JobStatus]
    reason: str


# -- records ------------------------------------------------------------------------------------------------------
def event_to_dict(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for name, value in vars(event).items():
        if isinstance(value, JobSpec):
            value = dict(vars(value))
        elif isinstance(value, frozenset):
            value = sorted(value)
        out[name] = value
    return out


def event_from_dict(data: Mapping[str, Any]) -> Event:
    """The event written by :func:`event_to_dict` (``ConfigError`` when it is not one)."""
    try:
        cls = _EVENTS[data["type"]]
        fields = {k: v for k, v in data.items() if k != "type"}
        if "spec" in fields:
            fields["spec"] = JobSpec(**fields["spec"])
        if "slices" in fields:
            fields["slices"] = frozenset(fields["slices"])
        event: Event = cls(**fields)
    except (KeyError, TypeError) as err:
        raise ConfigError(f"not a pool event: {dict(data)!r}") from err
    return event


def state_to_dict(state: PoolState) -> dict[str, Any]:
    return {
        "size": state.size,
        "jobs": {
            n: {"spec": dict(vars(e.spec)), "arrival": e.arrival, "want": e.want, "ran": e.ran}
            for n, e in state.jobs.items()
        },
        "held": {str(s): j for s, j in state.held.items()},
        "reclaiming": {str(s): j for s, j in state.reclaiming.items()},
        "failed": {str(s): j for s, j in state.failed.items()},
        "quotas": dict(state.quotas),
        "arrivals": state.arrivals,
    }


def state_from_dict(data: Mapping[str, Any]) -> PoolState:
    """The state written by :func:`state_to_dict` (``ConfigError`` when it is not one)."""
    try:
        jobs = {
            n: Entry(spec=JobSpec(**e["spec"]), arrival=int(e["arrival"]), want=int(e["want"]), ran=bool(e["ran"]))
            for n, e in data["jobs"].items()
        }
        state = new_state(int(data["size"]), data["quotas"])
        return replace(
            state,
            jobs=jobs,
            held={int(s): j for s, j in data["held"].items()},
            reclaiming={int(s): j for s, j in data["reclaiming"].items()},
            failed={int(s): j for s, j in data["failed"].items()},
            arrivals=int(data["arrivals"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(f"not a pool state: {err}") from err
