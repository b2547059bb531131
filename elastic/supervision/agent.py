"""Agent actors: they heartbeat to the supervisor for their slices and die with their host.

On a real cluster an agent is placed on its slice's host, so a host loss kills it and the supervisor
notices at once (its lifeline call fails); a hung host stops its heartbeats. The job runs one
:class:`SliceAgent` per slice; a :class:`SliceGroupAgent` holds many slices (e.g. every slice of one
host) and sends one heartbeat call per interval for all of them.

Every method takes ``token=``: a call signed with the job's *control* credential
(:func:`~elastic.supervision.credential.derive` ``"control"``), held by the job's client and supervisor; an agent
keeps its call key (``control``, given at creation; None: an open agent, for tests), accepts each signed call once
(:mod:`elastic.snapshot.calls`) and refuses any other with :class:`~elastic.errors.AccessError`.
Its private methods are unreachable through Ray (:func:`~elastic.snapshot.gated.gated_actor`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from elastic import priority
from elastic.errors import AccessError
from elastic.log import get_logger
from elastic.snapshot.calls import CallCheck
from elastic.snapshot.gated import gated_actor
from elastic.supervision.heartbeat import Heartbeat
from elastic.supervision.maintenance import MaintenanceListener
from elastic.supervision.sources import NoticeSources

__all__ = ["SliceAgent", "SliceGroupAgent", "check_control"]


def check_control(control: CallCheck, token: object, method: str, log: Any) -> None:
    """``AccessError`` unless ``token`` is a fresh call of ``method`` signed with the job's control credential
    (``control``: the actor's check of its call key)."""
    why = control.refusal(token, method)
    if why is None:
        return
    log.warning("agent_call_refused", method=method, reason=why)
    raise AccessError(f"agent {method} refused ({why}): it needs a call signed with this job's control credential")


@ray.remote(num_cpus=0)
@gated_actor
class SliceAgent:
    def __init__(
        self,
        slice_index: int,
        incarnation: int,
        supervisor: Any,
        interval_s: float,
        job: str,
        sources: NoticeSources | None = None,
        control: str | None = None,
    ) -> None:
        priority.normal("agent", job=job, slice=slice_index)  # a late heartbeat is a false alarm
        self._control = CallCheck(control)  # the call key of the job's control credential
        self._slice = slice_index
        self._incarnation = incarnation
        self._supervisor = supervisor
        self._silent = False
        self._log = get_logger("elastic.supervision.agent", job=job, slice=slice_index)
        self._heartbeat = Heartbeat(supervisor, self._due, interval_s, self._log)
        self._listener: MaintenanceListener | None = None
        self._listening: asyncio.Task | None = None
        if sources is not None and sources.metadata_url is not None:
            self._listener = MaintenanceListener(sources, slice_index, job, self._give_notice)

    async def start(self, token: str | None = None) -> int:
        """Register with the supervisor and start heartbeating (and listening to the host's metadata server, where
        configured); returns the incarnation."""
        check_control(self._control, token, "start", self._log)
        await self._supervisor.register.remote(self._slice, self._incarnation, ray.get_runtime_context().current_actor)
        self._heartbeat.start()
        if self._listener is not None and self._listening is None:
            self._listening = asyncio.get_running_loop().create_task(self._listener.run())
        return self._incarnation

    async def _give_notice(self, deadline: float, reason: str) -> object:
        """This host will go: a notice for this agent's slice (source ``maintenance``), down the one notice path."""
        return await self._supervisor.agent_notice.remote(
            [(self._slice, self._incarnation)], deadline, reason, "maintenance"
        )

    def _due(self) -> list[tuple[int, int]]:
        """What beats now: this agent's slice, unless silenced."""
        return [] if self._silent else [(self._slice, self._incarnation)]

    async def lifeline(self, token: str | None = None) -> None:
        """Never returns; the caller's await fails when this actor dies."""
        check_control(self._control, token, "lifeline", self._log)
        await asyncio.Event().wait()

    async def alive(self, slice_index: int | None = None, token: str | None = None) -> bool:
        """Answer the supervisor's check of a silent slice: True at once while this agent works, never while it
        is silenced (a hung host answers nothing)."""
        check_control(self._control, token, "alive", self._log)
        if self._silent:
            await asyncio.Event().wait()
        return True

    async def silence(self, token: str | None = None) -> None:
        """Stop heartbeating while staying alive (a hung host, for fault injection)."""
        check_control(self._control, token, "silence", self._log)
        self._silent = True

    async def stop_process(self, token: str | None = None) -> None:
        """A hung host for real: this actor's process stops (SIGSTOP) a moment after answering."""
        check_control(self._control, token, "stop_process", self._log)
        _stop_soon()

    async def stall(self, seconds: float, token: str | None = None) -> float:
        """Block this agent's event loop for ``seconds`` (a GC pause, a stalled host; for fault injection): no
        heartbeat goes out meanwhile, then beating resumes. Returns the wall time it resumed."""
        check_control(self._control, token, "stall", self._log)
        return _stall(seconds)


@ray.remote(num_cpus=0)
@gated_actor
class SliceGroupAgent:
    """One agent for many slices: one registration, one heartbeat call per interval and one lifeline for
    all of them, so its death loses every slice it holds. ``slices`` maps each slice to its incarnation."""

    def __init__(
        self, slices: dict[int, int], supervisor: Any, interval_s: float, job: str, control: str | None = None
    ) -> None:
        priority.normal("agent", job=job, slices=len(slices))
        self._control = CallCheck(control)  # the call key of the job's control credential
        self._slices = dict(slices)
        self._supervisor = supervisor
        self._silent: set[int] = set()
        self._log = get_logger("elastic.supervision.agent", job=job, slices=len(self._slices))
        self._heartbeat = Heartbeat(supervisor, self._due, interval_s, self._log)

    async def start(self, token: str | None = None) -> list[int]:
        """Register every slice with the supervisor and start heartbeating; returns the slices."""
        check_control(self._control, token, "start", self._log)
        me = ray.get_runtime_context().current_actor
        await self._supervisor.register_slices.remote(sorted(self._slices.items()), me)
        self._heartbeat.start()
        return sorted(self._slices)

    def _due(self) -> list[tuple[int, int]]:
        """What beats now: every slice not silenced."""
        return [(s, incarnation) for s, incarnation in self._slices.items() if s not in self._silent]

    async def lifeline(self, token: str | None = None) -> None:
        """Never returns; the caller's await fails when this actor dies."""
        check_control(self._control, token, "lifeline", self._log)
        await asyncio.Event().wait()

    async def alive(self, slice_index: int | None = None, token: str | None = None) -> bool:
        """Answer the supervisor's check of a silent slice: True at once while this agent works, never for a
        silenced slice (a hung host answers nothing)."""
        check_control(self._control, token, "alive", self._log)
        if slice_index in self._silent or (slice_index is None and self._silent):
            await asyncio.Event().wait()
        return True

    async def silence(self, slices: list[int] | None = None, token: str | None = None) -> float:
        """Stop heartbeating for ``slices`` (all by default) while staying alive, as hung hosts would
        (for fault injection); returns the wall time from which they are silent."""
        check_control(self._control, token, "silence", self._log)
        self._silent.update(self._slices if slices is None else slices)
        return time.time()

    async def stall(self, seconds: float, token: str | None = None) -> float:
        """Block this agent's event loop for ``seconds`` (a GC pause, a stalled host; for fault injection): none
        of its slices heartbeats meanwhile, then beating resumes. Returns the wall time it resumed."""
        check_control(self._control, token, "stall", self._log)
        return _stall(seconds)


def _stop_soon() -> None:
    import os
    import signal
    import threading

    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()


def _stall(seconds: float) -> float:
    time.sleep(seconds)  # on purpose in an async method: the whole actor stalls, as in a long GC pause
    return time.time()
