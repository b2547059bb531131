"""Multi-process mode, the driver's side: a worker process per slice (:mod:`elastic.placements.worker`), joined by
``jax.distributed``, the user's loop SPMD in every worker.

The driver hosts each group's coordination service (:class:`runtime.distributed.CoordinationService`: a worker
that dies must not take the service with it) and never holds the state. To put the state on a view it asks the
members what host snapshots they hold and picks the source: the newest step the members hold between them (their
own shards and the buddy copies of the lost ones: the memory tier), else the keepers' newest whole step, else the
newest Orbax checkpoint, else a fresh start (never silently from step 0 once something was committed). Then every
member joins the new group in place (same processes) and restores its own regions. A pass is watched (bounded):
a worker's death shows as its call failing with a Ray actor error, the survivors' as status ``failed`` once their
next collective breaks (or at once: the driver aborts their pass); a member still in the pass ``settle_timeout_s``
after a failure is hung, and is killed. Commits are read from the lead worker as they happen and accounted here
(ledger, events, metrics, ``on_step``), exactly once and in order. When the supervisor's view changes during a
pass (a new process for a lost slice registered), the group stops at a step boundary a few steps ahead, snapshots
there, and re-forms with the new member. The workers are the slices' agents: the supervisor sees their death.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import ray

from elastic import priority, runtime
from elastic.config import ElasticConfig
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup, workers_start_niced
from elastic.control.placement import PassEnd, Placed, PlacementHost, PrepareHook
from elastic.errors import ConfigError, ElasticError
from elastic.log import get_logger
from elastic.placements.holdings import common_step
from elastic.placements.standby import StandbyGroup
from elastic.placements.worker import GroupPlan, SliceWorker, WorkerSpec
from elastic.runtime import distributed
from elastic.supervision.membership import View

__all__ = ["ProcessPlacement", "WorkerProcesses", "process_env"]

POLL_S = 0.02  # how often a pass's progress is read
RENEW_S = 0.5  # how often every member is told the driver lives (the workers' lease; worker.DRIVER_LEASE_S)
STOP_MARGIN_STEPS = 2  # a boundary for a new view is planned this many steps after the progress seen
PROBE_S = 10.0  # a worker that does not answer a ping within this is dead (a stopped process, a lost node)
# A worker process on a cluster that starts them at Ray's nice 15 asks for an ordinary priority from its start
# (elastic.priority). Not on the embedded cluster, which starts every worker at 0: there it would cost an idle
# process reused (0.5-1 s of the multi-process demo's start).
NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": str(priority.NORMAL)}}


def process_env(config: ElasticConfig) -> dict[str, str]:
    """The environment of a job's worker (and standby) processes: with ``simulated``, ``devices_per_slice`` CPU
    devices each; always a collective timeout, so that a collective whose peer died fails instead of hanging."""
    assert config.processes is not None
    timeout = config.processes.collective_timeout_s
    if config.simulated:
        return distributed.collective_env(config.devices_per_slice, collective_timeout_s=timeout)
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_cpu_collective_timeout_seconds={timeout}".strip()}


class WorkerProcesses:
    """The agent factory of multi-process mode: the slice's worker process (named as its agent, owned by the
    driver: it dies with it), placed by ``Processes.resources_per_worker``."""

    detached = False

    def __init__(self, config: ElasticConfig, spec: WorkerSpec) -> None:
        self._config = config
        self._spec = spec

    @property
    def spec(self) -> WorkerSpec:
        """What each worker is built from."""
        return self._spec

    def actor_options(self) -> dict[str, Any]:
        """Ray options that place a process of this job (a worker, or a standby helper). No ``runtime_env``: a
        process sets its environment up itself (:func:`runtime.distributed.setup_process`), so Ray may hand it one
        of its idle processes instead of starting one per environment (1.2 s saved of each worker's start here).
        Only a worker on a cluster that starts them niced asks for one (:data:`NORMAL_PRIORITY`)."""
        assert self._config.processes is not None
        return {**self._config.processes.worker_options(), "max_restarts": 0}

    def env(self) -> dict[str, str]:
        return process_env(self._config)

    def check_fits(self) -> None:
        """``ConfigError`` (one line) when the cluster holds fewer of a resource than ``num_slices`` workers ask for
        in all (``Processes.resources_per_worker``): they could never all be placed."""
        assert self._config.processes is not None
        want = {k: v for k, v in self._config.processes.resources_per_worker.items() if v > 0}
        if not want:
            return
        have = ray.cluster_resources()
        n = self._config.num_slices
        for name, amount in sorted(want.items()):
            if have.get(name, 0.0) < n * amount:
                fit = int(have.get(name, 0.0) // amount)
                fewer = f"set num_slices={fit} or " if fit >= 1 else ""
                raise ConfigError(
                    f"num_slices={n} workers of {{{name!r}: {amount:g}}} need {n * amount:g} {name} but the cluster "
                    f"has {have.get(name, 0.0):g}: {fewer}lower processes.resources_per_worker, or add nodes before "
                    "the job starts"
                )

    def __call__(
        self, index: int, incarnation: int, supervisor: Any, options: dict[str, Any], control: str | None
    ) -> Any:
        if workers_start_niced():  # its imports too start at an ordinary priority, without any right to raise it
            options = {**options, "runtime_env": NORMAL_PRIORITY}
        return (
            ray.remote(SliceWorker)
            .options(**self.actor_options(), **options, max_concurrency=16)
            .remote(index, incarnation, supervisor, self._spec, self.env(), control)
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
        self._handles: dict[int, Any] = {}  # the current group's workers
        self._incarnations: dict[int, int] = {}  # and their agent incarnations
        self._aborted_epoch = -1
        self._service: distributed.CoordinationService | None = None
        self._died: set[int] = set()  # the members whose process died in the last _collect
        self._gone: set[int] = set()  # slices whose process died or was ended since their last group (replaced)
        self._loop_ref: Any = None
        self._reached = -1  # the highest step any pass started (a drill's fault fires only past it)
        self._last_pid: dict[int, int] = {}  # slice -> the process it ran the last group in
        self._pids: dict[int, int] = {}
        self._nodes: dict[int, str] = {}  # slice -> the Ray node its worker of the current group runs on
        self._calls: list[Any] = []  # the lead's jitted calls, for the standby group
        self._stats: dict[str, Any] = {}  # the lead's latest snapshot counters
        self._snapshots: dict[int, dict[str, Any]] = {}  # slice -> its snapshot counters at its last pass end
        self._final: Any = None
        self.figures: dict[str, Any] = {
            "mode": "multi-process",
            "worker_processes_restarted": 0,
            "survivors_lost": 0,
            "workers_hung_killed": 0,
            "reform_seconds": [],
            "detection_seconds": [],
            "recovery_compile_seconds": [],
            "worker_pids": {},
        }
        self._standby = StandbyGroup(
            cache_dir=cache_dir,
            actor_options=factory.actor_options,
            env=factory.env(),
            mesh_fn=spec.mesh_fn,
            rendezvous_timeout_s=self._procs.rendezvous_timeout_s,
            job=config.job_name,
        )
        self._recovering = False

    # -- the seam -------------------------------------------------------------------------------------------------
    def standby_ready(self, view: View) -> bool | None:
        return self._standby.ready(len(view.active)) if self._calls else None

    def prepare(self, view: View, *, live: bool, during: PrepareHook) -> Placed:
        members = tuple(sorted(view.active))
        group = self._group()
        previous = self._members
        leavers = self._leavers(view, previous, live=live)  # leaving on notice: asked, then let go cleanly
        for s in set(previous) - set(members) - set(leavers):  # left out (stopped, hung, not yet dead): ended
            self._kill(s)
        handles = {s: group.agent(s) for s in members}
        incarnations = {s: group.incarnation(s) for s in members}
        asked = time.monotonic()
        helds = self._ask(handles, "held", timeout=90.0, args=(live,))  # at a boundary: its snapshot, copied
        donated = self._donations(leavers)
        holders = [s for s in (*members, *sorted(donated)) if any(h["own"] for h in {**helds, **donated}[s].values())]
        source, step, keeper, tier = self._source({**helds, **donated}, holders, live=live, previous=previous)
        leavers = {s: h for s, h in leavers.items() if s in donated}
        self._log.info(
            "group_source", epoch=view.epoch, source=source, step=step, held={s: sorted(h) for s, h in helds.items()}
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
            keeper=keeper,
            rendezvous_timeout_s=self._procs.rendezvous_timeout_s,
            record_calls=not self._calls,
            fault_floor=self._reached,
            donors=leavers,
        )
        refs = {handles[s].prepare.remote(plan): s for s in members}
        if step is not None:
            grew = len(members) > len(previous)
            during("restore" if not live else "grow" if grew else "reshard", step, view)
        try:
            results = self._collect(
                refs,
                timeout=self.config.startup_timeout_s + 2 * self._procs.rendezvous_timeout_s,
                what=f"group {plan.epoch} to form",
            )
            self._depart(leavers)  # after the survivors re-formed (they may have read from it), before its group ends
        except runtime.SliceLostError:
            died = self._died & set(previous)  # a survivor of the last group died as this one formed
            self._gone |= self._died
            self.figures["survivors_lost"] += len(self._collateral(died - self._targeted(plan, died)))
            for s in leavers:
                self._kill(s)
            raise
        finally:
            if old is not None:
                old.stop()
        self._plan, self._members, self._handles = plan, members, handles
        self._incarnations = {s: i for s, i in incarnations.items() if i is not None}
        pids = {s: res["pid"] for s, res in results.items()}
        self.figures["worker_processes_restarted"] += len(restarted(pids, previous, self._last_pid, self._gone))
        for s, res in results.items():
            self._last_pid[s] = self._pids[s] = res["pid"]
            self._nodes[s] = res.get("node", "")
        self._gone -= set(results)
        self.figures["worker_pids"] = dict(self._pids)
        reform = max(r.get("reform_seconds") or 0.0 for r in results.values())
        if self._recovering:
            self.figures["reform_seconds"].append(round(reform, 3))
        detail = {
            "reform_seconds": round(reform, 3),
            "restore_seconds": max(r.get("restore_seconds") or 0.0 for r in results.values()),
            "phases": {
                "held": round(chose - asked, 3),
                "formed": round(time.monotonic() - chose, 3),
                **{
                    k: max(r.get("phases", {}).get(k, 0.0) for r in results.values())
                    for k in (
                        "end_group",
                        "leave",
                        "leave_backend",
                        "leave_caches",
                        "leave_gc",
                        "leave_client",
                        "join",
                        "backend",
                        "shardings",
                        "restore",
                    )
                },
            },
        }
        meta = results[members[0]].get("meta")
        if source == "fresh":
            return Placed(how="fresh", step=self._spec.init_step, detail=detail)
        assert step is not None and meta is not None
        if live:
            return Placed(how="moved", step=step, detail=detail)
        return Placed(how="restored", step=step, tier=tier, generation=step, meta=meta, detail=detail)

    def _leavers(self, view: View, previous: tuple[int, ...], *, live: bool) -> dict[int, Any]:
        """The workers of the last group's members that leave on notice at this boundary (alive, not replaced)."""
        if not live:
            return {}
        out = set(previous) - set(view.active)
        return {s: self._handles[s] for s in sorted(out & view.leaving) if s in self._handles and s not in self._gone}

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
        codes = self.figures.setdefault("leaving_exit_codes", {})
        for ref, s in refs.items():
            self._gone.add(s)
            try:
                codes[s] = ray.get(ref)["exit_code"] if ref in ready else None
            except Exception:  # noqa: BLE001 - it died as it left
                codes[s] = None
            if codes[s] is None:
                self._kill(s)
        if refs:
            self._log.info("left_on_notice", slices=sorted(refs.values()), exit_codes=codes)

    def _source(
        self, helds: dict[int, dict[int, Any]], holders: list[int], *, live: bool, previous: tuple[int, ...]
    ) -> tuple[str, int | None, str | None, str | None]:
        """Where the state comes from: (source, step, keeper, tier)."""
        step = common_step([helds[s] for s in holders]) if holders else None
        if step is not None:
            return "memory", step, None, "memory"
        if live:
            raise ElasticError(f"the members {sorted(holders)} do not hold the boundary snapshot between them")
        keepers = self._keepers()
        if keepers is not None:
            whole = keepers.whole_steps(timeout=30.0)
            if whole:
                found, name = next(iter(whole.items()))
                return "keeper", found, name, "keeper"
        persistent = self._persistent_step()
        if persistent is not None:
            return "persistent", persistent, None, "persistent"
        if holders or self._acct.ledger.steps:
            raise ElasticError(
                f"no tier can restore the state: the surviving workers {holders} do not hold a whole step between "
                "them (a worker was lost with the buddy copy of its shards), and no keeper or persistent copy "
                "exists. Nothing was restarted from step 0; raise tiers.keeper_every's frequency, or set "
                "tiers.persistent_dir"
            )
        return "fresh", None, None, None

    def _persistent_step(self) -> int | None:
        directory = self.config.tiers.persistent_dir
        if directory is None:
            return None
        import orbax.checkpoint as ocp
        from etils import epath

        path = epath.Path(directory)
        if not path.exists():
            return None
        manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
        try:
            return manager.latest_step()
        finally:
            manager.close()

    def run_pass(self, loop: Callable[..., Any], host: PlacementHost) -> PassEnd:
        plan = self._plan
        assert plan is not None, "run_pass before prepare"
        if self._loop_ref is None:
            self._loop_ref = ray.put(loop)
        plan = dataclasses.replace(plan, loop=self._loop_ref)
        handles = dict(self._handles)  # the group's own workers (a replacement may be starting meanwhile)
        pending = {handles[s].run_pass.remote(plan): s for s in plan.members}
        run = _RunInfo(plan.view, plan.step or 0, len(plan.members) * self.config.devices_per_slice)
        renewing = threading.Event()
        threading.Thread(target=self._renew, args=(handles, renewing), name="lease", daemon=True).start()
        try:
            return self._watch(plan, handles, pending, host, run)
        finally:
            renewing.set()

    def _renew(self, handles: dict[int, Any], stop: threading.Event) -> None:
        """Tell every member the driver lives (their lease, ``worker.DRIVER_LEASE_S``), from a thread of its own: a
        slow poll (an ``on_step`` callback, a busy host) must not end the pass; only this process's death does."""
        while not stop.wait(RENEW_S):
            for handle in handles.values():
                handle.renew.remote()

    def _watch(
        self, plan: GroupPlan, handles: dict[int, Any], pending: dict[Any, int], host: PlacementHost, run: _RunInfo
    ) -> PassEnd:
        results: dict[int, dict[str, Any]] = {}
        lost: set[int] = set()
        failed_at: float | None = None
        seen = 0  # commits of this pass accounted so far
        next_step = plan.step or 0
        stop: View | None = None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                s = pending.pop(ref)
                try:
                    results[s] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    lost.add(s)
                    failed_at = failed_at or time.time()
                    self._acct.timeline.add("worker_lost", slice=s, epoch=plan.view.epoch)
                    if self._procs.replace_lost and s in self._incarnations:  # a new process for it, at once
                        self._group().replace(s, self._incarnations[s])
                    continue
                if results[s]["status"] not in ("finished", "regroup"):
                    failed_at = failed_at or results[s].get("failed_at") or time.time()
                    self._acct.timeline.add(
                        "collective_failed",
                        slice=s,
                        status=results[s]["status"],
                        error=str(results[s].get("error"))[:160],
                    )
            if failed_at is not None:
                if self._aborted_epoch != plan.epoch:
                    self._aborted_epoch = plan.epoch
                    for s in pending.values():  # the rest may wait on the lost one until the collective timeout
                        handles[s].abort.remote(plan.epoch)
                if time.time() - failed_at > self._procs.settle_timeout_s:
                    for s in list(pending.values()):
                        self._kill(s)
                        lost.add(s)
                        self.figures["workers_hung_killed"] += 1
                        self._acct.timeline.add("worker_stuck_killed", slice=s, epoch=plan.view.epoch)
                    pending.clear()
                continue
            if not pending:
                break
            got = self._progress(handles, pending.values(), seen)
            if got is not None:
                for step, batch, metrics in got["commits"]:
                    self._commit(host, step, batch, metrics, plan, run)
                seen += len(got["commits"])
                next_step = max(next_step, got["next_step"])
                self._reached = max(self._reached, next_step)
                self._stats = got["snapshots"]
                if got["calls"] and not self._calls:
                    self._calls = got["calls"]
                if self._calls and seen >= 2:  # every function of a step has run: rehearse the group one smaller
                    self._prepare_standby(len(plan.members))
            host.before_step(next_step)  # the drill's driver-side faults (a revive), the stall reporter
            view = host.view
            staying = view.leaving - _past(view.notices, time.time())  # a leaver past its deadline is gone, hung or not
            gone = {ref: s for ref, s in pending.items() if s not in view.active and s not in staying}
            if gone and view.gave_up is None:  # the supervisor dropped a member still in the pass: end the pass
                failed_at = time.time()
                dead, _ = ray.wait(list(gone), num_returns=len(gone), timeout=1.0)  # a dead process's call fails
                for ref, s in gone.items():
                    del pending[ref]
                    lost.add(s)
                    if ref in dead:
                        self._acct.timeline.add("worker_lost", slice=s, epoch=plan.view.epoch)
                        if self._procs.replace_lost and s in self._incarnations:
                            self._group().replace(s, self._incarnations[s])
                        continue
                    self._kill(s)  # alive but silent (a hung host): ended for good
                    self.figures["workers_hung_killed"] += 1
                    self._acct.timeline.add("worker_stuck_killed", slice=s, epoch=plan.view.epoch, reason=view.reason)
                continue
            if stop is None and view.epoch != plan.view.epoch:
                stop = view
                at = next_step + STOP_MARGIN_STEPS
                if at < self.config.num_steps:
                    self._acct.timeline.add("stop_requested", epoch=plan.view.epoch, before_step=at)
                    for s in pending.values():
                        handles[s].request_stop.remote(plan.epoch, at, view)
        return self._end_pass(plan, results, lost, seen, host, run, stop)

    def _end_pass(
        self,
        plan: GroupPlan,
        results: dict[int, dict[str, Any]],
        lost: set[int],
        seen: int,
        host: PlacementHost,
        run: _RunInfo,
        stop: View | None,
    ) -> PassEnd:
        tails = sorted((r for r in results.values() if r.get("commits")), key=lambda r: len(r["commits"]))
        if tails:  # the commits not read during the pass, from the member that committed the most
            for step, batch, metrics in tails[-1]["commits"][seen:]:
                self._commit(host, step, batch, metrics, plan, run)
        for s, r in results.items():
            self._snapshots[s] = r.get("snapshots", {})
            self._reached = max(self._reached, r.get("next_step", 0))
        self._standby.ran(len(plan.members))
        errors = [r for r in results.values() if r["status"] == "error"]
        if errors:
            raise ElasticError(
                f"slice {errors[0]['slice']}'s loop failed: {errors[0]['error']}\n{errors[0].get('traceback', '')}"
            )
        self._gone |= lost
        failed = sorted(lost | {s for s, r in results.items() if r["status"] in ("failed", "hung")})
        if failed:
            self._recovering = True
            self.figures["survivors_lost"] += len(self._collateral(lost - self._targeted(plan, lost)))
            if not lost and all(results[s]["status"] == "hung" for s in failed):
                raise runtime.StepHungError(
                    f"group {plan.epoch}'s step",
                    self.config.step_timeout_s or 0.0,
                    hint=str(results[failed[0]].get("error"))[:300],
                )
            why = "; ".join(
                f"slice {s}: " + ("worker process died" if s in lost else str(results[s].get("error"))[:120])
                for s in failed[:4]
            )
            raise runtime.SliceLostError(f"group {plan.epoch} broke ({why})", slices=tuple(failed))
        first = [r for r in results.values() if r.get("first_commit_at")]
        if self._recovering and first:
            self._recovering = False
            self.figures["recovery_compile_seconds"].append(
                max(r.get("first_step_compile_seconds") or 0.0 for r in first)
            )
            self.figures.setdefault("recovery_first_step", []).append(
                {k: max((r.get("first_step_phases") or {}).get(k) or 0.0 for r in first) for k in ("to_step", "step")}
            )
        if all(r["status"] == "finished" for r in results.values()):
            self._final = plan
            return PassEnd()
        assert stop is not None
        return PassEnd(regroup=stop, live=True)

    def _targeted(self, plan: GroupPlan, lost: set[int]) -> set[int]:
        """The lost slices a drill's fault took (their loss is no survivor's)."""
        return {s for s in lost if any(hook.takes(s) for hook in self._spec.step_hooks)}

    def _collateral(self, lost: set[int]) -> set[int]:
        """The lost workers whose node lives on: not taken by their host's loss, they died with a peer's failure."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return {s for s in lost if self._nodes.get(s) in alive}

    def _commit(
        self, host: PlacementHost, step: int, batch: int, metrics: dict[str, Any], plan: GroupPlan, run: _RunInfo
    ) -> None:
        host.on_commit(step, batch, metrics, plan.view, run)

    def _progress(self, handles: dict[int, Any], pending: Any, since: int) -> dict[str, Any] | None:
        """The pass's progress from the first member that answers within a second (members run in lockstep)."""
        for s in list(pending):
            try:
                return ray.get(handles[s].progress.remote(since), timeout=1.0)
            except Exception:  # noqa: BLE001 - a dead, stopped or busy worker: ask the next
                continue
        return None

    def _prepare_standby(self, size: int) -> None:
        if not self._procs.standby:
            return
        smaller = size - 1
        if smaller >= max(1, self.config.policy.min_slices):
            self._standby.prepare(smaller, self._calls)

    def drop(self) -> None:
        self._plan = None

    def probe(
        self, slices: frozenset[int], timeout_s: float | None, *, early: Callable[[frozenset[int]], None] | None = None
    ) -> frozenset[int]:
        """Which workers do not answer a ping within a few seconds (dead, stopped, or on a lost node). A worker
        replaced or gone from the group is known dead before any ping is awaited (``early``)."""
        group = self._group()
        bound = min(timeout_s or PROBE_S, PROBE_S)
        refs = {}
        dead = set()
        for s in slices:
            if s in self._incarnations and group.incarnation(s) != self._incarnations[s]:
                dead.add(s)  # the group's worker died and a replacement was started: not the same process
                continue
            try:
                refs[s] = group.agent(s).ping.remote()
            except KeyError:
                dead.add(s)
        if dead and early is not None:
            early(frozenset(dead))
        for s, ref in refs.items():
            try:
                ray.get(ref, timeout=bound)
            except Exception:  # noqa: BLE001 - no answer: that worker is gone
                dead.add(s)
        return frozenset(dead)

    def lost(self, slices: frozenset[int]) -> tuple[dict[int, int] | None, bool]:
        """The incarnations of the group's workers that were seen failing; a worker that does not answer lost its
        process, not (necessarily) its hardware: a new one may be started for its slice."""
        return {s: self._incarnations[s] for s in slices if s in self._incarnations}, False

    def replaced(self, slices: frozenset[int], lost: dict[int, int] | None) -> frozenset[int]:
        """Which of these lost slices already have a newer worker than the one lost (``lost``: as ``lost`` said)."""
        group = self._group()
        return frozenset(s for s in slices if lost and s in lost and (group.incarnation(s) or -1) > lost[s])

    def final_state(self) -> Any:
        """The final state as host arrays, assembled from every worker's own regions (typed keys wrapped back).
        Assembled in the driver: meant for checking small models; a large one is written by ``save_final_to``."""
        if self._final is None:
            return None
        plan = self._final
        refs = {self._handles[s].final_pieces.remote(): s for s in plan.members}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=120.0)
        got: dict[int, Any] = {}
        for ref in ready:
            try:
                got[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError:  # died after the last step: the others may hold its regions
                continue
        if not got:
            raise ElasticError(f"no worker of the final group {sorted(plan.members)} answered for the final state")
        abstract = jax.eval_shape(self._spec.init_fn, jax.random.key(self.config.seed))
        treedef = jax.tree_util.tree_structure(abstract)
        layout = next(iter(got.values()))["layout"]
        out = []
        for i, (shape, dtype, key_impl) in enumerate(layout):
            full = np.empty(tuple(shape), dtype=np.dtype(dtype))
            filled = np.zeros(tuple(shape), dtype=bool)
            for answer in got.values():
                for index, data in answer["pieces"][i]:
                    where = tuple(slice(a, b) for a, b in index)
                    full[where], filled[where] = data, True
            if not filled.all():
                gone = sorted(set(plan.members) - set(got))
                raise ElasticError(
                    f"the final state's leaf {i} is incomplete: slice(s) {gone} died after the last step and held "
                    "the only copy of part of it (the job's last Orbax step, or save_final_to, has it whole)"
                )
            out.append(full if key_impl is None else jax.random.wrap_key_data(full, impl=key_impl))  # type: ignore[arg-type]  # host data
        return jax.tree_util.tree_unflatten(treedef, out)

    def save_final(self, path: str) -> None:
        assert self._final is not None
        refs = [self._handles[s].save_final.remote(path) for s in self._final.members]
        ray.get(refs, timeout=600)

    def fill(self, report: Any) -> None:
        lead = self._snapshots.get(self._members[0], {}) if self._members else {}
        report.snapshots_requested = lead.get("snapshots_requested", 0)
        report.snapshots_taken = lead.get("snapshots_taken", 0)
        report.snapshots_coalesced = lead.get("snapshots_coalesced", 0)
        report.snapshots_failed = lead.get("snapshots_failed", 0)
        report.snapshot_blocking_seconds = round(
            max((s.get("blocking_seconds", 0.0) for s in self._snapshots.values()), default=0.0), 4
        )
        report.snapshot_held_bytes = sum(s.get("held_bytes", 0) for s in self._snapshots.values())
        report.snapshot_copies = min(2, len(self._members)) if report.snapshot_held_bytes else 0
        ends = [self._snapshots.get(s, {}) for s in self._members]
        latest = [e.get("latest_step") for e in ends]
        self.figures["snapshot_latest_step"] = (
            None if not latest or None in latest else min(x for x in latest if x is not None)
        )
        self.figures["snapshots_dropped"] = max((e.get("snapshots_dropped", 0) for e in ends), default=0)
        keepers = self._keepers()
        if keepers is not None:
            k = keepers.stats()
            report.keeper_bytes, report.keeper_pushes = k["keeper_bytes"], k["keeper_pushes"]
        report.standby_compiles = self._standby.compiled
        report.standby_skipped = self._standby.skipped
        report.standby_compile_seconds = round(self._standby.seconds, 3)
        report.extra.update(self.figures)

    def snapshot_stats(self) -> dict[str, Any]:
        """The lead worker's snapshot counters, as last read (the same keys as the single-process snapshotter's)."""
        return {"blocking_seconds": 0.0, "snapshots_taken": 0, "held_bytes": 0, **self._stats}

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
        refs = [h.leave.remote() for h in self._handles.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        self._stop_service()

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _ask(
        self, handles: dict[int, Any], method: str, *, timeout: float, args: tuple[Any, ...] = ()
    ) -> dict[int, Any]:
        refs = {getattr(h, method).remote(*args): s for s, h in handles.items()}
        return self._collect(refs, timeout=timeout, what=f"the workers to answer {method}")

    def _collect(self, refs: dict[Any, int], *, timeout: float, what: str) -> dict[int, Any]:
        """Every member's answer; a member that died or did not answer is a lost slice (a slice-loss error)."""
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        out: dict[int, Any] = {}
        missing = []
        self._died = set()
        for ref, s in refs.items():
            if ref not in ready:
                missing.append(s)
                continue
            try:
                out[s] = ray.get(ref)
            except ray.exceptions.RayActorError:
                missing.append(s)
                self._died.add(s)
        if missing:
            raise runtime.SliceLostError(
                f"slice(s) {sorted(missing)} did not answer while waiting for {what}", slices=tuple(sorted(missing))
            )
        bad = {s: r for s, r in out.items() if isinstance(r, dict) and r.get("status") in ("failed", "error")}
        if bad:
            s, r = next(iter(bad.items()))
            if r["status"] == "error":
                raise ElasticError(
                    f"slice {s}'s worker failed while waiting for {what}: {r['error']}\n{r.get('traceback', '')}"
                )
            raise runtime.SliceLostError(
                f"slice {s}'s worker failed while waiting for {what}: {r['error']}", slices=(s,)
            )
        return out

    def _kill(self, s: int) -> None:
        """End the process slice ``s`` ran the current group in (``ray.kill``; a stopped process on this node is
        SIGKILLed too). A newer worker of that slice, starting meanwhile, is left alone."""
        self._gone.add(s)
        handle = self._handles.get(s)
        if handle is not None:
            try:
                ray.kill(getattr(handle, "handle", handle), no_restart=True)  # a Credentialed handle's actor
            except Exception:  # noqa: BLE001 - already gone
                pass
        pid = self._pids.get(s)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_service(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None


def _past(notices: Iterable[Any], now: float) -> frozenset[int]:
    """The slices of ``notices`` whose deadline has passed by ``now``."""
    return frozenset(s for n in notices if n.deadline <= now for s in n.slices)


def restarted(pids: dict[int, int], previous: Iterable[int], last: dict[int, int], gone: set[int]) -> set[int]:
    """The members of a new group (slice -> process id, ``pids``) that were in the ``previous`` group in another
    process (``last``), though that process was neither lost nor ended (``gone``): a survivor restarted instead of
    re-formed in place. A lost worker's replacement is not one (its loss is counted where it was seen)."""
    return {s for s in previous if s in pids and s in last and s not in gone and pids[s] != last[s]}


class _RunInfo:
    """What ``on_step`` callbacks get as ``run`` in multi-process mode (the loop's own runs are in the workers)."""

    def __init__(self, view: View, start_step: int, num_devices: int) -> None:
        self.view = view
        self.epoch = view.epoch
        self.slices = tuple(sorted(view.active))
        self.start_step = start_step
        self.num_devices = num_devices
