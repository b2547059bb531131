"""One heartbeat for every agent: beats to the supervisor on an interval, registers again what it forgot, stops cleanly.

An agent's slices are ``(slice, incarnation)`` pairs; ``due`` says which of them beat now (a silenced one does
not). Each beat is one ``heartbeats`` call for all of them; the slices the supervisor does not know (it restarted,
or dropped them for a silence) are registered again with one ``register_slices`` call naming this actor. A beat that
fails is logged and the next goes out on time: the supervisor may be restarting. The first beat goes out one
interval after :meth:`Heartbeat.start` (the agent registered just before). An async actor beats from a task on its
event loop (:meth:`Heartbeat.start`), a threaded one from a daemon thread (:meth:`Heartbeat.start_thread`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import ray

__all__ = ["Heartbeat"]

CALL_TIMEOUT_S = 10.0  # a threaded beat's wait for each call (an async beat's call ends with the actor)


class Heartbeat:
    """Beats ``due()``'s pairs to ``supervisor`` every ``interval_s`` until :meth:`stop`."""

    def __init__(self, supervisor: Any, due: Callable[[], list[tuple[int, int]]], interval_s: float, log: Any) -> None:
        self._supervisor = supervisor
        self._due = due
        self._interval_s = interval_s
        self._log = log
        self._stopped = threading.Event()
        self._started = False
        self._task: asyncio.Task | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def start(self) -> None:
        """Beat from a task on the running event loop (an async actor's); once only."""
        if not self._started:
            self._started = True
            self._task = asyncio.get_running_loop().create_task(self._run())

    def start_thread(self) -> None:
        """Beat from a daemon thread (a threaded actor's, whose calls may block); once only."""
        if not self._started:
            self._started = True
            threading.Thread(target=self._run_blocking, name="heartbeat", daemon=True).start()

    def stop(self) -> None:
        """No beat goes out after this (from any thread; an async beat's task is cancelled on its loop)."""
        self._stopped.set()
        if self._task is not None:
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)

    async def beat(self) -> None:
        """One beat now (awaited); a failure is logged, never raised."""
        pairs = self._due()
        if not pairs:
            return
        try:
            unknown = await self._supervisor.heartbeats.remote(pairs)
            if unknown:
                await self._supervisor.register_slices.remote(_again(pairs, unknown), _me())
        except Exception as err:  # noqa: BLE001 - keep beating while the supervisor restarts
            self._failed(err)

    def beat_blocking(self) -> None:
        """One beat now, each call waited for at most ``CALL_TIMEOUT_S``; a failure is logged, never raised."""
        pairs = self._due()
        if not pairs:
            return
        try:
            unknown = ray.get(self._supervisor.heartbeats.remote(pairs), timeout=CALL_TIMEOUT_S)
            if unknown:
                ray.get(self._supervisor.register_slices.remote(_again(pairs, unknown), _me()), timeout=CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - keep beating while the supervisor restarts
            self._failed(err)

    async def _run(self) -> None:
        while not self._stopped.is_set():
            await asyncio.sleep(self._interval_s)
            if not self._stopped.is_set():
                await self.beat()

    def _run_blocking(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self.beat_blocking()

    def _failed(self, err: Exception) -> None:
        self._log.warning("heartbeat_failed", error=repr(err)[:200])


def _again(pairs: list[tuple[int, int]], unknown: list[int]) -> list[tuple[int, int]]:
    """The pairs of the slices the supervisor does not know."""
    forgotten = set(unknown)
    return [(s, incarnation) for s, incarnation in pairs if s in forgotten]


def _me() -> Any:
    """This actor's handle (the supervisor asks a silent agent through it, and watches its lifeline)."""
    return ray.get_runtime_context().current_actor
