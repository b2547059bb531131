"""The supervisor: one detached, named Ray actor per job holding the membership view.

It observes slice health (registrations, heartbeats, agent death, client reports), folds each
observation into a :class:`~elastic.supervision.policy.HealthTally` (so judging costs O(slices), not O(history)),
asks :func:`elastic.supervision.policy.decide` what to do, and publishes the answer as a new
:class:`~elastic.supervision.membership.View` with a higher epoch. An agent holding many slices registers and
heartbeats them in one call each (``register_slices``, ``heartbeats``). Clients wait on epoch changes with
``wait_for_epoch`` (an ``asyncio.Condition``, no polling). Every change is appended to the job run's event
stream (:mod:`elastic.supervision.events`, in Ray's GCS), from which a restarted supervisor, on any node, rebuilds its
view, its health history (so quarantine holds) and the agents it refuses; agents re-register on their next
heartbeat; epochs continue.

An agent silent past ``heartbeat_timeout_s`` is dropped, but not for good: when it beats again (a long GC
pause), it re-registers and its slice rejoins through :func:`~elastic.supervision.policy.decide` like any repaired
slice, each lapse counting as a failure towards ``max_slice_failures``. An agent that died, or whose slice
the client saw fail, is refused for good: only a new incarnation brings its slice back. With
``Policy.respawn_every_s`` set, the client's :class:`~elastic.control.cluster.ActorGroup` starts that new incarnation
for slices listed by ``respawnable`` (their agent died; not quarantined, not seen failing by the client).
``close`` ends supervision for good (the job is closing): it stops judging and writing events.

A :class:`~elastic.supervision.notices.Notice` (slices that will go by a deadline), whatever its source, comes in
through ``notice``: written to the stream, its slices marked *leaving* (not failed, not refused) and a view without
them published (:class:`~elastic.supervision.policy.Leave`). A leaving slice is not taken back while its agent lives;
a new agent of it (the slice gone and back) is no longer leaving, and the slice rejoins as any repaired one.

Every call takes ``token=``: the job's credential (:mod:`elastic.supervision.credential`), or for registrations,
heartbeats and views its agents' derived one. Only their SHA-256 digests are kept; a refused call raises
:class:`~elastic.errors.AccessError` and is written to the stream. The records it writes are signed under the
job's stream key, and a restarted supervisor replays only those that verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

import ray

from elastic import priority
from elastic.errors import NoticeError, SupervisorError
from elastic.log import get_logger
from elastic.snapshot.gated import gated_actor
from elastic.supervision import credential
from elastic.supervision.access import Gate
from elastic.supervision.drains import DrainWatcher
from elastic.supervision.events import EventStream
from elastic.supervision.membership import HealthEvent, View
from elastic.supervision.notices import Notice, refusal
from elastic.supervision.policy import GiveUp, Grow, HealthTally, Leave, Policy, Shrink, Stay, Wait, decide

__all__ = ["Supervisor", "SUPERVISOR_NAME"]

SUPERVISOR_NAME = "supervisor"
_AGENT_DIED = "agent died"  # the cause of a refusal whose agent died (a respawnable slice)
_CLIENT_REPORT = "client report: "  # the cause of a health event from the client's report_lost


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
@gated_actor  # private methods unreachable through Ray; each public one takes token=
class Supervisor:
    def __init__(
        self, job: str, policy: Policy, heartbeat_timeout_s: float, tick_s: float, run: str, token: str | None = None
    ) -> None:
        priority.normal("supervisor", job=job)  # a starved judge of heartbeats raises false alarms
        self._job = job
        self._policy = policy
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._tick_s = tick_s
        self._run = run
        # Only digests of the job's credentials are kept (None: an open supervisor, for tests and benchmarks): every
        # call needs the job token, registrations and heartbeats take the agents' credential too. The agents answer
        # the derived control credential only (silence, stop, liveness), which is all this actor holds of it.
        self._gate = Gate(job, run, token)
        self._control = credential.derive(token, "control") if token is not None else None
        self._stream = EventStream(
            job, run, "supervisor", key=credential.derive(token, "stream") if token is not None else None
        )
        self._view = View()
        self._tally = HealthTally(policy)  # the health history, folded as it grows
        self._beats: dict[int, float] = {}
        self._incarnations: dict[int, int | None] = {}  # the registered agent of each slice judged by heartbeats
        self._newest: dict[int, int] = {}  # the newest incarnation seen per slice: older ones are refused
        self._revoked: set[tuple[int, int]] = set()  # (slice, incarnation) dead or failed: never healthy again
        self._watched: set[tuple[int, int]] = set()  # (slice, incarnation) whose agent's lifeline is watched
        self._died: set[tuple[int, int]] = set()  # (slice, incarnation) whose agent died (its lifeline failed)
        self._client_lost: set[tuple[int, int]] = set()  # (slice, incarnation) whose slice the client saw fail
        self._agents: dict[int, Any] = {}  # slice -> the handle of its registered agent (to ask a silent one)
        self._asking: set[int] = set()  # silent slices whose agent is being asked whether it lives
        self.late_beats = 0  # silences past the timeout whose agent answered: slow, not dead (not dropped)
        self.silent_drops = 0  # slices dropped for their silence (no beat, no answer)
        self._view_agents: dict[int, int] = {}  # the agent of each active slice when the view was published
        self._coming: dict[int, tuple[int, float]] = {}  # slice -> (incarnation, deadline) of a replacement started
        self._leaving: dict[int, tuple[int | None, Notice]] = {}  # slice -> (its agent, the notice) while leaving
        self.notices = 0  # notices taken
        self._closed = False
        self._events: list[dict[str, Any]] = []
        self._gathered: list[Future[None]] | None = None  # writes started inside ``_gathering``, not yet waited for
        self._judging = asyncio.Lock()
        self._cond: asyncio.Condition | None = None
        self._monitor: asyncio.Task | None = None
        self._watches: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._log = get_logger("elastic.supervision.supervisor", job=job)
        self._resume = False
        self._client_seen = time.monotonic()  # the client's lease: its watcher long-polls wait_for_epoch
        self._client_waiting = 0
        self._replay()

    # -- durable log ---------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        """Write a record to the stream: at once, or, while a call gathers its records (``_gathering``), started
        now and waited for by ``_flush`` (before the call's effect is visible), so that they land together."""
        if self._closed:  # the job is closing: nothing may write the stream again
            return
        kind = record.pop("kind")
        fields = {"epoch": self._view.epoch, **record}
        if self._gathered is None:
            self._events.append(self._stream.append(kind, **fields))
            return
        written, landing = self._stream.append_soon(kind, **fields)
        self._events.append(written)
        self._gathered.append(landing)

    @contextlib.asynccontextmanager
    async def _gathering(self) -> AsyncIterator[None]:
        """Within: records are written together (one round trip to the GCS, not one each: under load each took
        15-30 ms here, and a loss report writes three), and every one has landed when the block ends. A block
        entered while another gathers joins it (the first to end stops the gathering; later records go at once)."""
        opened = self._gathered is None
        if opened:
            self._gathered = []
        try:
            yield
            await self._flush()
        finally:
            if opened:
                self._gathered = None

    async def _flush(self) -> None:
        """Until the records started so far have landed (a view is published only after its records are)."""
        while self._gathered:
            pending, self._gathered[:] = list(self._gathered), []
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending))

    def _replay(self) -> None:
        """Rebuild the view, the health history and the refused incarnations after a restart (on any node)
        from this run's event stream; the slices healthy in it count as healthy until their agents fail to
        re-register within a heartbeat timeout."""
        self._events, forged = self._stream.mine_verified()
        if forged:  # records someone else wrote under this writer's keys: not this job's history
            self._append(
                {
                    "kind": "forged_records_refused",
                    "count": len(forged),
                    "seqs": sorted({r["seq"] for r in forged if isinstance(r.get("seq"), int)})[:20],
                }
            )
            self._log.warning("forged_records_refused", count=len(forged))
        if not self._events:
            return
        wall, now = time.time(), time.monotonic()
        for e in self._events:
            if e["kind"] == "view":
                self._view = View(
                    epoch=e["epoch"],
                    active=frozenset(e["active"]),
                    gave_up=e["gave_up"],
                    reason=e["reason"],
                    leaving=frozenset(e.get("leaving", ())),
                )
            elif e["kind"] == "health":
                s, incarnation = e["slice"], e.get("incarnation")
                at = now - max(0.0, wall - e["wall"])  # the event's wall time, on this process's monotonic clock
                self._tally.add(HealthEvent(time=at, slice=s, healthy=e["healthy"], cause=e["cause"]))
                if incarnation is not None:
                    self._newest[s] = max(self._newest.get(s, incarnation), incarnation)
                    if e["cause"].startswith(_CLIENT_REPORT):
                        self._client_lost.add((s, incarnation))
            elif e["kind"] == "refused":
                self._revoked.add((e["slice"], e["incarnation"]))
                if e["cause"] == _AGENT_DIED:
                    self._died.add((e["slice"], e["incarnation"]))
            elif e["kind"] == "notice":
                self.notices += 1
                notice = Notice(
                    slices=frozenset(e["slices"]),
                    deadline=e["deadline"],
                    reason=e["reason"],
                    source=e["source"],
                    at=e["at"],
                )
                self._leaving.update({s: (incarnation, notice) for s, incarnation in e["agents"]})
        for s, (incarnation, _) in list(self._leaving.items()):  # a newer agent of the slice: it went and came back
            if incarnation is not None and self._newest.get(s, incarnation) > incarnation:
                del self._leaving[s]
        for s in self._tally.healthy:
            self._beats[s] = now
            self._incarnations[s] = None  # unknown until the agent registers again
        # The agent each active slice had (the newest the log names): a new incarnation registering for one of them
        # replaces a lost member, which needs a new view even if the old agent died before re-registering here.
        self._view_agents = {s: self._newest[s] for s in self._view.active if s in self._newest}
        self._resume = self._view.epoch > 0
        self._log.warning(
            "supervisor_rebuilt",
            epoch=self._view.epoch,
            active=sorted(self._view.active),
            quarantined=sorted(self._tally.quarantined),
            refused=len(self._revoked),
        )

    # -- observations --------------------------------------------------------------------------
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _observe(self, slice_index: int, healthy: bool, cause: str, *, incarnation: int | None = None) -> None:
        """Fold a change of health into the tally and the log (``incarnation``: the agent it is about)."""
        if self._tally.knows(slice_index) and self._tally.is_healthy(slice_index) == healthy:
            return
        self._tally.add(HealthEvent(time=time.monotonic(), slice=slice_index, healthy=healthy, cause=cause))
        self._append(
            {"kind": "health", "slice": slice_index, "healthy": healthy, "cause": cause, "incarnation": incarnation}
        )
        self._log.info(
            "slice_health",
            slice=slice_index,
            healthy=healthy,
            cause=cause,
            epoch=self._view.epoch,
            incarnation=incarnation,
        )

    async def register(self, slice_index: int, incarnation: int, agent: Any, token: str | None = None) -> View:
        """An agent (new, restarted or replacing a lost one) reports its slice healthy.

        An agent that died, or whose slice the client saw fail, stays out: only a new incarnation brings its
        slice back. One that was only silent comes back through ``decide``.
        """
        return await self.register_slices([(slice_index, incarnation)], agent, token=token)

    async def register_slices(self, slices: list[tuple[int, int]], agent: Any, token: str | None = None) -> View:
        """``register`` for every ``(slice, incarnation)`` an agent holds, in one call: one lifeline
        watches them all, so the agent's death loses each of them."""
        self._authorize(token, "register", agents=True)
        self._ensure_monitor()
        now = time.monotonic()
        fresh = [(s, incarnation) for s, incarnation in slices if self._admits(s, incarnation)]
        for s, incarnation in fresh:
            if self._coming.get(s, (incarnation + 1,))[0] <= incarnation:
                del self._coming[s]  # the replacement (or a newer agent) is here
            self._newest[s] = incarnation
            self._incarnations[s] = incarnation
            self._agents[s] = agent
            left = self._leaving.get(s, (None, None))[0]
            if left is not None and left < incarnation:
                del self._leaving[s]  # a new agent: the slice went and is back
            self._beats[s] = now
            self._observe(s, True, f"agent registered (incarnation {incarnation})", incarnation=incarnation)
        unwatched = [pair for pair in fresh if pair not in self._watched]
        if unwatched:  # an agent back from a lapse is watched already
            self._watched.update(unwatched)
            watch = asyncio.get_running_loop().create_task(self._watch(unwatched, agent))
            self._watches.add(watch)
            watch.add_done_callback(self._watches.discard)
        if fresh:
            await self._evaluate()
        return self._view

    def _refuse(self, slice_index: int, incarnation: int, cause: str) -> None:
        """This agent of the slice never counts as healthy again (logged, so a restart remembers it)."""
        if (slice_index, incarnation) not in self._revoked:
            self._revoked.add((slice_index, incarnation))
            self._append({"kind": "refused", "slice": slice_index, "incarnation": incarnation, "cause": cause})

    def _admits(self, slice_index: int, incarnation: int) -> bool:
        """Not closed, not refused, and not older than the slice's newest agent."""
        return (
            not self._closed
            and (slice_index, incarnation) not in self._revoked
            and incarnation >= self._newest.get(slice_index, incarnation)
        )

    async def heartbeat(self, slice_index: int, incarnation: int, token: str | None = None) -> bool:
        """False tells the agent to register again (this supervisor does not know it)."""
        return not await self.heartbeats([(slice_index, incarnation)], token=token)

    async def heartbeats(self, beats: list[tuple[int, int]], token: str | None = None) -> list[int]:
        """Heartbeats of many ``(slice, incarnation)`` pairs in one call, from an agent holding them all.

        Returns the slices this supervisor does not know as such (empty when all is well): their agent
        must register them again.
        """
        self._authorize(token, "heartbeat", agents=True)
        if self._closed:
            return []
        self._ensure_monitor()
        now = time.monotonic()
        unknown = []
        for s, incarnation in beats:
            if self._incarnations.get(s) == incarnation:
                self._beats[s] = now
            else:
                unknown.append(s)
        return unknown

    def _authorize(self, token: str | None, command: str, *, agents: bool = False) -> None:
        """``AccessError`` unless ``token`` is this job's credential (``agents``: or its agents' credential); a refusal
        is written to the stream, bounded (:class:`~elastic.supervision.access.Gate`)."""
        self._gate.check(token, command, agents=agents, epoch=self._view.epoch)

    async def report_lost(
        self,
        slices: list[int],
        cause: str,
        token: str | None = None,
        incarnations: dict[int, int] | None = None,
        suspect: bool = True,
    ) -> View:
        """A client saw these slices fail (e.g. its computation raised a slice-loss error): their agents are
        refused from now on, even if they still beat. ``incarnations``: the agent of each slice the client saw
        fail (default: the newest; a newer one, a replacement already registering, is not refused).
        ``suspect``: the slice's hardware is suspect (single-process mode: a slice failed in the client), so no
        new agent is started for it by respawning; in multi-process mode a dead worker process is not."""
        self._authorize(token, "report_lost")
        async with self._gathering():  # the client waits for this answer: its records land together
            for s in slices:
                incarnation = (incarnations or {}).get(s, self._newest.get(s))
                if incarnation is not None:
                    self._refuse(s, incarnation, "its slice failed in the client")
                    if suspect:
                        self._client_lost.add((s, incarnation))
                    else:
                        self._died.add((s, incarnation))
                if self._incarnations.get(s, incarnation) != incarnation:
                    continue  # a newer agent holds the slice: it stays
                self._incarnations.pop(s, None)
                self._observe(s, False, f"{_CLIENT_REPORT}{cause}", incarnation=incarnation)
            await self._evaluate()
        return self._view

    async def expect(self, slice_index: int, incarnation: int, within_s: float, token: str | None = None) -> None:
        """The client started agent ``incarnation`` for ``slice_index`` (a replacement for a lost one, or a
        revive): while it may still register (``within_s``), :func:`decide` counts the slice as coming and does
        not give up for want of it. Cleared when it registers, dies, or is late."""
        self._authorize(token, "expect")
        if not self._closed and incarnation >= self._newest.get(slice_index, incarnation):
            self._coming[slice_index] = (incarnation, time.monotonic() + within_s)

    def _arriving(self) -> frozenset[int]:
        """Slices whose started replacement may still register in time (late or dead ones are forgotten)."""
        now = time.monotonic()
        for s, (incarnation, until) in list(self._coming.items()):
            if until <= now or (s, incarnation) in self._revoked:
                del self._coming[s]
        return frozenset(self._coming)

    async def _watch(self, slices: list[tuple[int, int]], agent: Any) -> None:
        """Notice the agent's death at once: its lifeline call fails when the actor dies."""
        try:
            await agent.lifeline.remote(token=self._control)
        except Exception as err:  # noqa: BLE001 - any failure of the lifeline means the agent is gone
            self._watched.difference_update(slices)
            lost = [(s, incarnation) for s, incarnation in slices if self._incarnations.get(s) == incarnation]
            async with self._gathering():  # an agent of many slices: two records each, in one round trip
                for s, incarnation in slices:  # a dead agent never comes back (not even a late registration of it)
                    self._refuse(s, incarnation, _AGENT_DIED)
                    self._died.add((s, incarnation))
                for s, incarnation in lost:
                    del self._incarnations[s]
                    self._observe(s, False, f"agent died: {type(err).__name__}", incarnation=incarnation)
                if lost:
                    await self._evaluate()

    # -- decisions -----------------------------------------------------------------------------
    async def start(self, token: str | None = None) -> View:
        """Begin judging health (call once every initial agent has registered)."""
        self._authorize(token, "start")
        self._resume = True
        self._ensure_monitor()
        await self._evaluate()
        return self._view

    def _ensure_monitor(self) -> None:
        """Judging runs once started; a supervisor rebuilt after a restart resumes it on its first call."""
        if self._monitor is None and self._resume and not self._closed:
            self._monitor = asyncio.get_running_loop().create_task(self._run_monitor())
            drains = DrainWatcher(self._job, lambda: dict(self._agents), lambda: set(self._leaving), self._take_notice)
            self._watches.add(asyncio.get_running_loop().create_task(drains.run()))  # Ray node drains as notices

    async def _run_monitor(self) -> None:
        """Judge heartbeats every ``tick_s``. Two guards against false alarms on a busy machine: time this
        supervisor itself did not run (its loop starved or paused) is not counted as any agent's silence; and a
        slice silent past the timeout is dropped only if its agent does not answer a direct question within
        ``min(1 s, timeout / 2)`` either (a hung or stopped host answers nothing; a slow one does, and counts as
        a late beat)."""
        last = time.monotonic()
        while True:
            now = time.monotonic()
            stalled = now - last - self._tick_s
            if stalled > max(self._tick_s, 0.1):  # this loop did not run: nobody's silence grew meanwhile
                for s in self._beats:
                    self._beats[s] += stalled
                self._log.info("supervisor_stalled", seconds=round(stalled, 2), epoch=self._view.epoch)
            last = now
            for s, seen in list(self._beats.items()):
                if s in self._incarnations and now - seen > self._heartbeat_timeout_s and s not in self._asking:
                    self._asking.add(s)
                    task = asyncio.get_running_loop().create_task(self._confirm_silent(s, self._incarnations[s]))  # type: ignore[arg-type]
                    self._watches.add(task)
                    task.add_done_callback(self._watches.discard)
            await self._evaluate()
            await asyncio.sleep(self._tick_s)

    async def _confirm_silent(self, s: int, incarnation: int) -> None:
        """Ask slice ``s``'s agent whether it lives before dropping it for its silence."""
        agent, bound = self._agents.get(s), min(1.0, self._heartbeat_timeout_s / 2)
        started = time.monotonic()
        answered = False
        try:
            if agent is not None:
                answered = bool(await asyncio.wait_for(agent.alive.remote(s, token=self._control), bound))
        except Exception:  # noqa: BLE001 - no answer in time, or the agent is gone: it is silent for real
            answered = False
        finally:
            self._asking.discard(s)
        if self._incarnations.get(s) != incarnation:
            return  # dropped or replaced meanwhile
        silent = time.monotonic() - self._beats.get(s, started)
        if answered:  # alive and working: its beats are late (a loaded machine), not missing
            self._beats[s] = time.monotonic()
            self.late_beats += 1
            self._append({"kind": "late", "slice": s, "silent_s": round(silent, 2)})
            self._log.info("heartbeat_late", slice=s, silent_s=round(silent, 2), epoch=self._view.epoch)
            return
        if silent <= self._heartbeat_timeout_s:
            return  # it beat while we asked
        # Dropped, not refused: an agent that beats again re-registers and rejoins through decide.
        self.silent_drops += 1
        del self._incarnations[s]
        self._observe(s, False, f"no heartbeat for {silent:.1f}s and no answer when asked", incarnation=incarnation)
        await self._evaluate()

    async def _evaluate(self) -> None:
        async with self._judging:  # one judgement at a time: one may wait for its records to land
            if self._monitor is None or self._closed:
                return
            decision = decide(
                self._view,
                self._tally,
                time.monotonic(),
                self._policy,
                self._arriving(),
                frozenset(self._leaving),
                self._renewed(),
            )
            if isinstance(decision, (Stay, Wait)):
                if isinstance(decision, Wait) and (
                    not self._events or self._events[-1].get("reason") != decision.reason
                ):
                    self._append({"kind": "wait", "reason": decision.reason})
                return
            if isinstance(decision, Leave):
                notices: dict[int, Notice] = {}  # one notice may name several of the slices
                for s in sorted(decision.leaving):
                    notices.setdefault(id(self._leaving[s][1]), self._leaving[s][1])
                view = View(
                    epoch=self._view.epoch + 1,
                    active=decision.to,
                    reason=decision.reason,
                    leaving=decision.leaving,
                    notices=tuple(notices.values()),
                )
            elif isinstance(decision, (Shrink, Grow)):
                view = View(epoch=self._view.epoch + 1, active=decision.to, reason=decision.reason)
            else:
                assert isinstance(decision, GiveUp)
                view = View(
                    epoch=self._view.epoch + 1,
                    active=self._view.active,
                    gave_up=decision.reason,
                    reason=decision.reason,
                )
            record = {**asdict(view), "active": sorted(view.active), "leaving": sorted(view.leaving)}
            del record["notices"]  # each is in the stream already, as its own record
            self._append({"kind": "view", "decision": type(decision).__name__, **record})
            if self._gathered is not None:
                await self._flush()  # the view is seen only once its records have landed, as when written at once
            self._view = view
            self._view_agents = {s: inc for s in view.active if (inc := self._incarnations.get(s)) is not None}
            self._log.info("view_changed", epoch=view.epoch, active=sorted(view.active), reason=view.reason)
            async with self._condition():
                self._condition().notify_all()

    def _renewed(self) -> frozenset[int]:
        """Active slices whose registered agent is not the one they had when the view was published (a lost
        member replaced before the view could drop it: below ``min_slices``, or faster than a judgement; after a
        restart, against the agents the log names). A slice whose agent is unknown is adopted silently."""
        renewed = set()
        for s in self._view.active:
            now = self._incarnations.get(s)
            if now is None:
                continue
            was = self._view_agents.setdefault(s, now)
            if was != now:
                renewed.add(s)
        return frozenset(renewed)

    async def close(self, token: str | None = None) -> None:
        """End supervision for good (the job is closing): stop judging and writing events, so that agents
        killed after this leave no trace in the stream. Call before killing the agents and this actor."""
        self._authorize(token, "close")
        if not self._closed:
            self._append({"kind": "closed"})
        self._closed = True
        for task in [self._monitor, *self._watches]:
            if task is not None:
                task.cancel()
        self._log.info("supervisor_closed", epoch=self._view.epoch)

    async def inject(self, kind: str, slice_index: int, token: str | None = None) -> dict[str, Any]:
        """An operator's fault (``elastic inject``): ``kill`` kills the slice's agent actor (its process: in
        multi-process mode the slice's worker; the slice is dropped at once), ``silence`` stops its heartbeats, ``stop``
        stops its process (SIGSTOP: a hung host; both dropped after ``heartbeat_timeout_s``). Written to the stream;
        returns what was done."""
        self._authorize(token, "inject")
        if kind not in ("kill", "silence", "stop"):
            raise SupervisorError(f"inject: unknown fault {kind!r}; choose kill, silence or stop")
        incarnation = self._newest.get(slice_index)
        if incarnation is None or (slice_index, incarnation) in self._revoked:
            raise SupervisorError(
                f"inject: slice {slice_index} has no live agent (active: {sorted(self._view.active)})"
            )
        name = f"agent-{slice_index}-{incarnation}"
        agent = self._agents.get(slice_index)  # the handle it registered with: never one found by its name
        if agent is None:
            raise SupervisorError(f"inject: slice {slice_index}'s agent {name} is not registered here")
        self._append({"kind": "inject", "fault": kind, "slice": slice_index, "incarnation": incarnation})
        if kind == "kill":
            ray.kill(agent, no_restart=True)
        elif kind == "stop":
            agent.stop_process.remote(token=self._control)
        else:
            agent.silence.remote(token=self._control)
        return {"fault": kind, "slice": slice_index, "agent": name, "epoch": self._view.epoch}

    async def notice(self, notice: Notice, token: str | None = None) -> View:
        """Slices will go by ``notice.deadline``: every source's one way in. Written to the stream; its slices are
        marked leaving and a view without them is published (unless fewer than ``min_slices`` would remain: then they
        are kept until they go). Returns the view. A notice for a slice the job does not hold, or one already
        leaving, or past its deadline, is refused (``NoticeError``, one line; written to the stream) and changes
        nothing."""
        self._authorize(token, "notice")
        return await self._take_notice(notice)

    async def _take_notice(self, notice: Notice) -> View:
        """``notice`` past the credential check: the path every source takes (the drain watcher calls it here)."""
        if not isinstance(notice, Notice):
            raise NoticeError(f"notice takes an elastic.Notice, got {type(notice).__name__}")
        why = "notice refused: the job is closing" if self._closed else None
        why = why or refusal(
            notice,
            active=self._view.active,
            leaving=frozenset(self._leaving),
            now=time.time(),
            gave_up=self._view.gave_up is not None,
        )
        if why is not None:
            self._append({"kind": "notice_refused", **notice.record(), "why": why})
            self._log.warning("notice_refused", why=why, source=notice.source, slices=sorted(notice.slices))
            raise NoticeError(why)
        agents = {s: self._incarnations.get(s, self._newest.get(s)) for s in sorted(notice.slices)}
        async with self._gathering():  # the notice's record lands before the view it makes
            self._append({"kind": "notice", **notice.record(), "agents": [[s, i] for s, i in agents.items()]})
            self._leaving.update({s: (incarnation, notice) for s, incarnation in agents.items()})
            self.notices += 1
            self._log.warning(
                "notice", slices=sorted(notice.slices), source=notice.source, lead_s=round(notice.lead_s, 3)
            )
            await self._evaluate()
        return self._view

    async def agent_notice(
        self, slices: list[tuple[int, int]], deadline: float, reason: str, source: str, token: str | None = None
    ) -> View:
        """An agent's notice for its own ``(slice, incarnation)`` pairs (its host's maintenance event): the agents'
        credential suffices, and only the slices whose registered agent it is are taken, down the one notice path."""
        self._authorize(token, "agent_notice", agents=True)
        own = frozenset(s for s, incarnation in slices if self._incarnations.get(s) == incarnation)
        if not own:
            raise NoticeError("notice refused: the agent holds none of the slices it names; the job is unchanged")
        return await self._take_notice(Notice(slices=own, deadline=deadline, reason=reason, source=source))

    async def run_id(self, token: str | None = None) -> str:
        """The run this supervisor writes events for (a client taking the job over writes to it too)."""
        self._authorize(token, "run_id")
        return self._run

    # -- queries -------------------------------------------------------------------------------
    async def view(self, token: str | None = None) -> View:
        self._authorize(token, "view", agents=True)
        return self._view

    async def respawnable(self, token: str | None = None) -> dict[int, int]:
        """The slices a new agent may bring back, each with the incarnation of its newest agent, which died:
        no agent holds the slice now, and it is neither quarantined nor seen failing by the client (its
        hardware is then suspect, and only a revive brings it back). A silent agent's slice is not listed: it
        may beat again; nor is a slice that left on notice, until its notice's deadline has passed (its host is
        going: a new agent may start there only if it stayed). Empty once closed or given up."""
        self._authorize(token, "respawnable")
        if self._closed or self._view.gave_up is not None:
            return {}
        now = time.time()
        return {
            s: incarnation
            for s, incarnation in self._newest.items()
            if (s, incarnation) in self._died
            and (s, incarnation) not in self._client_lost
            and s not in self._incarnations
            and s not in self._tally.quarantined
            and not (s in self._leaving and self._leaving[s][1].deadline > now)
        }

    async def wait_for_epoch(self, after: int, timeout_s: float, token: str | None = None) -> View:
        """The view once its epoch exceeds ``after``, or the current view after ``timeout_s``."""
        self._authorize(token, "wait_for_epoch", agents=True)
        self._ensure_monitor()
        self._client_waiting += 1
        self._client_seen = time.monotonic()
        cond = self._condition()
        try:
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait_for(lambda: self._view.epoch > after), timeout_s)
                except TimeoutError:
                    pass
        finally:
            self._client_waiting -= 1
            self._client_seen = time.monotonic()
        return self._view

    async def client_idle_s(self, token: str | None = None) -> float:
        """Seconds since the client last waited on this supervisor (0 while it waits): a live client's
        watcher is always waiting or about to, so a long idle time means the client is gone."""
        self._authorize(token, "client_idle_s")
        return 0.0 if self._client_waiting else time.monotonic() - self._client_seen

    async def events(self, token: str | None = None) -> list[dict[str, Any]]:
        self._authorize(token, "events")
        return list(self._events)

    async def usage(self, token: str | None = None) -> dict[str, Any]:
        """This supervisor's process id and Ray node, the CPU seconds its process has used, and how many slices
        it watches (for benchmarks and status reports)."""
        self._authorize(token, "usage")
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "cpu_s": time.process_time(),
            "slices": len(self._incarnations),
            "late_beats": self.late_beats,
            "silent_drops": self.silent_drops,
            "notices": self.notices,
            "leaving": sorted(self._leaving),
        }
