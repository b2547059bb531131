"""The supervisor's decisions: a pure function of the view, the health history, the clock and the policy.

``decide`` reads no clock and calls no Ray; the supervisor feeds it observations and carries out the
:class:`Decision` it returns. Every decision carries a readable ``reason``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from elastic.errors import ConfigError
from elastic.supervision.membership import HealthEvent, View
from elastic.supervision.notices import Notice
from elastic.validate import count, positive

__all__ = [
    "Policy",
    "Decision",
    "Stay",
    "Shrink",
    "Leave",
    "Grow",
    "Wait",
    "GiveUp",
    "decide",
    "next_view",
    "healthy_slices",
    "HealthTally",
]


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the supervisor answers changes in slice health.

    ``min_slices``: shrink while at least this many slices are healthy; below it, wait up to
    ``repair_timeout_s`` for repairs, then give up. ``max_slice_failures``: a slice that failed this
    many times is not taken back (0: no limit). ``respawn_every_s``: start a replacement agent for a slice
    whose agent died (its node alive, the slice not quarantined and not seen failing by the client) at most
    once per this many seconds per slice; None (the default): a dead agent's slice stays out until revived.
    """

    min_slices: int = 1
    repair_timeout_s: float = 60.0
    max_slice_failures: int = 0
    respawn_every_s: float | None = None

    def __post_init__(self) -> None:
        count("min_slices", self.min_slices)
        positive("repair_timeout_s", self.repair_timeout_s)
        count("max_slice_failures", self.max_slice_failures, 0, what="0 (no limit) or more")
        if self.respawn_every_s is not None:
            try:
                positive("respawn_every_s", self.respawn_every_s)
            except ConfigError as err:
                raise ConfigError(f"{err}; or None to turn respawning off") from err


@dataclass(frozen=True, kw_only=True)
class Decision:
    reason: str


@dataclass(frozen=True, kw_only=True)
class Stay(Decision):
    """Keep the current view."""


@dataclass(frozen=True, kw_only=True)
class Shrink(Decision):
    """Publish a view over ``to``: some active slices are lost (slices may also come back at once)."""

    to: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class Leave(Decision):
    """Publish a view over ``to``: the active slices ``leaving`` will go (a notice), none has failed. The job
    leaves them at a step boundary, its live state moved onto ``to``: nothing recomputed, no failure."""

    to: frozenset[int]
    leaving: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class Grow(Decision):
    """Publish a view over ``to``, a superset of the active slices."""

    to: frozenset[int]


@dataclass(frozen=True, kw_only=True)
class Wait(Decision):
    """Too few healthy slices: keep waiting for repairs until ``until``."""

    until: float


@dataclass(frozen=True, kw_only=True)
class GiveUp(Decision):
    """End the job with a clear error."""


def healthy_slices(history: Sequence[HealthEvent]) -> frozenset[int]:
    """Slices whose latest event says healthy."""
    last: dict[int, bool] = {}
    for e in history:
        last[e.slice] = e.healthy
    return frozenset(s for s, ok in last.items() if ok)


