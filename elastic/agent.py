"""One agent actor per slice: it heartbeats to the supervisor and dies with its host.

On a real cluster an agent is placed on its slice's host, so a host loss kills it and the supervisor
notices at once (its lifeline call fails); a hung host stops its heartbeats.
"""
from __future__ import annotations

import asyncio

import ray

from elastic.log import get_logger

__all__ = ["SliceAgent"]


@ray.remote(num_cpus=0)
class SliceAgent:
    def __init__(self, slice_index: int, incarnation: int, supervisor: object, interval_s: float, job: str) -> None:
        self._slice = slice_index
        self._incarnation = incarnation
        self._supervisor = supervisor
        self._interval_s = interval_s
        self._silent = False
        self._task: asyncio.Task | None = None
        self._log = get_logger("elastic.agent", job=job, slice=slice_index)

    async def start(self) -> int:
        """Register with the supervisor and start heartbeating; returns the incarnation."""
        await self._supervisor.register.remote(self._slice, self._incarnation, ray.get_runtime_context().current_actor)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._beat())
        return self._incarnation

    async def _beat(self) -> None:
        while True:
            if not self._silent:
                try:
                    known = await self._supervisor.heartbeat.remote(self._slice, self._incarnation)
                    if not known:  # the supervisor restarted or dropped us: register again
                        await self._supervisor.register.remote(
                            self._slice, self._incarnation, ray.get_runtime_context().current_actor
                        )
                except Exception as err:  # noqa: BLE001 - keep beating while the supervisor restarts
                    self._log.warning("heartbeat_failed", error=repr(err))
            await asyncio.sleep(self._interval_s)

    async def lifeline(self) -> None:
        """Never returns; the caller's await fails when this actor dies."""
        await asyncio.Event().wait()

    async def silence(self) -> None:
        """Stop heartbeating while staying alive (a hung host, for fault injection)."""
        self._silent = True
