"""The supervisor's decisions: a pure function of the view, the health history, the clock and the policy.

``decide`` reads no clock and calls no Ray; the supervisor feeds it observations and carries out the
:class:`Decision` it returns. Every decision carries a readable ``reason``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic.config import Policy
from elastic.membership import HealthEvent, View

__all__ = ["Decision", "Stay", "Shrink", "Grow", "Wait", "GiveUp", "decide", "healthy_slices"]


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


def _failures(history: Sequence[HealthEvent]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for e in history:
        if not e.healthy:
            counts[e.slice] = counts.get(e.slice, 0) + 1
    return counts


def _below_min_since(history: Sequence[HealthEvent], policy: Policy) -> float | None:
    """Time since which the usable count has stayed below ``min_slices`` (None if it never reached it).

    A slice stops being usable from the failure that quarantines it onward.
    """
    last: dict[int, bool] = {}
    failed: dict[int, int] = {}
    since: float | None = None
    seen_enough = False
    for e in history:
        last[e.slice] = e.healthy
        if not e.healthy:
            failed[e.slice] = failed.get(e.slice, 0) + 1
        limit = policy.max_slice_failures
        count = sum(ok and not (limit and failed.get(s, 0) >= limit) for s, ok in last.items())
        if count >= policy.min_slices:
            seen_enough, since = True, None
        elif seen_enough and since is None:
            since = e.time
    return since


def _names(slices: frozenset[int]) -> str:
    return ", ".join(str(s) for s in sorted(slices)) or "none"


def decide(view: View, history: Sequence[HealthEvent], now: float, policy: Policy) -> Decision:
    """What the supervisor should do now."""
    if view.gave_up is not None:
        return Stay(reason=f"already gave up: {view.gave_up}")
    failures = _failures(history)
    quarantined = frozenset(
        s for s, n in failures.items() if policy.max_slice_failures and n >= policy.max_slice_failures
    )
    healthy = healthy_slices(history)
    usable = healthy - quarantined
    if len(usable) < policy.min_slices:
        since = _below_min_since(history, policy)
        if since is None:  # the job never had enough slices yet: still starting up
            return Stay(reason=f"waiting for slices to register: {len(usable)} of {policy.min_slices} needed")
        deadline = since + policy.repair_timeout_s
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
    lost = view.active - usable
    back = usable - view.active
    if lost:
        extra = f"; slice(s) {_names(back)} back" if back else ""
        held = f" (slice(s) {_names(lost & quarantined)} failed too often)" if lost & quarantined else ""
        return Shrink(to=usable, reason=f"lost slice(s) {_names(lost)}{held}{extra}: continue on {_names(usable)}")
    if back:
        verb = "joined" if view.epoch == 0 else "back"
        return Grow(to=usable, reason=f"slice(s) {_names(back)} {verb}: run on {_names(usable)}")
    if quarantined & healthy:
        return Stay(reason=f"slice(s) {_names(quarantined & healthy)} failed too often and stay out")
    return Stay(reason="membership unchanged")
