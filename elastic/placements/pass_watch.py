"""Multi-process mode: a group's pass watched from the driver (bounded), and its end mapped to the controller's
events.

A worker's death shows as its ``run_pass`` call failing with a Ray actor error, the survivors' as a
:class:`~elastic.placements.outcome.PassOutcome` ending ``PEER_LOST`` once their next collective breaks (or at once:
the driver aborts their pass); a member still in the pass ``settle_timeout_s`` after a failure is hung, and is
killed. Commits are read from the lead worker as they happen and accounted through the controller's host
(exactly once and in order). When the supervisor's view changes during a pass, the group is asked to stop at a
step boundary a few steps ahead. Each ending maps to one event: ``ERROR`` to an ``ElasticError``, every member
``HUNG`` to a ``StepHungError``, any other failure to a ``SliceLostError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.accounting import Accounting
from elastic.control.placement import PassEnd, PlacementHost
from elastic.errors import ElasticError
from elastic.placements.members import Members
from elastic.placements.outcome import Ending, PassOutcome
from elastic.placements.plan import GroupPlan
from elastic.placements.standby import StandbyGroup
from elastic.supervision.membership import View

__all__ = ["PassWatch", "Passes", "RunInfo"]

POLL_S = 0.02  # how often a pass's progress is read
RENEW_S = 0.5  # how often every member is told the driver lives (the workers' lease; pass_runner.DRIVER_LEASE_S)
STOP_MARGIN_STEPS = 2  # a boundary for a new view is planned this many steps after the progress seen


@dataclass(kw_only=True)
class Passes:
    """What the driver learns from the passes, across groups: the mode's report figures, the highest step any pass
    started (a drill's fault fires only past it), the lead's latest snapshot counters, the jitted calls recorded
    for the standby group, each slice's snapshot counters at its last pass end, and the group that finished."""

    figures: dict[str, Any]
    reached: int = -1
    stats: dict[str, Any] = field(default_factory=dict)
    calls: list[Any] = field(default_factory=list)
    snapshots: dict[int, dict[str, Any]] = field(default_factory=dict)
    recovering: bool = False
    final: GroupPlan | None = None
    aborted_epoch: int = -1


class RunInfo:
    """What ``on_step`` callbacks get as ``run`` in multi-process mode (the loop's own runs are in the workers)."""

    def __init__(self, view: View, start_step: int, num_devices: int) -> None:
        self.view = view
        self.epoch = view.epoch
        self.slices = tuple(sorted(view.active))
        self.start_step = start_step
        self.num_devices = num_devices


class PassWatch:
    """Watches each pass of the placement's groups (``members``), keeping what it learns in ``passes``."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        members: Members,
        accounting: Accounting,
        passes: Passes,
        targeted: Callable[[set[int]], set[int]],
        standby: StandbyGroup,
    ) -> None:
        assert config.processes is not None
        self.config = config
        self._procs = config.processes
        self._members = members
        self._acct = accounting
        self._passes = passes
        self._targeted = targeted  # the lost slices a drill's fault took
        self._standby = standby

    def watch(self, plan: GroupPlan, handles: dict[int, Any], host: PlacementHost) -> PassEnd:
        """Run ``plan``'s pass on ``handles`` (the group's own workers) to its end."""
        pending = {handles[s].run_pass.remote(plan): s for s in plan.members}
        run = RunInfo(plan.view, plan.step or 0, len(plan.members) * self.config.devices_per_slice)
        renewing = threading.Event()
        threading.Thread(target=_renew, args=(handles, renewing), name="lease", daemon=True).start()
        try:
            return self._watch(plan, handles, pending, host, run)
        finally:
            renewing.set()

    def _prepare_standby(self, size: int) -> None:
        """Compile the step ahead for the group one slice smaller (standby on, and not below ``min_slices``)."""
        smaller = size - 1
        if self._procs.standby and smaller >= max(1, self.config.policy.min_slices):
            self._standby.prepare(smaller, self._passes.calls)

    def _lost(self, s: int, plan: GroupPlan, *, died: bool, reason: str | None = None) -> None:
        """Member ``s`` is out of the pass: its process died (a new one started for it when configured), or it was
        alive but stuck, and is ended."""
        if died:
            self._acct.timeline.add("worker_lost", slice=s, epoch=plan.view.epoch)
            if self._procs.replace_lost:  # a new process for it, at once
                self._members.replace(s)
            return
        self._members.kill(s)
        self._passes.figures["workers_hung_killed"] += 1
        extra = {} if reason is None else {"reason": reason}
        self._acct.timeline.add("worker_stuck_killed", slice=s, epoch=plan.view.epoch, **extra)

    def _watch(
        self, plan: GroupPlan, handles: dict[int, Any], pending: dict[Any, int], host: PlacementHost, run: RunInfo
    ) -> PassEnd:
        results: dict[int, PassOutcome] = {}
        lost: set[int] = set()
        failed_at: float | None = None
        seen = 0  # commits of this pass accounted so far
        next_step = plan.step or 0
        stop: View | None = None
        leavers: dict[int, float] = {}  # slices on notice in any view seen during the pass -> their deadline
        passes = self._passes
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                s = pending.pop(ref)
                try:
                    results[s] = outcome = ray.get(ref)
                except ray.exceptions.RayActorError:
                    lost.add(s)
                    failed_at = failed_at or time.time()
                    self._lost(s, plan, died=True)
                    continue
                if outcome.ending.failed:
                    failed_at = failed_at or outcome.failed_at or time.time()
                    self._acct.timeline.add(
                        "collective_failed", slice=s, status=outcome.ending.value, error=outcome.describe()[:160]
                    )
            if failed_at is not None:
                if passes.aborted_epoch != plan.epoch:
                    passes.aborted_epoch = plan.epoch
                    for s in pending.values():  # the rest may wait on the lost one until the collective timeout
                        handles[s].abort.remote(plan.epoch)
                if time.time() - failed_at > self._procs.settle_timeout_s:
                    for s in list(pending.values()):
                        lost.add(s)
                        self._lost(s, plan, died=False)
                    pending.clear()
                continue
            if not pending:
                break
            got = _progress(handles, pending.values(), seen)
            if got is not None:
                for step, batch, metrics in got["commits"]:
                    host.on_commit(step, batch, metrics, plan.view, run)
                seen += len(got["commits"])
                next_step = max(next_step, got["next_step"])
                passes.reached = max(passes.reached, next_step)
                passes.stats = got["snapshots"]
                if got["calls"] and not passes.calls:
                    passes.calls = got["calls"]
                if passes.calls and seen >= 2:  # every function of a step has run: rehearse the group one smaller
                    self._prepare_standby(len(plan.members))
            host.before_step(next_step)  # the drill's driver-side faults (a revive), the stall reporter
            view = host.view
            for notice in view.notices:  # a later view (a grow, another notice) no longer names the earlier leavers
                leavers.update({s: notice.deadline for s in notice.slices & view.leaving if s not in leavers})
            staying = {s for s, deadline in leavers.items() if deadline > time.time()}  # past it: gone, hung or not
            gone = {ref: s for ref, s in pending.items() if s not in view.active and s not in staying}
            if gone and view.gave_up is None:  # the supervisor dropped a member still in the pass: end the pass
                failed_at = time.time()
                dead, _ = ray.wait(list(gone), num_returns=len(gone), timeout=1.0)  # a dead process's call fails
                for ref, s in gone.items():
                    del pending[ref]
                    lost.add(s)
                    self._lost(s, plan, died=ref in dead, reason=view.reason)  # alive but silent: ended for good
                continue
            final = host.stopping is not None
            if stop is None and (view.epoch != plan.view.epoch or final):
                stop = plan.view if final else view  # the job stops: it saves on the view it runs on
                at = next_step + STOP_MARGIN_STEPS
                if at < self.config.num_steps:
                    self._acct.timeline.add("stop_requested", epoch=plan.view.epoch, before_step=at, final=final)
                    for s in pending.values():
                        handles[s].request_stop.remote(plan.epoch, at, stop, final=final)
        return self._end(plan, results, lost, seen, host, run, stop)

    def _end(
        self,
        plan: GroupPlan,
        results: dict[int, PassOutcome],
        lost: set[int],
        seen: int,
        host: PlacementHost,
        run: RunInfo,
        stop: View | None,
    ) -> PassEnd:
        passes = self._passes
        tails = sorted((r for r in results.values() if r.commits), key=lambda r: len(r.commits))
        if tails:  # the commits not read during the pass, from the member that committed the most
            for step, batch, metrics in tails[-1].commits[seen:]:
                host.on_commit(step, batch, metrics, plan.view, run)
        for s, r in results.items():
            passes.snapshots[s] = r.snapshots
            passes.reached = max(passes.reached, r.next_step)
        self._standby.ran(len(plan.members))
        errors = [r for r in results.values() if r.ending is Ending.ERROR]
        if errors:
            first = errors[0]
            trace = first.error.traceback if first.error else ""
            raise ElasticError(f"slice {first.slice}'s loop failed: {first.describe()}\n{trace}")
        self._members.gone |= lost
        failed = sorted(lost | {s for s, r in results.items() if r.ending.failed})
        if failed:
            passes.recovering = True
            passes.figures["survivors_lost"] += len(self._members.collateral(lost - self._targeted(lost)))
            if not lost and all(results[s].ending is Ending.HUNG for s in failed):
                raise runtime.StepHungError(
                    f"group {plan.epoch}'s step",
                    self.config.step_timeout_s or 0.0,
                    hint=results[failed[0]].describe()[:300],
                )
            why = "; ".join(
                f"slice {s}: " + ("worker process died" if s in lost else results[s].describe()[:120])
                for s in failed[:4]
            )
            raise runtime.SliceLostError(f"group {plan.epoch} broke ({why})", slices=tuple(failed))
        first_commits = [r for r in results.values() if r.first_commit_at]
        if passes.recovering and first_commits:
            passes.recovering = False
            passes.figures["recovery_compile_seconds"].append(
                max(r.first_step_compile_seconds or 0.0 for r in first_commits)
            )
            passes.figures.setdefault("recovery_first_step", []).append(
                {k: max((r.first_step_phases or {}).get(k) or 0.0 for r in first_commits) for k in ("to_step", "step")}
            )
        if all(r.ending is Ending.FINISHED for r in results.values()):
            passes.final = plan
            return PassEnd()
        stopped = [r for r in results.values() if r.ending is Ending.STOPPED]
        if stopped and len(stopped) == len(results):  # the job stopped at a step boundary, its state saved
            passes.final = plan
            persisted = {r.persisted for r in stopped}
            return PassEnd(
                stopped_at=max(r.next_step for r in stopped), persisted=persisted.pop() if len(persisted) == 1 else None
            )
        assert stop is not None
        return PassEnd(regroup=stop, live=True)


def _renew(handles: dict[int, Any], stop: threading.Event) -> None:
    """Tell every member the driver lives (their lease, ``pass_runner.DRIVER_LEASE_S``), from a thread of its own:
    a slow poll (an ``on_step`` callback, a busy host) must not end the pass; only this process's death does."""
    while not stop.wait(RENEW_S):
        for handle in handles.values():
            handle.renew.remote()


def _progress(handles: dict[int, Any], pending: Iterable[int], since: int) -> dict[str, Any] | None:
    """The pass's progress from the first member that answers within a second (members run in lockstep)."""
    for s in list(pending):
        try:
            return ray.get(handles[s].progress.remote(since), timeout=1.0)
        except Exception:  # noqa: BLE001 - a dead, stopped or busy worker: ask the next
            continue
    return None