class HealthTally:
    """What :func:`decide` reads of a health history, folded in one event at a time.

    ``decide`` over a plain history rebuilds a tally on every call: O(history), and finding since when
    the job has been below ``min_slices`` is O(history x slices) that way. The supervisor keeps one tally
    instead and adds each event as it happens (O(1)), so judging costs O(slices) however long the
    history. A tally is built for one policy: ``min_slices`` and ``max_slice_failures`` shape it. The
    sets it exposes are its own: read them, never change them.
    """

    def __init__(self, policy: Policy, history: Iterable[HealthEvent] = ()) -> None:
        self.policy = policy
        self._last: dict[int, bool] = {}
        self._failures: dict[int, int] = {}
        self._healthy: set[int] = set()
        self._quarantined: set[int] = set()
        self._usable: set[int] = set()
        self._seen_enough = False  # usable slices reached min_slices at least once
        self._below_min_since: float | None = None
        for e in history:
            self.add(e)

    def add(self, e: HealthEvent) -> None:
        """Fold in the next event (events come in the order they happened)."""
        s = e.slice
        self._last[s] = e.healthy
        if e.healthy:
            self._healthy.add(s)
        else:
            self._healthy.discard(s)
            self._failures[s] = self._failures.get(s, 0) + 1
            limit = self.policy.max_slice_failures
            if limit and self._failures[s] >= limit:
                self._quarantined.add(s)  # a slice stops being usable from the failure that quarantines it
        if e.healthy and s not in self._quarantined:
            self._usable.add(s)
        else:
            self._usable.discard(s)
        if len(self._usable) >= self.policy.min_slices:
            self._seen_enough, self._below_min_since = True, None
        elif self._seen_enough and self._below_min_since is None:
            self._below_min_since = e.time

    def knows(self, slice_index: int) -> bool:
        """Whether any event has named this slice."""
        return slice_index in self._last

    def is_healthy(self, slice_index: int) -> bool:
        return self._last.get(slice_index, False)

    @property
    def healthy(self) -> AbstractSet[int]:
        """Slices whose latest event says healthy."""
        return self._healthy

    @property
    def quarantined(self) -> AbstractSet[int]:
        """Slices that failed ``max_slice_failures`` times (never, when that is 0)."""
        return self._quarantined

    @property
    def usable(self) -> AbstractSet[int]:
        """Healthy and not quarantined."""
        return self._usable

    @property
    def below_min_since(self) -> float | None:
        """Time since which the usable count has stayed below ``min_slices`` (None if it is not below, or
        never reached it)."""
        return self._below_min_since


def _names(slices: AbstractSet[int]) -> str:
    return ", ".join(str(s) for s in sorted(slices)) or "none"


def decide(
    view: View,
    history: Sequence[HealthEvent] | HealthTally,
    now: float,
    policy: Policy,
    coming: AbstractSet[int] = frozenset(),
    leaving: AbstractSet[int] = frozenset(),
    renewed: AbstractSet[int] = frozenset(),
) -> Decision:
    """What the supervisor should do now: its answer is carried out unchanged.

    ``history`` is the health events so far, oldest first, or a :class:`HealthTally` of them built for
    ``policy`` (the same answer, in O(slices) rather than O(history x slices)). A tally is only read.
    ``coming``: slices whose replacement agent has been started and is expected to register in time (the
    caller drops an expectation once it is late). Below ``min_slices`` the job waits, past
    ``repair_timeout_s`` too, while the slices coming would bring it back to ``min_slices``: it gives up only
    when nothing that could arrive in time would be enough. ``leaving``: slices a notice says will go; still
    healthy, they are left (:class:`Leave`) while ``min_slices`` others remain, and never taken back (a new agent of
    the slice, registering once it has gone and come back, is no longer leaving: the caller drops it then). Fewer
    would remain: the job keeps them until they go, and the failure path takes over then. ``renewed``: active
    slices whose agent is not the one they had when ``view`` was published (a lost member replaced before a view
    could drop it); where the answer would be :class:`Stay`, it is a :class:`Grow` over the same slices, so that
    the job re-forms with the new agent (not once the view gave up: that view stays).
    """
    decision = _judge(view, history, now, policy, coming, leaving)
    if isinstance(decision, Stay) and renewed and view.gave_up is None:  # a job that gave up stays given up
        return Grow(to=view.active, reason=f"slice(s) {_names(renewed)}: a new agent replaces the lost one")
    return decision


