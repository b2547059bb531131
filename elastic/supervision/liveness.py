"""Who is silent: the supervisor's heartbeat judge, with two guards against false alarms on a busy machine.

Every ``tick_s`` :meth:`Liveness.run` looks for slices whose agent has not beaten for ``timeout_s`` and then asks the
caller to judge. Time the supervisor itself did not run (its loop starved or paused) counts as nobody's silence;
and a silent slice is lost only if its agent does not answer a direct question (``alive``) within
``min(1 s, timeout_s / 2)`` either: a hung or stopped host answers nothing; a slow one does, and counts as a late
beat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from elastic.supervision.registry import AgentRegistry

__all__ = ["Liveness"]


class Liveness:
    """Watches ``agents``' beats. ``late(slice, silent_s)``: the agent answered (its silence starts again);
    ``lost(slice, incarnation, silent_s)``: it did not (already dropped from ``agents``); ``spawn`` starts a task."""

    def __init__(
        self,
        agents: AgentRegistry,
        *,
        timeout_s: float,
        tick_s: float,
        signed: Callable[[Any], Any],
        log: Any,
        late: Callable[[int, float], None],
        lost: Callable[[int, int | None, float], Awaitable[None]],
        spawn: Callable[[Coroutine[Any, Any, None]], object],
    ) -> None:
        self._agents, self._timeout_s, self._tick_s, self._signed = agents, timeout_s, tick_s, signed
        self._log, self._late, self._lost, self._spawn = log, late, lost, spawn

    async def run(self, judge: Callable[[], Awaitable[None]], epoch: Callable[[], int]) -> None:
        """Forever: every ``tick_s``, ask each newly silent slice's agent (in a task of its own), then ``judge``."""
        last = time.monotonic()
        while True:
            now = time.monotonic()
            stalled = now - last - self._tick_s
            if stalled > max(self._tick_s, 0.1):  # this loop did not run: nobody's silence grew meanwhile
                self._agents.stalled(stalled)
                self._log.info("supervisor_stalled", seconds=round(stalled, 2), epoch=epoch())
            last = now
            for s, incarnation in self._agents.overdue(now, self._timeout_s):
                self._spawn(self.confirm(s, incarnation))
            await judge()
            await asyncio.sleep(self._tick_s)

    async def confirm(self, s: int, incarnation: int | None) -> None:
        """Ask slice ``s``'s agent whether it lives before it is lost for its silence."""
        agent, bound = self._agents.handle(s), min(1.0, self._timeout_s / 2)
        started = time.monotonic()
        answered = False
        try:
            if agent is not None:
                answered = bool(await asyncio.wait_for(self._signed(agent).alive.remote(s), bound))
        except Exception:  # noqa: BLE001 - no answer in time, or the agent is gone: it is silent for real
            answered = False
        finally:
            self._agents.asked(s)
        if self._agents.agent(s) != incarnation:
            return  # dropped or replaced meanwhile
        silent = time.monotonic() - self._agents.last_beat(s, started)
        if answered:  # alive and working: its beats are late (a loaded machine), not missing
            self._agents.late(s, time.monotonic())
            self._late(s, silent)
        elif silent > self._timeout_s:  # else it beat while we asked
            # Dropped, not refused: an agent that beats again re-registers and rejoins through decide.
            self._agents.lapsed(s)
            await self._lost(s, incarnation, silent)
