"""The controller: drives :mod:`elastic.control.transitions` and carries out each action it returns, in both modes.

One executor per action; each returns the next event (or ends the job). The executors act through the job's
:class:`~elastic.control.placement.Placement` (where the slices' devices live: this process, or a worker
process per slice) and account for what it reports. A slice-loss error or a hung step
(``runtime.StepHungError``: the step watchdog, ``config.step_timeout_s``) raised while an executor runs
becomes a ``Failed`` event; any other error ends the job as it is.

A failure's path, file by file for each mode, is in ``docs/architecture.md`` ("The failure path"): the
placement raises (or, in multi-process mode, ``placements/pass_watch.py`` maps a worker's typed ending to one
error), this module classifies it once, :mod:`elastic.control.transitions` answers, and the placement's
``prepare`` restores from the source :func:`elastic.control.sources.choose_source` picks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import ray

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.control.placement import Placement, PrepareHook
from elastic.control.report import Report, fill_report
from elastic.control.stall import StallReporter
from elastic.control.transitions import (
    Abort,
    Action,
    AwaitView,
    Boundary,
    Event,
    Failed,
    Finish,
    GiveUp,
    LoopReturned,
    Machine,
    Noted,
    NoteFailure,
    Prepare,
    Probe,
    Probed,
    Ready,
    Resumed,
    RunPass,
    Started,
    Stopped,
    ViewSeen,
    transition,
)
from elastic.control.watcher import ViewWatcher
from elastic.errors import ConfigError, ElasticError, GiveUpError, RecoveryTimeoutError
from elastic.log import get_logger
from elastic.loop import markers
from elastic.supervision.membership import View
from elastic.supervision.notices import past_deadline

__all__ = ["Controller", "JobResult", "StepCallback", "StepHook"]

StepHook = Callable[[int], None]
StepCallback = Callable[[int, dict[str, Any], Any], None]
REPORT_REPLY_S = 2.0  # how long the client waits for the supervisor's reply to a loss it reported (then: the watcher)


@dataclass(frozen=True, kw_only=True)
class JobResult:
    """What ``ElasticJob.run`` returns: the final state, the loop's return value and the run's report."""

    state: Any  # the state after the last committed step
    value: Any  # what the loop returned
    report: Report


class Controller:
    def __init__(
        self,
        *,
        config: ElasticConfig,
        placement: Placement,
        watcher: ViewWatcher,
        group: ActorGroup,
        accounting: Accounting,
        before_step: list[StepHook],
        on_step: StepCallback | None,
        during_prepare: list[PrepareHook] | None = None,
    ) -> None:
        self.config = config
        self.num_steps = config.num_steps
        self._placement = placement
        self._watcher = watcher
        self._group = group
        self._acct = accounting
        self._hooks = before_step
        self._during = list(during_prepare or ())
        self._on_step = on_step
        self._log = get_logger("elastic.controller", job=config.job_name)
        self._recovering = False
        self._result: JobResult | None = None
        self._value: Any = None
        self._failure = ("", False)  # the last recoverable failure: its cause, and whether a step hung
        self._leftovers: BaseException | None = None  # the last failure, until its frames are freed off this thread
        self._reports: list[tuple[frozenset[int], dict[int, int] | None, Any]] = []  # (slices, incarnations, reply)
        self._stopping: str | None = None  # why the job stops at the next step boundary (``request_stop``)
        self._suspending: str | None = None  # why the job is suspended at the next step boundary
        # Suspended (every slice released) before the step given: blocks until the job may resume, the slices it may
        # resume on answered (set by a pool lease, single-process mode)
        self.on_suspend: Callable[[int, View], frozenset[int]] | None = None
        self._stall = StallReporter(config.step_wait_s(first=True), log=self._log, timeline=accounting.timeline)

    # -- the driver ----------------------------------------------------------------------------
    def run(self, loop: Callable[..., Any]) -> JobResult:
        """Run ``loop`` to the last step through the state machine, re-entering it on each view change."""
        view = self._first_view()
        self._acct.timeline.add("started", slices=len(view.active), epoch=view.epoch)
        machine, event = Machine(), cast(Event, Started(view))
        self._stall.start()
        try:
            while True:
                machine, action = transition(machine, event, self.config.max_transient_retries)
                self._log.debug(
                    "transition", state=machine.state.value, action=type(action).__name__, epoch=machine.view.epoch
                )
                next_event = self._execute(machine, action, loop)
                if next_event is None:
                    assert self._result is not None
                    return self._result
                event = next_event
        finally:
            self._stall.stop()

    def _first_view(self) -> View:
        """The view to start on: every slice, once the supervisor has judged them all (a job taken over from a
        crashed client sees its agents register one by one); any slice past a short bound."""
        everything = frozenset(range(self.config.num_slices))
        try:
            return self._watcher.wait_for(
                lambda v: v.active >= everything, min(10.0, self.config.startup_timeout_s), what="every slice"
            )
        except RecoveryTimeoutError:
            return self._watcher.wait_for(lambda v: bool(v.active), self.config.startup_timeout_s, what="any slice")

    def _execute(self, machine: Machine, action: Action, loop: Callable[..., Any]) -> Event | None:
        try:
            if isinstance(action, Prepare):
                return self._prepare(action)
            if isinstance(action, RunPass):
                return self._run_pass(loop, machine.view)
        except Exception as err:
            kind = runtime.classify_failure(err)
            if kind is runtime.FailureKind.OTHER:
                raise
            self._placement.drop()
            self._leftovers = err  # its frames (the failed pass's states, the loop's locals): freed off this thread
            cause = f"{type(err).__name__}: {err}"
            self._failure = (cause, kind is runtime.FailureKind.HUNG)
            steps = self._acct.ledger.steps
            self._log.warning(
                "step_hung" if self._failure[1] else "slice_loss_error",
                epoch=machine.view.epoch,
                step=steps[-1] + 1 if steps else 0,
                state=machine.state.value,
                error=cause[:300],
            )
            return Failed(cause)
        if isinstance(action, NoteFailure):
            runtime.discard(self._leftovers)
            self._leftovers = None
            runtime.wake_releases()  # the release thread now holds the only reference: it frees them
            self._acct.failure(action.cause)
            self._recovering = True
            return Noted(self._watcher.view)
        if isinstance(action, Probe):
            return self._probe(action)
        if isinstance(action, AwaitView):
            return self._await_view(action)
        if isinstance(action, Finish):
            report = self._acct.finish(machine.view)
            fill_report(report, self._placement.figures())
            self._heartbeat_figures(report)
            self._result = JobResult(state=self._placement.final_state(), value=self._value, report=report)
            return None
        if isinstance(action, GiveUp):
            raise GiveUpError(action.reason, epoch=action.epoch)
        if isinstance(action, Abort):
            raise (ConfigError if action.kind == "early_return" else ElasticError)(action.message)
        raise AssertionError(f"no executor for {action!r}")

    # -- executors -----------------------------------------------------------------------------
    def _prepare(self, action: Prepare) -> Event:
        """Put the state on a mesh over ``action.view``: moved device to device, restored, or initialised."""
        view = action.view
        self._acct.on_view(view)
        if self._recovering or action.live:  # moving to another mesh: did the standbys cover it?
            ready = self._placement.standby_ready(view)
            self._acct.timeline.add(
                "standby_ready" if ready else "compile_on_move", epoch=view.epoch, slices=len(view.active)
            )
        if self._recovering:
            self._acct.report.recoveries += 1
            self._acct.timeline.add("detected", epoch=view.epoch, slices=len(view.active), reason=view.reason)
            self._recovering = False
        placed = self._placement.prepare(view, live=action.live, during=self._during_prepare)
        if placed.how == "moved":
            self._acct.timeline.add(
                "resharded", step=placed.step, slices=len(view.active), epoch=view.epoch, **placed.detail
            )
            if view.leaving:  # off slices on notice, at a step boundary: a planned shrink, nothing recomputed
                self._acct.left(view, placed.step)
        elif placed.how == "fresh":
            self._acct.fresh_start(placed.step)
        else:
            self._acct.restored(
                placed.meta,
                step=placed.step,
                tier=placed.tier or "memory",
                generation=placed.generation,
                view=view,
                waited_s=placed.waited_s,
                source=placed.source,
                shards_kept=placed.shards_kept,
                detail=placed.detail,
            )
            self._log.info("restored", step=placed.step, tier=placed.tier, epoch=view.epoch, slices=sorted(view.active))
        return Ready()

    def _heartbeat_figures(self, report: Report) -> None:
        """How often the supervisor saw an agent's beats late but the agent answering (kept), and how often it
        dropped a slice for silence (no beat, no answer): the false-alarm guard's figures."""
        try:
            usage = ray.get(self._group.supervisor.usage.remote(), timeout=5.0)
        except Exception:  # noqa: BLE001 - a supervisor restarting: the figures are missing, not wrong
            return
        report.extra["heartbeats_late"] = usage.get("late_beats", 0)
        report.extra["slices_dropped_silent"] = usage.get("silent_drops", 0)
        report.notices = max(report.notices, usage.get("notices", 0))  # those no view acted on too

    def _during_prepare(self, phase: str, step: int, view: View) -> None:
        """The fault-injection seam inside a move: the transfers are dispatched, not yet waited on."""
        for hook in self._during:
            hook(phase, step, view)

    def _run_pass(self, loop: Callable[..., Any], view: View) -> Event:
        steps = self._acct.ledger.steps
        self._stall.progress(steps[-1] + 1 if steps else 0)
        try:
            end = self._placement.run_pass(loop, self)
        finally:
            self._stall.idle()
        if end.stopped_at is not None:
            self._acct.stopped(at_step=end.stopped_at, persisted=end.persisted, reason=self._stopping or "")
            return Stopped(end.stopped_at)
        if end.suspended_at is not None:
            return self._suspended(end.suspended_at, end.kept, view)
        if end.regroup is not None:
            self._acct.regrouped(view, end.regroup)
            late = past_deadline(end.regroup.notices, time.time())
            if late and end.regroup.leaving & view.active:  # the slices count as gone: a failure, recovered
                self._acct.failure(f"the deadline of the notice for slice(s) {late} passed before the step boundary")
                self._recovering = True
            return Boundary(end.regroup, late=bool(late))
        self._value = end.value
        steps = self._acct.ledger.steps
        return LoopReturned(
            complete=steps[-1:] == [self.num_steps - 1],
            last_committed=steps[-1] if steps else None,
            last_step=self.num_steps - 1,
        )

    def _suspended(self, step: int, kept: int | None, view: View) -> Event:
        """The pass ended at the boundary before ``step`` to suspend the job: its state is on its keepers (``kept``);
        wait until its slices come back (``on_suspend``), then resume from the keepers on the view over them."""
        reason, self._suspending = self._suspending or "", None
        if kept is None or self.on_suspend is None:  # nothing released: the state moves on from where it is
            self._log.warning("suspend_not_saved", step=step, reason=reason)
            self._acct.timeline.add("suspend_refused", step=step, reason=reason)
            return Boundary(view)
        self._acct.timeline.add("suspended", step=step, reason=reason)
        self._log.warning("suspended", step=step, reason=reason)
        began = time.monotonic()
        lent = self.on_suspend(step, view)
        stale = view.active - lent  # slices it ran on, not lent back: left by notice
        resumed = self._watcher.wait_for(  # more may be lent meanwhile: the job grows onto them later, or now
            lambda v: v.epoch > view.epoch and lent <= v.active and not v.active & stale,
            self.config.startup_timeout_s + self.config.recovery_timeout_s,
            what=f"the view over slices {sorted(lent)} lent back",
        )
        waited = round(time.monotonic() - began, 3)
        self._acct.timeline.add("resumed", step=step, epoch=resumed.epoch, slices=len(resumed.active), waited_s=waited)
        self._acct.report.extra.setdefault("suspensions", []).append(
            {"step": step, "reason": reason, "seconds": waited, "slices": sorted(lent)}
        )
        return Resumed(resumed)

    def _probe(self, action: Probe) -> Event:
        """Which slices answer within ``step_timeout_s`` (one that does not is dead). Slices known dead before
        the others answer are reported at once: the supervisor judges them while the survivors' probes wait
        behind the step in flight on their devices."""
        self._reports = []
        dead = self._placement.probe(action.slices, self.config.step_timeout_s, early=self._report)
        attempt = self._acct.failures_in_a_row
        if not dead and attempt <= self.config.max_transient_retries:
            self._log.warning("transient_failure_retry", attempt=attempt, hung=self._failure[1])
        cause, hung = self._failure
        return Probed(dead, attempt, cause=cause, hung=hung)

    def _report(self, dead: frozenset[int]) -> None:
        """Report ``dead`` to the supervisor as lost; its reply (the view it made) is awaited in ``_await_view``."""
        incarnations, suspect = self._placement.lost(dead)
        reply = self._group.supervisor.report_lost.remote(
            sorted(dead), "client probe after a slice-loss error", incarnations=incarnations, suspect=suspect
        )
        self._reports.append((dead, incarnations, reply))

    def _await_view(self, action: AwaitView) -> Event:
        self._log.warning("slices_lost", dead=sorted(action.dead), epoch=action.after_epoch)
        reported = frozenset().union(*(r[0] for r in self._reports))
        if action.dead - reported:
            self._report(action.dead - reported)
        reports, self._reports = self._reports, []
        incarnations: dict[int, int] | None = None
        deadline = time.monotonic() + REPORT_REPLY_S
        for _, seen, reply in reports:
            if seen is not None:
                incarnations = {**(incarnations or {}), **seen}
            try:  # the supervisor answers with the view it made: no need to wait for the long poll to carry it
                self._watcher.offer(ray.get(reply, timeout=max(deadline - time.monotonic(), 0.0)))
            except Exception as err:  # noqa: BLE001 - slow or restarting: the watcher brings the view (bounded below)
                self._log.info("report_lost_unanswered", error=f"{type(err).__name__}"[:100])

        def settled(v: View) -> bool:  # each dead slice out of the view, or back in it with a new agent
            back = self._placement.replaced(action.dead & v.active, incarnations)
            return v.epoch > action.after_epoch and not (v.active & action.dead) - back

        view = self._watcher.wait_for(
            settled, self.config.recovery_timeout_s, what=f"slices {sorted(action.dead)} removed or replaced"
        )
        return ViewSeen(view)

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary the pass can reach, saving the state to the persistent tier there (from
        any thread; once: a second request keeps the first reason)."""
        if self._stopping is None:
            self._stopping = reason or "stop requested"
            self._acct.timeline.add("stop_asked", reason=self._stopping)

    def request_suspend(self, reason: str) -> None:
        """Suspend at the next step boundary (its state to its keepers, every slice released) until ``on_suspend``
        answers (from any thread; once at a time)."""
        if self._suspending is None:
            self._suspending = reason or "suspended"
            self._acct.timeline.add("suspend_asked", reason=self._suspending)

    @property
    def suspending(self) -> str | None:
        return self._suspending

    # -- what the placement calls (elastic.control.placement.PlacementHost) ----------------------
    @property
    def view(self) -> View:
        return self._watcher.view

    @property
    def stopping(self) -> str | None:
        return self._stopping

    def before_step(self, step: int) -> None:
        self._stall.progress(step)
        for hook in self._hooks:
            hook(step)

    def on_commit(self, step: int, batch: int, metrics: dict[str, Any], view: View, run: Any) -> None:
        self._acct.committed(step, batch, metrics, view)
        self._stall.progress(step)
        if self._on_step is not None:
            self._on_step(step, metrics, run)

    def snapshot_meta(self, extras: dict[str, Any]) -> dict[str, Any]:
        return self._acct.meta(extras, self.config.seed)

    def wait_for_standbys(self, timeout: float) -> bool:
        """Until the standby compiles asked for so far, and the step markers' (:mod:`elastic.loop.markers`), are
        done (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        ready = self._placement.wait_for_standbys(timeout)
        return markers.wait_warm(max(0.0, deadline - time.monotonic())) and ready