def _judge(
    view: View,
    history: Sequence[HealthEvent] | HealthTally,
    now: float,
    policy: Policy,
    coming: AbstractSet[int],
    leaving: AbstractSet[int],
) -> Decision:
    """:func:`decide` before a renewed member is taken into account."""
    if view.gave_up is not None:
        return Stay(reason=f"already gave up: {view.gave_up}")
    tally = history if isinstance(history, HealthTally) else HealthTally(policy, history)
    if tally.policy != policy:
        raise ValueError(f"decide() got a HealthTally built for {tally.policy}, not for {policy}")
    quarantined, healthy, usable = tally.quarantined, tally.healthy, tally.usable
    if len(usable) < policy.min_slices:
        since = tally.below_min_since
        if since is None:  # the job never had enough slices yet: still starting up
            return Stay(reason=f"waiting for slices to register: {len(usable)} of {policy.min_slices} needed")
        deadline = since + policy.repair_timeout_s
        arriving = frozenset(coming) - usable - quarantined
        if arriving and len(usable | arriving) >= policy.min_slices:
            return Wait(
                until=max(deadline, now),
                reason=f"{len(usable)} usable slice(s) ({_names(usable)}) < min_slices={policy.min_slices}; "
                f"replacement(s) for slice(s) {_names(arriving)} starting",
            )
        if now >= deadline:
            return GiveUp(
                reason=f"only {len(usable)} usable slice(s) ({_names(usable)}) for {now - since:.1f}s, "
                f"below min_slices={policy.min_slices}, and none repaired within repair_timeout_s="
                f"{policy.repair_timeout_s}"
            )
        return Wait(
            until=deadline,
            reason=f"{len(usable)} usable slice(s) ({_names(usable)}) < min_slices={policy.min_slices}; "
            f"waiting for repair (repair_timeout_s={policy.repair_timeout_s})",
        )
    going = frozenset(leaving) & usable  # a leaving slice that failed already is lost like any other
    kept = frozenset(usable) - going
    if going and len(kept) < policy.min_slices:
        kept = frozenset(usable)  # leaving would take the job below min_slices: keep them while they last
    lost = view.active - kept
    back = kept - view.active
    if lost and lost <= going:
        extra = f"; slice(s) {_names(back)} back" if back else ""
        return Leave(
            to=kept,
            leaving=lost,
            reason=f"slice(s) {_names(lost)} leaving (a notice){extra}: continue on {_names(kept)}",
        )
    if lost:
        extra = f"; slice(s) {_names(back)} back" if back else ""
        held = f" (slice(s) {_names(lost & quarantined)} failed too often)" if lost & quarantined else ""
        left = f"; slice(s) {_names(lost & going)} leaving" if lost & going else ""
        return Shrink(
            to=kept,
            reason=f"lost slice(s) {_names(lost - going)}{held}{left}{extra}: continue on {_names(kept)}",
        )
    if back:
        verb = "joined" if view.epoch == 0 else "back"
        return Grow(to=kept, reason=f"slice(s) {_names(back)} {verb}: run on {_names(kept)}")
    if quarantined & healthy:
        return Stay(reason=f"slice(s) {_names(quarantined & healthy)} failed too often and stay out")
    if going & view.active:
        return Stay(
            reason=f"slice(s) {_names(going & view.active)} leaving, but only {len(usable) - len(going)} would "
            f"remain, below min_slices={policy.min_slices}: kept until they go"
        )
    return Stay(reason="membership unchanged")


def next_view(view: View, decision: Decision, notice_of: Callable[[int], Notice]) -> View | None:
    """The view that carries out ``decision`` after ``view`` (the next epoch), or None to keep ``view`` (:class:`Stay`,
    :class:`Wait`). ``notice_of``: the notice each slice a :class:`Leave` leaves goes on (the view holds each once)."""
    epoch = view.epoch + 1
    if isinstance(decision, Leave):
        notices: dict[int, Notice] = {}  # one notice may name several of the slices
        for s in sorted(decision.leaving):
            notices.setdefault(id(notice_of(s)), notice_of(s))
        return View(
            epoch=epoch,
            active=decision.to,
            reason=decision.reason,
            leaving=decision.leaving,
            notices=tuple(notices.values()),
        )
    if isinstance(decision, (Shrink, Grow)):
        return View(epoch=epoch, active=decision.to, reason=decision.reason)
    if isinstance(decision, GiveUp):
        return View(epoch=epoch, active=view.active, gave_up=decision.reason, reason=decision.reason)
    return None
