"""The driver of a multi-controller job: the process ``ray job submit`` (or ``elastic demo``) runs. Never restarted.

It hosts each group's coordination service (:class:`runtime.distributed.CoordinationService`: a worker that
dies must not take the service with it), starts one :class:`elastic.placements.mc_worker.SliceWorker` actor (one process)
per slice, hands every member the group's plan, and watches the pass (bounded): a worker's death shows as its
``run_group`` call failing with a Ray actor error (its process is gone), the survivors' as status ``failed``
once their next collective breaks (within the collective timeout). Membership is decided by the same pure
:func:`elastic.supervision.policy.decide` as in single-controller mode; the survivors then re-form IN PLACE (same processes)
over a new service on a new port, and resume from the newest step whose whole state they hold between them
(own shards, buddy copies of the dead worker's). A slice added back (:meth:`McDriver.add_slice`) joins at a step
boundary: the group stops before a step, snapshots there, and re-forms with the new worker, which fetches its
shards from its peers. The report counts what the promises are about: the ledger of committed steps
(duplicates, skips), recovery seconds, and worker processes restarted (survivors: 0).
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.placements import mc_store
from elastic.errors import ElasticError, GiveUpError, RecoveryTimeoutError
from elastic.placements.mc_config import McConfig
from elastic.placements.mc_snapshots import common_step
from elastic.placements.mc_worker import GroupPlan, SliceWorker
from elastic.supervision.membership import HealthEvent, View
from elastic.supervision.policy import Grow, HealthTally, Shrink, Stay, decide
from elastic.control.report import Ledger, Report, Timeline
from runtime import distributed

__all__ = ["McConfig", "McDriver"]


class McDriver:
    """Starts, watches, re-forms and reports one multi-controller job. Use as a context manager."""

    def __init__(self, config: McConfig, *, init_fn: Callable[..., Any], loop: Callable[..., Any],
                 shardings_fn: Callable[..., Any] | None = None,
                 hooks: tuple[Callable[[McDriver, int], None], ...] = ()) -> None:
        self.config = config
        self.run_id = uuid.uuid4().hex[:12]
        self._store_root = mc_store.default_root(self.run_id) if config.node_store else None
        self._worker_args = {"init_fn": init_fn, "loop": loop, "shardings_fn": shardings_fn,
                             "num_steps": config.num_steps, "snapshot_every": config.snapshot_every,
                             "seed": config.seed, "store_root": self._store_root}
        self._hooks = hooks
        self.workers: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self._joining: dict[int, tuple[Any, Any, int | None]] = {}  # slice -> (worker, its where() ref, join_by)
        self._nodes: dict[int, str] = {}  # slice -> the Ray node its worker runs on
        self._host, self._node = "127.0.0.1", ""
        self.timeline = Timeline()
        self.faults: list[tuple[float, str, frozenset[int]]] = []  # (wall time, what, slices) caused from outside
        self._targeted: set[int] = set()  # slices a recorded fault took (their loss is no survivor's)
        self._epoch = 0
        self._services: list[distributed.CoordinationService] = []

    # -- workers ------------------------------------------------------------------------------------
    def _spawn(self, slice_index: int) -> Any:
        """A worker process for ``slice_index``; a replacement prefers the node of the process it replaces
        (where that one's node store is), and goes elsewhere if that node is gone or full."""
        node = self._nodes.get(slice_index)
        alive = node is not None and any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())
        # (soft affinity to a removed node left the replacement pending here, Ray 2.60: only a live one is named)
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)} if alive else {}
        cls = ray.remote(SliceWorker).options(
            **self.config.worker_options(), **placement, max_concurrency=8, max_restarts=0,
            runtime_env={"env_vars": distributed.collective_env(self.config.devices_per_slice,
                                                                collective_timeout_s=self.config.collective_timeout_s)})
        return cls.remote(slice_index, **self._worker_args)

    def start(self) -> None:
        workers = {s: self._spawn(s) for s in range(self.config.num_slices)}
        self._host = ray.util.get_node_ip_address()  # the services listen here; workers may be on other nodes
        self._node = ray.get_runtime_context().get_node_id()
        refs = {s: w.where.remote() for s, w in workers.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.config.startup_timeout_s)
        if len(ready) < len(refs):
            for worker in workers.values():
                ray.kill(worker, no_restart=True)
            raise RecoveryTimeoutError(
                f"{len(refs) - len(ready)} of {len(refs)} worker processes did not start within startup_timeout_s="
                f"{self.config.startup_timeout_s}: check that the cluster has {len(refs)} places with "
                f"{self.config.worker_options()} free (`ray status`), or raise startup_timeout_s")
        self.workers = workers
        for s, ref in refs.items():
            self.pids[s], self._nodes[s] = ray.get(ref)
        self.timeline.add("workers_started", pids=dict(self.pids))

    def record_fault(self, what: str, slices: Iterable[int]) -> None:
        """Count a fault caused from outside (a test, a drill: a node removed, a process stopped) just before it
        is caused: recovery is timed from it, and the loss of ``slices`` is not counted as a survivor's."""
        slices = frozenset(slices)
        self.faults.append((time.time(), what, slices))
        self._targeted |= slices
        self.timeline.add("fault", what=what, slices=sorted(slices))

    def kill_worker(self, slice_index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL: a real process death; SIGSTOP: a hung process) to ``slice_index``'s worker
        process. A testing seam: the worker must run on this machine."""
        self.record_fault(signal.Signals(sig).name, [slice_index])
        os.kill(self.pids[slice_index], sig)
        self.timeline.add("worker_killed" if sig == signal.SIGKILL else "worker_signalled", slice=slice_index,
                          pid=self.pids[slice_index], signal=signal.Signals(sig).name)

    def add_slice(self, slice_index: int, *, join_by: int | None = None) -> None:
        """Start a new worker process for ``slice_index``; it joins the group at the next step boundary once it
        is up (the group trains on meanwhile). With ``join_by``, the group also stops before about that step at
        the latest and waits there for it (up to ``startup_timeout_s``)."""
        worker = self._spawn(slice_index)
        self._joining[slice_index] = (worker, worker.where.remote(), join_by)
        self.timeline.add("worker_starting", slice=slice_index)

    def close(self) -> None:
        for s in list(self.workers):
            self._kill(s)
        for worker, _, _ in self._joining.values():
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for service in self._services:
            service.stop()
        self._services.clear()
        if self._store_root is not None:
            self._remove_stores()

    def _remove_stores(self) -> None:
        """Remove this job's node-store files on every node a worker ran on (bounded; a node gone took its own)."""
        refs = [_remove_store.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                .remote(self._store_root) for n in set(self._nodes.values())]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        mc_store.remove_job(self._store_root)  # the driver's node, whether or not a worker ran there

    def __enter__(self) -> McDriver:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the job ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.config
        members = tuple(range(cfg.num_slices))
        view = View(epoch=1, active=frozenset(members), reason="started")
        tally = HealthTally(cfg.policy, [HealthEvent(time=time.monotonic(), slice=s, healthy=True) for s in members])
        report = Report(slices_initial=len(members), min_slices_seen=len(members))
        extra: dict[str, Any] = {"mode": "multi-process", "worker_processes_restarted": 0, "survivors_lost": 0,
                                 "workers_hung_killed": 0, "restored_from_node_store": 0,
                                 "reform_seconds": [], "detection_seconds": [],
                                 "worker_pids": {}}
        faults_seen = 0
        start_step: int | None = None
        executed = 0
        last_pid: dict[int, int] = {}  # slice -> the process it ran the last group in
        recovering: float | None = None  # wall time of the failure being recovered from
        while True:
            service = distributed.CoordinationService(len(members), host=self._host)
            self._services.append(service)
            self._epoch += 1
            plan = GroupPlan(epoch=self._epoch, address=service.address, members=members, start_step=start_step,
                             peers={s: self.workers[s] for s in members},
                             rendezvous_timeout_s=cfg.rendezvous_timeout_s)
            self.timeline.add("group_formed", epoch=plan.epoch, members=list(members), start_step=start_step,
                              port=service.port)
            results, lost, stuck, detected_at = self._watch(plan)
            extra["workers_hung_killed"] += len(stuck)
            service.stop()
            self._services.remove(service)
            for s, res in results.items():  # a member that ran the last group in another process was restarted
                if s in last_pid and res["pid"] != last_pid[s]:
                    extra["worker_processes_restarted"] += 1
                last_pid[s] = res["pid"]
            if recovering is not None:
                firsts = [r["first_commit_at"] for r in results.values() if r.get("first_commit_at")]
                if firsts:  # else this group failed too: the recovery goes on, timed from the first failure
                    report.recovery_seconds.append(round(min(firsts) - recovering, 3))
                    extra["reform_seconds"].append(round(max(r.get("reform_seconds") or 0.0
                                                             for r in results.values()), 3))
                    recovering = None
            head = results.get(members[0])
            executed += max((r["executed"] for r in results.values()), default=0)  # members run in lockstep
            errors = [r for r in results.values() if r["status"] == "error"]
            if errors:
                raise ElasticError(f"slice {errors[0]['slice']}'s loop failed: {errors[0]['error']}\n"
                                   f"{errors[0]['traceback']}")
            if head is not None and head["status"] == "finished":
                return self._finish(report, extra, head, executed, members)
            helds = self._probe(members, lost)  # a survivor may die after its pass ended (gloo aborts it late)
            now = time.monotonic()
            for s in sorted(lost):
                tally.add(HealthEvent(time=now, slice=s, healthy=False, cause="worker process died"))
                self.workers.pop(s, None)
                last_pid.pop(s, None)
                if cfg.replace_lost and s not in self._joining:
                    self.add_slice(s)
            extra["survivors_lost"] += len(lost - self._targeted)  # gloo aborted it, or it hung
            self._targeted -= lost
            joined = self._take_joiners(results)
            for s in joined:
                tally.add(HealthEvent(time=now, slice=s, healthy=True))
            decision = decide(view, tally, now, cfg.policy)
            self.timeline.add("decision", kind=type(decision).__name__, reason=decision.reason)
            if isinstance(decision, Shrink | Grow):
                view = View(epoch=view.epoch + 1, active=decision.to, reason=decision.reason)
                report.recoveries += isinstance(decision, Shrink)
                report.grows += isinstance(decision, Grow)
            elif not isinstance(decision, Stay):
                raise GiveUpError(decision.reason, epoch=view.epoch)
            survivors = [s for s in members if s not in lost]
            if lost and recovering is None:  # timed from the fault when caused from outside, else its first sign
                recovering = self.faults[-1][0] if len(self.faults) > faults_seen else detected_at
                extra["detection_seconds"].append(round(detected_at - recovering, 3))
            faults_seen = len(self.faults)
            start_step = common_step([helds[s] for s in survivors])
            if start_step is None and lost and executed:
                adopters = self._adopters(lost)  # new processes for lost slices, with what their nodes kept
                start_step = common_step([helds[s] for s in survivors] + list(adopters.values()))
                if start_step is not None:
                    for s in adopters:
                        tally.add(HealthEvent(time=now, slice=s, healthy=True))
                    view = View(epoch=view.epoch + 1, active=view.active | frozenset(adopters),
                                reason=f"new processes for slice(s) {sorted(adopters)} restore from the snapshots "
                                       "their predecessors left on their nodes")
                    report.grows += 1
                    extra["restored_from_node_store"] += len(adopters)
                    self.timeline.add("node_store_adopted", slices=sorted(adopters), step=start_step)
            if start_step is None and lost and executed:  # never silently from step 0 again
                raise ElasticError(
                    f"the surviving slices {survivors} do not hold the whole state of any step: slice(s) "
                    f"{sorted(lost)} were lost together with the buddy copies of their shards. Nothing was "
                    "restarted from scratch; resume from a persistent checkpoint, or keep state replicated across "
                    "slices (or sharded within one) so that each survivor holds a whole copy")
            self.timeline.add("restore_from", step=start_step, survivors=survivors)
            members = tuple(sorted(view.active))
            report.min_slices_seen = min(report.min_slices_seen, len(members))

    def _watch(self, plan: GroupPlan) -> tuple[dict[int, dict[str, Any]], set[int], set[int], float]:
        """Run one pass to its end: every member returned or died. Bounded: past ``settle_timeout_s`` after a
        failure (or ``pass_timeout_s`` in all), the members still in the pass are hung (a stopped process, a
        step that never reaches its next collective): they are killed and count as lost (and as ``stuck``)."""
        cfg = self.config
        pending = {self.workers[s].run_group.remote(plan): s for s in plan.members}
        results: dict[int, dict[str, Any]] = {}
        lost: set[int] = set()
        stuck: set[int] = set()
        failed_at: float | None = None
        stop_sent = abort_sent = False
        deadline = time.monotonic() + cfg.pass_timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.05)
            for ref in ready:
                s = pending.pop(ref)
                try:
                    results[s] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    lost.add(s)
                    failed_at = failed_at or time.time()
                    self.timeline.add("worker_lost", slice=s, epoch=plan.epoch)
                    continue
                if results[s]["status"] in ("failed", "error"):
                    failed_at = failed_at or results[s]["failed_at"]
                    self.timeline.add("collective_failed", slice=s, step=results[s]["step"],
                                      error=results[s]["error"][:160])
            if failed_at is not None and not abort_sent:  # the rest may wait on the lost one until the timeout
                for s in pending.values():
                    self.workers[s].abort.remote(plan.epoch)
                abort_sent = True
                self.timeline.add("group_aborted", epoch=plan.epoch, pending=sorted(pending.values()))
            if failed_at is None and pending:
                step = self._progress(pending.values())
                if not stop_sent and self._join_due(step) and not self._any_done(pending):  # a planned boundary
                    stop_at = step + cfg.stop_margin_steps
                    if stop_at < cfg.num_steps:
                        for s in pending.values():
                            self.workers[s].request_stop.remote(plan.epoch, stop_at)
                        stop_sent = True
                        self.timeline.add("join_requested", epoch=plan.epoch, before_step=stop_at,
                                          slices=sorted(self._joining))
                for hook in self._hooks:
                    hook(self, step)
            settled = failed_at is not None and time.time() - failed_at > cfg.settle_timeout_s
            if pending and (settled or time.monotonic() > deadline):
                for ref, s in list(pending.items()):
                    self._kill(s)
                    lost.add(s)
                    stuck.add(s)
                    self.timeline.add("worker_stuck_killed", slice=s, epoch=plan.epoch)
                pending.clear()
        return results, lost, stuck, failed_at or time.time()

    def _kill(self, slice_index: int) -> None:
        """End a worker for good. ``ray.kill`` marks it dead at once but leaves a stopped process to its
        raylet's grace period; one on this node is SIGKILLed here as well."""
        try:
            ray.kill(self.workers[slice_index], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self._nodes.get(slice_index) == self._node:
            try:
                os.kill(self.pids[slice_index], signal.SIGKILL)
            except (ProcessLookupError, KeyError):
                pass

    def _probe(self, members: tuple[int, ...], lost: set[int]) -> dict[int, dict[int, dict[str, Any]]]:
        """What each member not yet in ``lost`` holds (``held()``); one that died after its pass ended, or does
        not answer within 30 s, is added to ``lost`` (and killed)."""
        refs = {s: self.workers[s].held.remote() for s in members if s not in lost}
        helds: dict[int, dict[int, dict[str, Any]]] = {}
        for s, ref in refs.items():
            try:
                helds[s] = ray.get(ref, timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._kill(s)
                lost.add(s)
                self.timeline.add("worker_lost", slice=s, epoch=self._epoch, after_pass=True)
        return helds

    def _adopters(self, lost: set[int]) -> dict[int, dict[int, dict[str, Any]]]:
        """The new processes for ``lost`` slices that are up within ``startup_timeout_s``, taken into the group
        now, with what each holds (its predecessor's node-store generations): slice -> ``held()``."""
        waiting = {s: self._joining[s] for s in sorted(lost) if s in self._joining}
        if not waiting:
            return {}
        refs = [ref for _, ref, _ in waiting.values()]
        ray.wait(refs, num_returns=len(refs), timeout=self.config.startup_timeout_s)
        found: dict[int, dict[int, dict[str, Any]]] = {}
        for s, (worker, ref, _) in waiting.items():
            try:
                self.pids[s], self._nodes[s] = ray.get(ref, timeout=0)
                found[s] = ray.get(worker.held.remote(), timeout=30)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue
            self.workers[s] = worker
            del self._joining[s]
        return found

    def _join_due(self, step: int) -> bool:
        """Whether to plan a join boundary now: every new process is up, or the group is within the stop margin
        of a ``join_by`` step (it then stops there and waits for them)."""
        if not self._joining:
            return False
        by = [j for _, _, j in self._joining.values() if j is not None]
        return self.joiners_ready() or bool(by and step + self.config.stop_margin_steps >= min(by))

    def joiners_ready(self) -> bool:
        """Whether new processes wait to join and all of them are up (so a boundary planned now is not waited
        for; the group trains on meanwhile)."""
        if not self._joining:
            return False
        refs = [r for _, r, _ in self._joining.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    @staticmethod
    def _any_done(pending: dict[Any, int]) -> bool:
        """Whether a member's pass already ended (a failure, likely): no boundary is planned for this group."""
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0)
        return bool(ready)

    def _progress(self, slices: Any) -> int:
        """The next step of the group (members run in lockstep): the first member to answer within 1 s, asked
        one at a time, so a stopped or dead member delays a poll by 1 s at most and a large group is not asked
        all at once every poll."""
        for s in slices:
            try:
                return int(ray.get(self.workers[s].progress.remote(), timeout=1.0)["next_step"])
            except Exception:  # noqa: BLE001 - a dead, stopped or busy worker: ask the next
                continue
        return 0

    def _take_joiners(self, results: dict[int, dict[str, Any]]) -> list[int]:
        """The slices whose new worker is up, when the pass ended at a join boundary (waiting for them up to
        ``startup_timeout_s``; past it, the group goes on without them and they join at a later boundary)."""
        if not self._joining or not results or any(r["status"] != "regroup" for r in results.values()):
            return []
        refs = [r for _, r, _ in self._joining.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.startup_timeout_s)
        if len(ready) < len(refs):
            self.timeline.add("join_waited_out", slices=sorted(self._joining))
            return []
        joined = []
        for s, (worker, ref, _) in sorted(self._joining.items()):
            try:
                self.pids[s], self._nodes[s] = ray.get(ref)
            except ray.exceptions.RayError:  # its process (or node) died before it joined
                self.timeline.add("joiner_lost", slice=s)
                continue
            self.workers[s] = worker
            joined.append(s)
        self._joining.clear()
        return joined

    def _finish(self, report: Report, extra: dict[str, Any], head: dict[str, Any], executed: int,
                members: tuple[int, ...]) -> dict[str, Any]:
        steps, _ = Ledger.expand(head["ledger"])
        report.slices_final = len(members)
        report.failures_injected = len(self.faults)
        report.steps_committed = len(steps)
        report.steps_recomputed = executed - len(steps)
        report.duplicate_steps = len(steps) - len(set(steps))
        report.skipped_steps = len(set(range(self.config.num_steps)) - set(steps))
        report.snapshots_taken = head["snapshots"]
        report.snapshot_blocking_seconds = round(head["snapshot_seconds"], 4)
        report.final_loss = head.get("final_loss")
        report.wall_seconds = round(time.time() - self.timeline.start, 3)
        report.timeline = self.timeline.events
        extra["worker_pids"] = dict(self.pids)
        return {"report": {**report.to_dict(), **extra}, "params": head.get("params")}


@ray.remote(num_cpus=0)
def _remove_store(root: str) -> None:
    mc_store.remove_job(root)
