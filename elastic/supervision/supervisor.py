"""The supervisor: one detached, named Ray actor per job holding the membership view; the async glue over pure parts.

It observes slice health (registrations, heartbeats, agent death, client reports), folds each observation into a
:class:`~elastic.supervision.policy.HealthTally`, asks :func:`~elastic.supervision.policy.decide` what to do and
carries out its answer unchanged: a new :class:`~elastic.supervision.membership.View` with a higher epoch. Clients wait
on epoch changes with ``wait_for_epoch`` (no polling). What it knows of each agent is an
:class:`~elastic.supervision.registry.AgentRegistry`; silences are judged by a
:class:`~elastic.supervision.liveness.Liveness`; every change is written by a
:class:`~elastic.supervision.journal.Journal` to the job run's event stream (in Ray's GCS), whose records a
restarted supervisor, on any node, rebuilds its state from (:func:`~elastic.supervision.replay.replay`); agents
re-register on their next heartbeat; epochs continue.

An agent silent past ``heartbeat_timeout_s`` is dropped, not for good: beating again it re-registers and its slice
rejoins through ``decide`` (each lapse a failure towards ``max_slice_failures``). An agent that died, or whose slice
the client saw fail, is refused for good: only a new incarnation (``respawnable``) brings its slice back. A
:class:`~elastic.supervision.notices.Notice`, whatever its source, comes in through ``notice``: its slices are marked
*leaving* and a view without them is published. ``close`` ends supervision for good: no judging, no records.

Every call takes ``token=`` signed once with the job's credential, or for registrations, heartbeats and views its
agents' (:mod:`elastic.snapshot.calls`), checked by :func:`~elastic.supervision.access.guarded` and nowhere else.
Its records are signed under the job's stream key; a restart replays only those that verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from functools import partial
from typing import Any

import ray

from elastic import priority
from elastic.errors import NoticeError, SupervisorError
from elastic.log import get_logger
from elastic.snapshot.calls import Signed, call_key
from elastic.snapshot.gated import gated_actor
from elastic.supervision import credential
from elastic.supervision.access import Gate, guarded
from elastic.supervision.drains import DrainWatcher
from elastic.supervision.events import EventStream
from elastic.supervision.journal import Journal
from elastic.supervision.liveness import Liveness
from elastic.supervision.membership import HealthEvent, View
from elastic.supervision.notices import Notice, refusal
from elastic.supervision.policy import Policy, Wait, decide, next_view
from elastic.supervision.registry import AGENT_DIED, CLIENT_REPORT, Pair
from elastic.supervision.replay import replay

__all__ = ["Supervisor", "SUPERVISOR_NAME"]

SUPERVISOR_NAME = "supervisor"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
@gated_actor  # private methods unreachable through Ray; each public one takes token=
class Supervisor:
    def __init__(
        self, job: str, policy: Policy, heartbeat_timeout_s: float, tick_s: float, run: str, token: str | None = None
    ) -> None:
        priority.normal("supervisor", job=job)  # a starved judge of heartbeats raises false alarms
        self._job, self._policy, self._run = job, policy, run
        self._view = View()  # token None: an open supervisor (tests, benchmarks)
        self.gate = Gate(job, run, token, epoch=lambda: self._view.epoch)  # every public method's one check
        # the agents' calls signed under the control credential's call key (it opens nothing else); open: unsigned
        control = call_key(credential.derive(token, "control")) if token is not None else None
        self._signed: Callable[[Any], Any] = (lambda a: a) if control is None else partial(Signed.under, key=control)
        key = credential.derive(token, "stream") if token is not None else None
        stream = EventStream(job, run, "supervisor", key=key)
        self._log = get_logger("elastic.supervision.supervisor", job=job)
        # After a restart: the view, the health history and the agents refused, from this run's records.
        state = replay(stream.mine(), policy=policy, wall=time.time(), now=time.monotonic(), key=key)
        self._journal = Journal(stream, state.records, epoch=lambda: self._view.epoch)
        if state.forged:  # records someone else wrote under this writer's keys: not this job's history
            seqs = sorted({r["seq"] for r in state.forged if isinstance(r.get("seq"), int)})[:20]
            self._journal.append({"kind": "forged_records_refused", "count": len(state.forged), "seqs": seqs})
            self._log.warning("forged_records_refused", count=len(state.forged))
        self._view, self._tally, self._agents = state.view, state.tally, state.registry
        self._resume = self._view.epoch > 0
        if self._journal.records:
            self._log.warning("supervisor_rebuilt", **state.summary())
        self._judging = asyncio.Lock()
        self._cond: asyncio.Condition | None = None
        self._monitor: asyncio.Task | None = None
        self._watches: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._client_seen = time.monotonic()  # the client's lease: its watcher long-polls wait_for_epoch
        self._client_waiting = 0
        self._liveness = Liveness(
            self._agents,
            timeout_s=heartbeat_timeout_s,
            tick_s=tick_s,
            signed=self._signed,
            log=self._log,
            late=self._late,
            lost=self._lapsed,
            spawn=self._spawn,
        )

    # -- observations --------------------------------------------------------------------------
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)
        return task

    def _observe(self, slice_index: int, healthy: bool, cause: str, *, incarnation: int | None = None) -> None:
        """Fold a change of health into the tally and the log (``incarnation``: the agent it is about)."""
        if self._tally.knows(slice_index) and self._tally.is_healthy(slice_index) == healthy:
            return
        self._tally.add(HealthEvent(time=time.monotonic(), slice=slice_index, healthy=healthy, cause=cause))
        change = {"slice": slice_index, "healthy": healthy, "cause": cause, "incarnation": incarnation}
        self._journal.append({"kind": "health", **change})
        self._log.info("slice_health", epoch=self._view.epoch, **change)

    def _refuse(self, slice_index: int, incarnation: int, cause: str) -> None:
        """This agent of the slice never counts as healthy again (logged, so a restart remembers it)."""
        if self._agents.refuse(slice_index, incarnation):
            self._journal.append({"kind": "refused", "slice": slice_index, "incarnation": incarnation, "cause": cause})

    @guarded("register", agents=True)
    async def register(self, slice_index: int, incarnation: int, agent: Any, token: str | None = None) -> View:
        """An agent (new, restarted or replacing a lost one) reports its slice healthy. One that died, or whose slice
        the client saw fail, stays out (only a new incarnation comes back); one that was only silent is taken back."""
        return await self._register([(slice_index, incarnation)], agent)

    @guarded("register", agents=True)
    async def register_slices(self, slices: list[tuple[int, int]], agent: Any, token: str | None = None) -> View:
        """``register`` for every ``(slice, incarnation)`` an agent holds, in one call: one lifeline
        watches them all, so the agent's death loses each of them."""
        return await self._register(slices, agent)

    async def _register(self, slices: list[tuple[int, int]], agent: Any) -> View:
        self._ensure_monitor()
        now = time.monotonic()
        fresh = [(s, i) for s, i in slices if not self._journal.closed and self._agents.admits(s, i)]
        for s, incarnation in fresh:
            self._agents.register(s, incarnation, agent, now)
            self._observe(s, True, f"agent registered (incarnation {incarnation})", incarnation=incarnation)
        unwatched = self._agents.watch(fresh)
        if unwatched:
            self._spawn(self._watch(unwatched, agent))
        if fresh:
            await self._evaluate()
        return self._view

    @guarded("heartbeat", agents=True)
    async def heartbeat(self, slice_index: int, incarnation: int, token: str | None = None) -> bool:
        """False tells the agent to register again (this supervisor does not know it)."""
        return not self._beat([(slice_index, incarnation)])

    @guarded("heartbeat", agents=True)
    async def heartbeats(self, beats: list[tuple[int, int]], token: str | None = None) -> list[int]:
        """Heartbeats of many ``(slice, incarnation)`` pairs in one call, from an agent holding them all: the slices
        this supervisor does not know as such (empty when all is well), which their agent must register again."""
        return self._beat(beats)

    def _beat(self, beats: list[tuple[int, int]]) -> list[int]:
        if self._journal.closed:
            return []
        self._ensure_monitor()
        now = time.monotonic()
        return [s for s, incarnation in beats if not self._agents.beat(s, incarnation, now)]

    @guarded("report_lost")
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
        async with self._journal.gathering():  # the client waits for this answer: its records land together
            for s in slices:
                incarnation = (incarnations or {}).get(s, self._agents.newest(s))
                if incarnation is not None:
                    self._refuse(s, incarnation, "its slice failed in the client")
                    (self._agents.client_lost if suspect else self._agents.died)(s, incarnation)
                if self._agents.holds(s) and self._agents.agent(s) != incarnation:
                    continue  # a newer agent holds the slice: it stays
                self._agents.drop(s)
                self._observe(s, False, f"{CLIENT_REPORT}{cause}", incarnation=incarnation)
            await self._evaluate()
        return self._view

    @guarded("expect")
    async def expect(self, slice_index: int, incarnation: int, within_s: float, token: str | None = None) -> None:
        """The client started agent ``incarnation`` for ``slice_index`` (a replacement for a lost one, or a
        revive): while it may still register (``within_s``), :func:`decide` counts the slice as coming and does
        not give up for want of it. Cleared when it registers, dies, or is late."""
        if not self._journal.closed:
            self._agents.expect(slice_index, incarnation, time.monotonic() + within_s)

    async def _watch(self, slices: list[Pair], agent: Any) -> None:
        """Notice the agent's death at once: its lifeline call fails when the actor dies."""
        try:
            await self._signed(agent).lifeline.remote()
        except Exception as err:  # noqa: BLE001 - any failure of the lifeline means the agent is gone
            self._agents.unwatch(slices)
            lost = [(s, incarnation) for s, incarnation in slices if self._agents.agent(s) == incarnation]
            async with self._journal.gathering():  # an agent of many slices: two records each, in one round trip
                for s, incarnation in slices:  # a dead agent never comes back (not even a late registration of it)
                    self._refuse(s, incarnation, AGENT_DIED)
                    self._agents.died(s, incarnation)
                for s, incarnation in lost:
                    self._agents.drop(s)
                    self._observe(s, False, f"agent died: {type(err).__name__}", incarnation=incarnation)
                if lost:
                    await self._evaluate()

    # -- decisions -----------------------------------------------------------------------------
    @guarded("start")
    async def start(self, token: str | None = None) -> View:
        """Begin judging health (call once every initial agent has registered)."""
        self._resume = True
        self._ensure_monitor()
        await self._evaluate()
        return self._view

    def _ensure_monitor(self) -> None:
        """Judging runs once started; a supervisor rebuilt after a restart resumes it on its first call."""
        if self._monitor is None and self._resume and not self._journal.closed:
            self._monitor = asyncio.get_running_loop().create_task(
                self._liveness.run(self._evaluate, lambda: self._view.epoch)
            )
            drains = DrainWatcher(self._job, self._agents.handles, lambda: self._agents.leaving, self._take_notice)
            self._watches.add(asyncio.get_running_loop().create_task(drains.run()))  # Ray node drains as notices

    def _late(self, s: int, silent: float) -> None:
        self._journal.append({"kind": "late", "slice": s, "silent_s": round(silent, 2)})
        self._log.info("heartbeat_late", slice=s, silent_s=round(silent, 2), epoch=self._view.epoch)

    async def _lapsed(self, s: int, incarnation: int | None, silent: float) -> None:
        self._observe(s, False, f"no heartbeat for {silent:.1f}s and no answer when asked", incarnation=incarnation)
        await self._evaluate()

    async def _evaluate(self) -> None:
        """Ask :func:`decide` and carry out its answer: a new view, published once its records have landed."""
        async with self._judging:  # one judgement at a time: one may wait for its records to land
            if self._monitor is None or self._journal.closed:
                return
            now, agents = time.monotonic(), self._agents
            coming, renewed = agents.arriving(now), agents.renewed(self._view.active)
            decision = decide(self._view, self._tally, now, self._policy, coming, agents.leaving, renewed)
            view = next_view(self._view, decision, self._agents.notice_of)
            if view is None:  # Stay or Wait: a wait is written once, not on every tick
                if isinstance(decision, Wait) and (self._journal.last() or {}).get("reason") != decision.reason:
                    self._journal.append({"kind": "wait", "reason": decision.reason})
                return
            record = {**asdict(view), "active": sorted(view.active), "leaving": sorted(view.leaving)}
            del record["notices"]  # each is in the stream already, as its own record
            self._journal.append({"kind": "view", "decision": type(decision).__name__, **record})
            await self._journal.flush()  # the view is seen only once its records have landed
            self._view = view
            self._agents.published(view.active)
            self._log.info("view_changed", epoch=view.epoch, active=sorted(view.active), reason=view.reason)
            async with self._condition():
                self._condition().notify_all()

    @guarded("close")
    async def close(self, token: str | None = None) -> None:
        """End supervision for good (the job is closing): stop judging and writing events, so that agents
        killed after this leave no trace in the stream. Call before killing the agents and this actor."""
        self._journal.close()
        for task in [self._monitor, *self._watches]:
            if task is not None:
                task.cancel()
        self._log.info("supervisor_closed", epoch=self._view.epoch)

    @guarded("inject")
    async def inject(self, kind: str, slice_index: int, token: str | None = None) -> dict[str, Any]:
        """An operator's fault (``elastic inject``): ``kill`` kills the slice's agent actor (its process: in
        multi-process mode the slice's worker; the slice is dropped at once), ``silence`` stops its heartbeats, ``stop``
        stops its process (SIGSTOP: a hung host; both dropped after ``heartbeat_timeout_s``). Written to the stream;
        returns what was done."""
        if kind not in ("kill", "silence", "stop"):
            raise SupervisorError(f"inject: unknown fault {kind!r}; choose kill, silence or stop")
        incarnation, agent = self._agents.target(slice_index, self._view.active)
        name = f"agent-{slice_index}-{incarnation}"
        self._journal.append({"kind": "inject", "fault": kind, "slice": slice_index, "incarnation": incarnation})
        if kind == "kill":
            ray.kill(agent, no_restart=True)
        elif kind == "stop":
            self._signed(agent).stop_process.remote()
        else:
            self._signed(agent).silence.remote()
        return {"fault": kind, "slice": slice_index, "agent": name, "epoch": self._view.epoch}

    @guarded("notice")
    async def notice(self, notice: Notice, token: str | None = None) -> View:
        """Slices will go by ``notice.deadline``: every source's one way in. Written to the stream; the view that
        ``decide`` makes of it is returned. A notice for a slice the job does not hold, or one already leaving, or
        past its deadline, is refused (``NoticeError``, one line; written to the stream) and changes nothing."""
        return await self._take_notice(notice)

    async def _take_notice(self, notice: Notice) -> View:
        """``notice`` past the credential check: the path every source takes (the drain watcher calls it here)."""
        if not isinstance(notice, Notice):
            raise NoticeError(f"notice takes an elastic.Notice, got {type(notice).__name__}")
        view, closed = self._view, "notice refused: the job is closing" if self._journal.closed else None
        why = closed or refusal(
            notice, active=view.active, leaving=self._agents.leaving, now=time.time(), gave_up=view.gave_up is not None
        )
        if why is not None:
            self._journal.append({"kind": "notice_refused", **notice.record(), "why": why})
            self._log.warning("notice_refused", why=why, source=notice.source, slices=sorted(notice.slices))
            raise NoticeError(why)
        agents = {s: self._agents.current(s) for s in sorted(notice.slices)}
        async with self._journal.gathering():  # the notice's record lands before the view it makes
            self._journal.append({"kind": "notice", **notice.record(), "agents": [[s, i] for s, i in agents.items()]})
            self._agents.leave(agents, notice)
            self._log.warning(
                "notice", slices=sorted(notice.slices), source=notice.source, lead_s=round(notice.lead_s, 3)
            )
            await self._evaluate()
        return self._view

    @guarded("agent_notice", agents=True)
    async def agent_notice(
        self, slices: list[tuple[int, int]], deadline: float, reason: str, source: str, token: str | None = None
    ) -> View:
        """An agent's notice for its own ``(slice, incarnation)`` pairs (its host's maintenance event): the agents'
        credential suffices, and only the slices whose registered agent it is are taken, down the one notice path."""
        own = frozenset(s for s, incarnation in slices if self._agents.agent(s) == incarnation)
        if not own:
            raise NoticeError("notice refused: the agent holds none of the slices it names; the job is unchanged")
        return await self._take_notice(Notice(slices=own, deadline=deadline, reason=reason, source=source))

    @guarded("run_id")
    async def run_id(self, token: str | None = None) -> str:
        """The run this supervisor writes events for (a client taking the job over writes to it too)."""
        return self._run

    # -- queries -------------------------------------------------------------------------------
    @guarded("view", agents=True)
    async def view(self, token: str | None = None) -> View:
        return self._view

    @guarded("respawnable")
    async def respawnable(self, token: str | None = None) -> dict[int, int]:
        """The slices a new agent may bring back, each with its newest agent's incarnation, which died
        (:meth:`~elastic.supervision.registry.AgentRegistry.respawnable`). Empty once closed or given up."""
        if self._journal.closed or self._view.gave_up is not None:
            return {}
        return self._agents.respawnable(self._tally.quarantined, time.time())

    @guarded("wait_for_epoch", agents=True)
    async def wait_for_epoch(self, after: int, timeout_s: float, token: str | None = None) -> View:
        """The view once its epoch exceeds ``after``, or the current view after ``timeout_s``."""
        self._ensure_monitor()
        self._client_waiting += 1
        self._client_seen = time.monotonic()
        cond = self._condition()
        try:
            async with cond:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cond.wait_for(lambda: self._view.epoch > after), timeout_s)
        finally:
            self._client_waiting -= 1
            self._client_seen = time.monotonic()
        return self._view

    @guarded("client_idle_s")
    async def client_idle_s(self, token: str | None = None) -> float:
        """Seconds since the client last waited on this supervisor (0 while it waits): a live client's
        watcher is always waiting or about to, so a long idle time means the client is gone."""
        return 0.0 if self._client_waiting else time.monotonic() - self._client_seen

    @guarded("events")
    async def events(self, token: str | None = None) -> list[dict[str, Any]]:
        return self._journal.records

    @guarded("usage")
    async def usage(self, token: str | None = None) -> dict[str, Any]:
        """This supervisor's process id and Ray node, the CPU seconds its process has used, and how many slices
        it watches (for benchmarks and status reports)."""
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "cpu_s": time.process_time(),
            "slices": self._agents.count(),
            "late_beats": self._agents.late_beats,
            "silent_drops": self._agents.silent_drops,
            "notices": self._agents.notices,
            "leaving": sorted(self._agents.leaving),
        }
