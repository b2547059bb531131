"""Multi-process mode, the driver's side: a worker process per slice (:mod:`elastic.placements.worker`), joined by
``jax.distributed``, the user's loop SPMD in every worker.

The driver hosts each group's coordination service (:class:`runtime.distributed.CoordinationService`: a worker
that dies must not take the service with it) and never holds the state. To put the state on a view it asks the
members what host snapshots they hold and picks the source: the newest step the members hold between them (their
own shards and the buddy copies of the lost ones: the memory tier), else the keepers' newest whole step, else the
newest Orbax checkpoint, else a fresh start (never silently from step 0 once something was committed). Then every
member joins the new group in place (same processes) and restores its own regions. A pass is watched (bounded)
by :mod:`elastic.placements.pass_watch`; the source is chosen by :func:`elastic.control.sources.group_source`, the
workers reached through :class:`~elastic.placements.members.Members`. When the supervisor's view changes during a pass
(a new process for a lost slice registered), the group stops at a step boundary a few steps ahead, snapshots there, and
re-forms with the new member. The workers are the slices' agents: the supervisor sees their death.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ray

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.control.placement import PassEnd, Placed, PlacementHost, PrepareHook
from elastic.control.report import PlacementFigures
from elastic.control.sources import Source, group_source
from elastic.log import get_logger
from elastic.placements.final_state import assemble_final
from elastic.placements.members import Members, restarted
from elastic.placements.outcome import Joined
from elastic.placements.pass_watch import Passes, PassWatch
from elastic.placements.plan import GroupPlan, WorkerSpec
from elastic.placements.standby import StandbyGroup
from elastic.placements.worker_processes import WorkerProcesses, process_env
from elastic.runtime import distributed
from elastic.supervision.membership import View

__all__ = ["ProcessPlacement", "WorkerProcesses", "process_env", "restarted"]

PHASES = (  # a re-formation's phases, as the workers time them (the slowest member's each)
    "end_group",
    "leave",
    "leave_backend",
    "leave_caches",
    "leave_gc",
    "leave_client",
    "join",
    "backend",
    "shardings",
    "place",
    "placed",
    "restore",
)


class ProcessPlacement:
    def __init__(
        self,
        config: ElasticConfig,
        *,
        spec: WorkerSpec,
        group: Callable[[], ActorGroup],
        accounting: Accounting,
        keepers: Callable[[], Any],
        cache_dir: str,
        factory: WorkerProcesses,
    ) -> None:
        assert config.processes is not None
        self.config = config
        self._procs = config.processes
        self._spec = spec
        self._group = group
        self._acct = accounting
        self._keepers = keepers
        self._log = get_logger("elastic.placement", job=config.job_name)
        self._groups = 0
        self._plan: GroupPlan | None = None
        self._members: tuple[int, ...] = ()
        self._workers = Members(group, job=config.job_name)
        self._service: distributed.CoordinationService | None = None
        self._loop_ref: Any = None
        self._standby = StandbyGroup(
            cache_dir=cache_dir,
            actor_options=factory.actor_options,
            env=factory.env(),
            mesh_fn=spec.mesh_fn,
            rendezvous_timeout_s=self._procs.rendezvous_timeout_s,
            job=config.job_name,
        )
        self._passes = Passes(
            figures={
                "mode": "multi-process",
                "worker_processes_restarted": 0,
                "survivors_lost": 0,
                "workers_hung_killed": 0,
                "reform_seconds": [],
                "detection_seconds": [],
                "recovery_compile_seconds": [],
                "worker_pids": {},
            }
        )
        self._watch = PassWatch(
            config,
            members=self._workers,
            accounting=accounting,
            passes=self._passes,
            targeted=self._targeted,
            standby=self._standby,
        )

    # -- the seam -------------------------------------------------------------------------------------------------
    def standby_ready(self, view: View) -> bool | None:
        return self._standby.ready(len(view.active)) if self._passes.calls else None

    def prepare(self, view: View, *, live: bool, during: PrepareHook) -> Placed:
        members = tuple(sorted(view.active))
        group = self._group()
        workers = self._workers
        previous = self._members
        leavers = self._leavers(view, previous, live=live)  # leaving on notice: asked, then let go cleanly
        for s in set(previous) - set(members) - set(leavers):  # left out (stopped, hung, not yet dead): ended
            workers.kill(s)
        handles = {s: group.agent(s) for s in members}
        incarnations = {s: group.incarnation(s) for s in members}
        asked = time.monotonic()
        # at a boundary: its snapshot, copied
        helds = workers.ask(handles, lambda h: h.held.remote(live), timeout=90.0, what="the workers to answer held")
        donated = self._donations(leavers)
        offered = {**helds, **donated}
        holders = [s for s in (*members, *sorted(donated)) if any(h["own"] for h in offered[s].values())]
        choice = group_source(
            offered,
            holders,
            live=live,
            keepers=self._keepers(),
            persistent_dir=self.config.tiers.persistent_dir,
            committed=bool(self._acct.ledger.steps),
        )
        source, step = choice.source, choice.step
        leavers = {s: h for s, h in leavers.items() if s in donated}
        self._log.info(
            "group_source",
            epoch=view.epoch,
            source=source.value,
            step=step,
            held={s: sorted(h) for s, h in helds.items()},
        )
        chose = time.monotonic()
        self._groups += 1
        # The old group's service stays up until every member has left it (in its prepare, below): a service that
        # stops under a connected client makes that client's error poll fail, and jax then aborts the process.
        old, self._service = (
            self._service,
            distributed.CoordinationService(len(members), host=ray.util.get_node_ip_address()),
        )
        plan = GroupPlan(
            epoch=self._groups,
            address=self._service.address,
            members=members,
            peers=handles,
            source=source,
            step=step,
            view=view,
            live=live,
            pids=tuple(sorted(self._acct.pids | {os.getpid()})),
            keeper=choice.found if source is Source.KEEPER else None,
            rendezvous_timeout_s=self._procs.rendezvous_timeout_s,
            record_calls=not self._passes.calls,
            fault_floor=self._passes.reached,
            donors=leavers,
        )
        refs = {handles[s].prepare.remote(plan): s for s in members}
        if step is not None:
            grew = len(members) > len(previous)
            during("restore" if not live else "grow" if grew else "reshard", step, view)
        try:
            joined: dict[int, Joined] = workers.collect(
                refs,
                timeout=self.config.startup_timeout_s + 2 * self._procs.rendezvous_timeout_s,
                what=f"group {plan.epoch} to form",
                on_death=functools.partial(self._abandon, plan.epoch, handles),
            )
            self._depart(leavers)  # after the survivors re-formed (they may have read from it), before its group ends
        except runtime.SliceLostError:
            died = workers.died & set(previous)  # a survivor of the last group died as this one formed
            for s in sorted(died - workers.gone):  # in the timeline as any lost worker is
                self._acct.timeline.add("worker_lost", slice=s, epoch=view.epoch)
            workers.gone |= workers.died
            self._passes.figures["survivors_lost"] += len(workers.collateral(died - self._targeted(died)))
            for s in leavers:
                workers.kill(s)
            raise
        finally:
            if old is not None:
                old.stop()
        self._plan, self._members = plan, members
        pids = {s: res.pid for s, res in joined.items()}
        self._passes.figures["worker_processes_restarted"] += len(
            restarted(pids, previous, workers.last_pid, workers.gone)
        )
        workers.formed(handles, incarnations, joined)
        self._passes.figures["worker_pids"] = dict(workers.pids)
        reform = max(r.reform_seconds or 0.0 for r in joined.values())
        if self._passes.recovering:
            self._passes.figures["reform_seconds"].append(round(reform, 3))
        detail = {
            "reform_seconds": round(reform, 3),
            "restore_seconds": max(r.restore_seconds or 0.0 for r in joined.values()),
            "phases": {
                "held": round(chose - asked, 3),
                "formed": round(time.monotonic() - chose, 3),
                **{k: max(r.phases.get(k, 0.0) for r in joined.values()) for k in PHASES},
            },
        }
        meta = joined[members[0]].meta
        if source is Source.FRESH:
            return Placed(how="fresh", step=self._spec.init_step, detail=detail)
        assert step is not None and meta is not None
        if live:
            return Placed(how="moved", step=step, detail=detail)
        return Placed(how="restored", step=step, tier=source.value, generation=step, meta=meta, detail=detail)

    def _abandon(self, epoch: int, handles: dict[int, Any], waiting: set[int]) -> None:
        """A member died as group ``epoch`` formed: the ``waiting`` members, who may wait minutes for its part of
        the group's backend, give it up now and answer (their state is kept for the next group)."""
        self._log.warning("group_abandoned", epoch=epoch, waiting=sorted(waiting))
        for s in waiting:
            handles[s].abandon.remote(epoch)

    def _leavers(self, view: View, previous: tuple[int, ...], *, live: bool) -> dict[int, Any]:
        """The workers of the last group's members that leave on notice at this boundary (alive, not replaced)."""
        if not live:
            return {}
        out = set(previous) - set(view.active)
        handles, gone = self._workers.handles, self._workers.gone
        return {s: handles[s] for s in sorted(out & view.leaving) if s in handles and s not in gone}

    def _donations(self, leavers: dict[int, Any]) -> dict[int, dict[int, Any]]:
        """What each leaving worker holds (its boundary snapshot, copied). One that does not answer in time gave
        nothing: it is no donor, and the state comes from the survivors as after a loss."""
        refs = {h.held.remote(True): s for s, h in leavers.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=60.0) if refs else ([], [])
        out = {}
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - it died early: the deadline came first
                self._log.warning("leaver_gone", slice=refs[ref], error=type(err).__name__)
        return out

    def _depart(self, leavers: dict[int, Any]) -> None:
        """Let each leaving worker leave its group and end its process (exit code 0); one that does not answer is
        ended as a lost member is. The exit codes go to the report (``leaving_exit_codes``)."""
        refs = {h.depart.remote(): s for s, h in leavers.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=30.0) if refs else ([], [])
        codes = self._passes.figures.setdefault("leaving_exit_codes", {})
        for ref, s in refs.items():
            self._workers.gone.add(s)
            try:
                codes[s] = ray.get(ref)["exit_code"] if ref in ready else None
            except Exception:  # noqa: BLE001 - it died as it left
                codes[s] = None
            if codes[s] is None:
                self._workers.kill(s)
        if refs:
            self._log.info("left_on_notice", slices=sorted(refs.values()), exit_codes=codes)

    def run_pass(self, loop: Callable[..., Any], host: PlacementHost) -> PassEnd:
        plan = self._plan
        assert plan is not None, "run_pass before prepare"
        if self._loop_ref is None:
            self._loop_ref = ray.put(loop)
        plan = dataclasses.replace(plan, loop=self._loop_ref)
        return self._watch.watch(plan, dict(self._workers.handles), host)  # the group's own workers

    def _targeted(self, lost: set[int]) -> set[int]:
        """The lost slices a drill's fault took (their loss is no survivor's)."""
        return {s for s in lost if any(hook.takes(s) for hook in self._spec.step_hooks)}

    def drop(self) -> None:
        self._plan = None

    def probe(
        self, slices: frozenset[int], timeout_s: float | None, *, early: Callable[[frozenset[int]], None] | None = None
    ) -> frozenset[int]:
        """Which workers do not answer a ping within a few seconds (dead, stopped, or on a lost node). A worker
        replaced or gone from the group is known dead before any ping is awaited (``early``)."""
        return self._workers.probe(slices, timeout_s, early=early)

    def lost(self, slices: frozenset[int]) -> tuple[dict[int, int] | None, bool]:
        """The incarnations of the group's workers that were seen failing; a worker that does not answer lost its
        process, not (necessarily) its hardware: a new one may be started for its slice."""
        return self._workers.lost(slices), False

    def replaced(self, slices: frozenset[int], lost: dict[int, int] | None) -> frozenset[int]:
        """Which of these lost slices already have a newer worker than the one lost (``lost``: as ``lost`` said)."""
        return self._workers.replaced(slices, lost)

    def final_state(self) -> Any:
        """The final state as host arrays, assembled from every worker's own regions (typed keys wrapped back).
        Assembled in the driver: meant for checking small models; a large one is written by ``save_final_to``."""
        plan = self._passes.final
        if plan is None:
            return None
        handles = self._workers.handles
        refs = {handles[s].final_pieces.remote(): s for s in plan.members}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=120.0)
        got: dict[int, Any] = {}
        for ref in ready:
            try:
                got[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError:  # died after the last step: the others may hold its regions
                continue
        abstract = jax.eval_shape(self._spec.init_fn, jax.random.key(self.config.seed))
        return assemble_final(got, plan.members, abstract)

    def save_final(self, path: str) -> None:
        final = self._passes.final
        assert final is not None
        ray.get([self._workers.handles[s].save_final.remote(path) for s in final.members], timeout=600)

    def figures(self) -> PlacementFigures:
        snapshots = self._passes.snapshots
        lead = snapshots.get(self._members[0], {}) if self._members else {}
        held = sum(s.get("held_bytes", 0) for s in snapshots.values())
        ends = [snapshots.get(s, {}) for s in self._members]
        latest = [e.get("latest_step") for e in ends]
        self._passes.figures["snapshot_latest_step"] = (
            None if not latest or None in latest else min(x for x in latest if x is not None)
        )
        self._passes.figures["snapshots_dropped"] = max((e.get("snapshots_dropped", 0) for e in ends), default=0)
        keepers = self._keepers()
        k = keepers.stats() if keepers is not None else {}
        return PlacementFigures(
            snapshots_requested=lead.get("snapshots_requested", 0),
            snapshots_taken=lead.get("snapshots_taken", 0),
            snapshots_coalesced=lead.get("snapshots_coalesced", 0),
            snapshots_failed=lead.get("snapshots_failed", 0),
            snapshot_blocking_seconds=max((s.get("blocking_seconds", 0.0) for s in snapshots.values()), default=0.0),
            snapshot_held_bytes=held,
            snapshot_copies=min(2, len(self._members)) if held else 0,
            keeper_bytes=k.get("keeper_bytes"),
            keeper_pushes=k.get("keeper_pushes"),
            standby_compiles=self._standby.compiled,
            standby_skipped=self._standby.skipped,
            standby_compile_seconds=self._standby.seconds,
            extra=self._passes.figures,
        )

    def snapshot_stats(self) -> dict[str, Any]:
        """The lead worker's snapshot counters, as last read (the same keys as the single-process snapshotter's)."""
        return {"blocking_seconds": 0.0, "snapshots_taken": 0, "held_bytes": 0, **self._passes.stats}

    def wait_for_standbys(self, timeout: float) -> bool:
        """Until the step is compiled for the group one slice smaller than the current one (False past ``timeout``,
        or when nothing can be compiled: standby off, or the smaller group would be below ``min_slices``)."""
        if not self._procs.standby:
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            smaller = len(self._members) - 1
            if self._members and smaller < max(1, self.config.policy.min_slices):
                return False
            if self._members and self._standby.ready(smaller):
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._standby.close()
        refs = [h.leave.remote() for h in self._workers.handles.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        if self._service is not None:
            self._service.stop()
            self._service = None
