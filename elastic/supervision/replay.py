"""A restarted supervisor's state, rebuilt from its event log's records: a pure function, no actor, no Ray.

:func:`replay` folds the supervisor's own records (those of its writer in the run) into the last view it published,
its health history (so quarantine holds), the agents it refused for good, the notices it took and the slices
leaving on them. Only records that verify under the job's stream key count (the others are returned apart, as
forged); records of kinds it does not fold (``wait``, ``late``, ``inject``, ...) are skipped. Records are folded in
the stream's order (wall time, writer, sequence number) whatever order they come in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elastic.supervision.events import verify
from elastic.supervision.membership import HealthEvent, View
from elastic.supervision.notices import Notice
from elastic.supervision.policy import HealthTally, Policy
from elastic.supervision.registry import AGENT_DIED, CLIENT_REPORT, AgentRegistry

__all__ = ["Replayed", "replay"]


@dataclass(frozen=True, kw_only=True)
class Replayed:
    """What the records say: the ``view`` to resume from, the health ``tally``, the agent ``registry``, the
    ``records`` that verified (in order) and those ``forged`` (under the key, not the job's own)."""

    view: View
    tally: HealthTally
    registry: AgentRegistry
    records: list[dict[str, Any]]
    forged: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        """What was rebuilt, for the log."""
        return {
            "epoch": self.view.epoch,
            "active": sorted(self.view.active),
            "quarantined": sorted(self.tally.quarantined),
            "refused": self.registry.refusals,
        }


def replay(
    records: Iterable[dict[str, Any]], *, policy: Policy, wall: float, now: float, key: str | None = None
) -> Replayed:
    """The state in ``records`` (the supervisor's own, any order) at wall time ``wall``, monotonic time ``now``.

    ``key``: the job's stream key (None: every record counts). A health event's time is its wall time placed on the
    monotonic clock (``now`` less its age). The slices healthy at the end count as registered, their agents
    unknown, and beating from ``now``: they must register again within a heartbeat timeout.
    """
    ordered = sorted(records, key=lambda r: (r["wall"], r["writer"], r["seq"]))
    good, forged = verify(ordered, key) if key is not None else (ordered, [])
    view, tally, registry = View(), HealthTally(policy), AgentRegistry()
    for e in good:
        if e["kind"] == "view":
            view = View(
                epoch=e["epoch"],
                active=frozenset(e["active"]),
                gave_up=e["gave_up"],
                reason=e["reason"],
                leaving=frozenset(e.get("leaving", ())),
            )
        elif e["kind"] == "health":
            s, incarnation = e["slice"], e.get("incarnation")
            at = now - max(0.0, wall - e["wall"])
            tally.add(HealthEvent(time=at, slice=s, healthy=e["healthy"], cause=e["cause"]))
            if incarnation is not None:
                registry.saw(s, incarnation)
                if e["cause"].startswith(CLIENT_REPORT):
                    registry.client_lost(s, incarnation)
        elif e["kind"] == "refused":
            registry.refuse(e["slice"], e["incarnation"])
            if e["cause"] == AGENT_DIED:
                registry.died(e["slice"], e["incarnation"])
        elif e["kind"] == "notice":
            notice = Notice(
                slices=frozenset(e["slices"]),
                deadline=e["deadline"],
                reason=e["reason"],
                source=e["source"],
                at=e["at"],
            )
            registry.leave(dict(e["agents"]), notice)
    registry.resume(tally.healthy, view.active, now)
    return Replayed(view=view, tally=tally, registry=registry, records=good, forged=forged)
