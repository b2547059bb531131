"""The pool: a detached, restartable Ray actor that lends slices to jobs; the async glue over :func:`decide`.

Each call that changes the pool (a job arrives, leaves, releases slices or asks another count; a slice fails or
returns) is one event: :func:`~elastic.pool.policy.decide` answers the plan, the actor writes it to the pool's
signed log (a ``decision`` record with the state after it) and only then takes it as its state, so a restarted
actor (``max_restarts=-1``, on any node) replays the log (:func:`~elastic.pool.replay.replay`) and goes on where it
was. Jobs learn of their grants and reclaim notices by reading their lease (``lease``, or ``wait_lease``, a long
poll on the pool's version). Its Ray metrics, per pool and per job, are :mod:`elastic.pool.metrics`.

Every public method is gated (:func:`~elastic.pool.access.pool_guarded`, :func:`~elastic.snapshot.gated.gated_actor`):
the operator may do anything; a user submits jobs as themself and reads, releases, resizes and leaves only their own
jobs' leases (another user's job is refused, not hidden: :class:`~elastic.errors.AccessError`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import ray

from elastic.errors import AccessError, ConfigError
from elastic.log import get_logger
from elastic.pool.access import REFUSALS_WRITER, Caller, PoolGate, pool_guarded
from elastic.pool.metrics import PoolMetrics
from elastic.pool.model import (
    Arrive,
    Event,
    JobSpec,
    Leave,
    Plan,
    PoolState,
    Release,
    Resize,
    SliceFailed,
    SliceReturned,
    event_to_dict,
    state_to_dict,
)
from elastic.pool.policy import decide, status_of
from elastic.pool.replay import replay
from elastic.snapshot.gated import gated_actor
from elastic.supervision import credential
from elastic.supervision.events import EventStream, read, verify
from elastic.supervision.journal import Journal

__all__ = ["NAMESPACE", "Pool", "actor_name", "stream_name"]

NAMESPACE = "elastic-pools"


def actor_name(pool: str) -> str:
    return f"pool-{pool}"


def stream_name(pool: str) -> str:
    """The pool's event stream, as a job's (:mod:`elastic.supervision.events`)."""
    return f"pool-{pool}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
@gated_actor  # private methods unreachable through Ray; each public one takes token=
class Pool:
    def __init__(
        self,
        name: str,
        size: int,
        quotas: Mapping[str, int],
        users: list[str],
        run: str,
        token: str | None = None,
    ) -> None:
        self._name, self._run = name, run
        key = credential.derive(token, "stream") if token is not None else None
        self._key = key
        stream = EventStream(stream_name(name), run, "pool", key=key)
        self.gate = PoolGate(name, stream_name(name), run, token, users)
        self._log = get_logger("elastic.pool.actor", pool=name)
        state = replay(stream.mine(), size=size, quotas=quotas, key=key)
        self._state, self._version = state.state, state.version
        self._journal = Journal(stream, state.records, epoch=lambda: self._version)
        if state.forged:
            self._journal.append({"kind": "forged_records_refused", "count": len(state.forged)})
        if state.records:
            self._journal.append({"kind": "pool_restarted", "decisions": state.decisions})
            self._log.warning("pool_rebuilt", decisions=state.decisions, jobs=sorted(self._state.jobs))
        else:
            self._journal.append({"kind": "pool_started", "size": size, "quotas": dict(quotas), "users": users})
        self._cond: asyncio.Condition | None = None
        self._why: dict[int, str] = {}  # slice being reclaimed -> why (kept in memory only)
        now = time.monotonic()
        self._below: dict[str, float] = {}  # job -> seconds below its asked count, closed spells
        self._below_since: dict[str, float] = {
            n: now for n, e in self._state.jobs.items() if len(self._state.holding(n)) < e.asked
        }
        self._metrics = PoolMetrics(name, lambda: (self._state, {n: self._lease(n) for n in self._state.jobs}))
        self._metrics.start()

    # -- carrying out ---------------------------------------------------------------------------
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _carry(self, event: Event) -> Plan:
        """Decide, write the decision, take it (``ConfigError`` from ``decide``: nothing changes)."""
        plan = decide(self._state, event)
        touched = sorted(
            {*plan.grants, *(r.job for r in plan.reclaims), *(r.for_job for r in plan.reclaims if r.for_job)}
            | set(plan.cancels)
            | ({event.job} if isinstance(event, (Leave, Release, Resize)) else set())
            | ({event.spec.name} if isinstance(event, Arrive) else set())
        )
        self._journal.append(
            {
                "kind": "decision",
                "event": event_to_dict(event),
                "reason": plan.reason,
                "jobs": touched,
                "grants": {n: sorted(s) for n, s in plan.grants.items()},
                "reclaims": [
                    {"job": r.job, "slices": sorted(r.slices), "for_job": r.for_job, "reason": r.reason}
                    for r in plan.reclaims
                ],
                "cancels": {n: sorted(s) for n, s in plan.cancels.items()},
                "state": state_to_dict(plan.state),
            }
        )
        self._state, self._version = plan.state, self._version + 1
        self._why = {s: r for s, r in self._why.items() if s in plan.state.reclaiming}
        self._why.update({s: r.reason for r in plan.reclaims for s in r.slices})
        self._account(time.monotonic())
        self._metrics.decided(plan)
        self._log.info("pool_decision", version=self._version, reason=plan.reason)
        async with self._condition():
            self._condition().notify_all()
        return plan

    def _account(self, now: float) -> None:
        for n in list(self._below_since):
            if n not in self._state.jobs or len(self._state.holding(n)) >= self._state.jobs[n].asked:
                self._below[n] = self._below.get(n, 0.0) + now - self._below_since.pop(n)
        for n, e in self._state.jobs.items():
            if len(self._state.holding(n)) < e.asked:
                self._below_since.setdefault(n, now)

    def _own(self, caller: Caller, job: str) -> None:
        entry = self._state.jobs.get(job)
        if entry is None:
            raise ConfigError(f"job {job!r} is not in pool {self._name!r}")
        if not caller.operator and entry.spec.user != caller.user:
            raise AccessError(f"refused: job {job!r} is not user {caller.user!r}'s (a user acts on their own jobs)")

    def _lease(self, job: str) -> dict[str, Any]:
        s = self._state
        status = decide_status(s, job)
        below = self._below.get(job, 0.0)
        if job in self._below_since:
            below += time.monotonic() - self._below_since[job]
        return {
            "job": job,
            "user": s.jobs[job].spec.user,
            "priority": s.jobs[job].spec.priority,
            "slices": sorted(s.holding(job)),
            "leave": sorted(x for x in s.holding(job) if x in s.reclaiming),
            "why": {x: self._why.get(x, "the pool takes it back") for x in s.holding(job) if x in s.reclaiming},
            "version": self._version,
            "seconds_below_asked": round(below, 3),
            **status,
        }

    # -- the jobs' side -------------------------------------------------------------------------
    @pool_guarded("submit")
    async def submit(
        self,
        spec: JobSpec,
        want: int | None = None,
        *,
        user: str | None = None,
        token: str | None = None,
        caller: Caller | None = None,
    ) -> dict[str, Any]:
        """Add a job (``spec.user`` must be the caller, unless the operator calls): its lease."""
        caller = _through_gate(caller)
        if not isinstance(spec, JobSpec):
            raise ConfigError(f"submit takes a JobSpec; got {type(spec).__name__}")
        if not caller.operator and spec.user != caller.user:
            raise AccessError(f"refused: user {caller.user!r} cannot submit a job as user {spec.user!r}")
        await self._carry(Arrive(spec=spec, want=want))
        return self._lease(spec.name)

    @pool_guarded("release")
    async def release(
        self,
        job: str,
        slices: list[int],
        *,
        user: str | None = None,
        token: str | None = None,
        caller: Caller | None = None,
    ) -> dict[str, Any]:
        """The job left ``slices`` (a reclaim obeyed, or of its own accord): its lease after."""
        self._own(_through_gate(caller), job)
        await self._carry(Release(job=job, slices=frozenset(slices)))
        return self._lease(job)

    @pool_guarded("resize")
    async def resize(
        self, job: str, want: int, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> dict[str, Any]:
        self._own(_through_gate(caller), job)
        await self._carry(Resize(job=job, want=want))
        return self._lease(job)

    @pool_guarded("leave")
    async def leave(
        self, job: str, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> None:
        """The job ended: every slice it holds goes back to the pool."""
        self._own(_through_gate(caller), job)
        await self._carry(Leave(job=job))

    @pool_guarded("slice_failed")
    async def slice_failed(
        self, slice_index: int, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> int:
        """A slice failed (the operator, or the user whose job holds it, says so): the pool's version after."""
        caller = _through_gate(caller)
        holder = self._state.held.get(slice_index)
        if not caller.operator and (holder is None or self._state.jobs[holder].spec.user != caller.user):
            raise AccessError(f"refused: slice {slice_index} is not held by a job of user {caller.user!r}")
        await self._carry(SliceFailed(slice=slice_index))
        return self._version

    @pool_guarded("slice_returned", operator=True)
    async def slice_returned(
        self, slice_index: int, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> int:
        """A failed slice is back (the operator's call only): the pool's version after."""
        await self._carry(SliceReturned(slice=slice_index))
        return self._version

    @pool_guarded("lease")
    async def lease(
        self, job: str, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> dict[str, Any]:
        self._own(_through_gate(caller), job)
        return self._lease(job)

    @pool_guarded("wait_lease")
    async def wait_lease(
        self,
        job: str,
        after: int,
        timeout_s: float,
        *,
        user: str | None = None,
        token: str | None = None,
        caller: Caller | None = None,
    ) -> dict[str, Any]:
        """The job's lease once the pool's version is past ``after`` (or at ``timeout_s``, bounded to 60 s)."""
        self._own(_through_gate(caller), job)
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._version > after), min(max(timeout_s, 0.0), 60.0))
            except TimeoutError:
                pass
        self._own(_through_gate(caller), job)  # it may have left meanwhile
        return self._lease(job)

    # -- the operator's side --------------------------------------------------------------------
    @pool_guarded("status")
    async def status(
        self, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> dict[str, Any]:
        """The pool: the operator sees every job; a user sees their own and how many slices the others hold."""
        caller = _through_gate(caller)
        s = self._state
        mine = [n for n, e in s.jobs.items() if caller.operator or e.spec.user == caller.user]
        out: dict[str, Any] = {
            "pool": self._name,
            "size": s.size,
            "version": self._version,
            "free": s.free(),
            "failed": sorted(s.failed),
            "jobs": {n: self._lease(n) for n in mine},
            "queue": [n for n in mine if decide_status(s, n)["state"] != "running"],
        }
        if not caller.operator:
            out["held_by_others"] = sum(1 for j in s.held.values() if j not in mine)
        return out

    @pool_guarded("events")
    async def events(
        self, *, user: str | None = None, token: str | None = None, caller: Caller | None = None
    ) -> list[dict[str, Any]]:
        """The pool's records: all of them for the operator (its refused calls too); a user's own jobs' decisions,
        without the others'."""
        caller = _through_gate(caller)
        records = self._journal.records
        if caller.operator:
            refused = read(stream_name(self._name), self._run, writers=[REFUSALS_WRITER])
            if self._key is not None:
                refused, _ = verify(refused, self._key)
            return sorted(records + refused, key=lambda r: (r["wall"], r["writer"], r["seq"]))
        mine = {n for n, e in self._state.jobs.items() if e.spec.user == caller.user}
        out = []
        for r in records:
            if r["kind"] != "decision" or not mine & set(r.get("jobs", ())):
                continue
            out.append(
                {
                    **{k: r[k] for k in ("wall", "writer", "seq", "kind", "epoch")},
                    "grants": {n: v for n, v in r["grants"].items() if n in mine},
                    "reclaims": [x for x in r["reclaims"] if x["job"] in mine],
                }
            )
        return out


def decide_status(state: PoolState, job: str) -> dict[str, Any]:
    """Job ``job``'s status in ``state``, as the policy words it."""
    st = status_of(state, job)
    return {"state": st.state, "target": st.target, "asked": st.asked, "reason": st.reason}


def _through_gate(caller: Caller | None) -> Caller:
    """The caller the gate named (a method reached without it is a bug: refused)."""
    if caller is None:
        raise AccessError("refused: a pool method reached without its credential check")
    return caller
