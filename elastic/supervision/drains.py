"""Ray node drains as notices: the GCS says which nodes are draining and by when; slices whose agent runs there go.

Ray's GCS keeps the nodes being drained (``ray drain-node``, the autoscaler's ``DrainNode``) with their deadlines,
readable as ``{node_id_hex: deadline_ms}`` (0: no deadline) through ``ray._private.state.state.get_draining_nodes()``,
the call Ray Train's preemption watcher polls. :class:`DrainWatcher` polls it from the supervisor, learns the node of
each slice's agent from the GCS actor table, and hands each new drain to the supervisor's one ``notice`` entry point
as a :class:`Notice` with source ``ray_drain``.

:func:`drain_notices` is the decision, pure: which notices a set of draining nodes makes, given where each slice's
agent runs and which slices already have one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from elastic.errors import ElasticError
from elastic.log import get_logger
from elastic.supervision import ray_internals
from elastic.supervision.notices import Notice

__all__ = ["DRAIN_POLL_S", "NO_DEADLINE_S", "DrainWatcher", "drain_notices"]

DRAIN_POLL_S = 1.0  # how often the GCS is asked which nodes are draining
NO_DEADLINE_S = 30.0  # the warning taken for a drain without a deadline


def drain_notices(
    draining: Mapping[str, int], nodes: Mapping[int, str], noticed: AbstractSet[int], now: float
) -> list[Notice]:
    """One notice per draining node that holds slices not yet noticed. ``draining``: node id -> deadline in ms since
    the epoch (0: none; then ``NO_DEADLINE_S`` from ``now``); ``nodes``: slice -> the node its agent runs on;
    ``noticed``: slices already leaving (or already told). A deadline already past still makes a notice: the
    supervisor refuses it, in the stream, and the slice's loss takes the failure path."""
    out = []
    for node, deadline_ms in sorted(draining.items()):
        slices = frozenset(s for s, n in nodes.items() if n == node and s not in noticed)
        if not slices:
            continue
        deadline = deadline_ms / 1000.0 if deadline_ms > 0 else now + NO_DEADLINE_S
        reason = f"Ray drains node {node[:12]}" + ("" if deadline_ms > 0 else " (no deadline given)")
        out.append(Notice(slices=slices, deadline=deadline, reason=reason, source="ray_drain", at=now))
    return out


def _draining() -> dict[str, int]:
    return ray_internals.draining_nodes()


def _node_of(actor_id: str) -> str | None:
    entry = ray_internals.actor_table(actor_id)
    node = (entry or {}).get("Address", {}).get("NodeID")
    return str(node) if node else None


class DrainWatcher:
    """Polls the GCS for draining nodes every ``poll_s`` and hands each new drain to ``take`` (the supervisor's
    notice entry point). ``agents()``: slice -> its agent's actor handle, now; ``leaving()``: slices leaving now."""

    def __init__(
        self,
        job: str,
        agents: Callable[[], Mapping[int, Any]],
        leaving: Callable[[], AbstractSet[int]],
        take: Callable[[Notice], Awaitable[object]],
        poll_s: float = DRAIN_POLL_S,
    ) -> None:
        self._agents, self._leaving, self._take, self._poll_s = agents, leaving, take, poll_s
        self._nodes: dict[str, str | None] = {}  # actor id -> node id (an actor does not move)
        self._told: dict[int, str] = {}  # slice -> the agent (actor id) already told of its node's drain
        self._log = get_logger("elastic.supervision.drains", job=job)
        self._failing = False

    async def run(self) -> None:
        import time

        while True:
            try:
                await self.poll_once(time.time())
                if self._failing:
                    self._log.info("drain_poll_ok")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a GCS hiccup: poll again (logged once per change)
                if not self._failing:
                    self._log.warning("drain_poll_failed", error=f"{type(err).__name__}: {err}"[:300])
                self._failing = True
            await asyncio.sleep(self._poll_s)

    async def poll_once(self, now: float) -> list[Notice]:
        """Ask the GCS once; hand each new drain's notice over. Returns the notices handed over."""
        draining = await asyncio.to_thread(_draining)
        if not draining:
            return []
        agents = {s: ray_internals.actor_id(a) for s, a in self._agents().items()}  # the handle's id
        for actor_id in set(agents.values()) - set(self._nodes):
            self._nodes[actor_id] = await asyncio.to_thread(_node_of, actor_id)
        nodes = {s: node for s, a in agents.items() if (node := self._nodes.get(a)) is not None}
        noticed = set(self._leaving()) | {s for s, a in self._told.items() if agents.get(s) == a}
        taken = []
        for notice in drain_notices(draining, nodes, noticed, now):
            for s in notice.slices:
                self._told[s] = agents[s]
            try:
                await self._take(notice)
                taken.append(notice)
            except ElasticError as err:  # refused (written to the stream by the supervisor): the failure path
                self._log.warning("drain_notice_refused", slices=sorted(notice.slices), why=str(err))
        return taken
