"""The controller: drives :mod:`elastic.control.transitions` and carries out each action it returns.

One executor per action; each returns the next event (or ends the job). A slice-loss error or a hung
step (``runtime.StepHungError``: the step watchdog, ``config.step_timeout_s``) raised while an executor
runs becomes a ``Failed`` event; any other error ends the job as it is. The
controller is also the host the user's :class:`~elastic.api.run.Run` talks to, through three calls:
``before_step``, ``committed`` and ``boundary``.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

import runtime
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.config import ElasticConfig
from elastic.errors import ConfigError, ElasticError, GiveUpError
from elastic.log import get_logger
from elastic.supervision.membership import View
from elastic.control.report import Report
from elastic.api.run import LiveState, Regroup, Run
from elastic.control.stall import StallReporter
from elastic.control.tiers import SnapshotPolicy, TierSet
from elastic.control.transitions import (Abort, Action, AwaitView, Boundary, Event, Failed, Finish, GiveUp, LoopReturned,
                                 Machine, NoteFailure, Noted, Prepare, Probe, Probed, Ready, RunPass, Started,
                                 ViewSeen, transition)
from elastic.control.watcher import ViewWatcher

__all__ = ["Controller", "JobResult"]

StepHook = Callable[[int], None]
StepCallback = Callable[[int, dict[str, Any], Run], None]
PrepareHook = Callable[[str, int, View], None]  # (phase: "restore" | "reshard" | "grow", step, view)


@dataclass(frozen=True, kw_only=True)
class JobResult:
    state: Any  # the state after the last committed step
    value: Any  # what the loop returned
    report: Report


class Controller:
    def __init__(self, *, config: ElasticConfig, topology: runtime.Topology, mesh_fn: runtime.MeshFn | None,
                 shardings: Callable[[Mesh], Any], init_fn: Callable[[jax.Array], Any], tiers: TierSet,
                 watcher: ViewWatcher, group: ActorGroup, accounting: Accounting,
                 before_step: list[StepHook], on_step: StepCallback | None,
                 during_prepare: list[PrepareHook] | None = None,
                 initial_state: Callable[[Any], Any] | None = None) -> None:
        self.config = config
        self.num_steps = config.num_steps
        self.seed = config.seed
        self._topology = topology
        self._mesh_fn = mesh_fn
        self._shardings = shardings
        self._init_fn = init_fn
        self._tiers = tiers
        self._watcher = watcher
        self._group = group
        self._acct = accounting
        self._hooks = before_step
        self._during = list(during_prepare or ())
        self._initial_state = initial_state  # shardings -> the state at step 0 (None: init_fn's)
        self._active = 0  # how many slices the state was last placed on (a move onto more is a grow)
        self._on_step = on_step
        self._policy = SnapshotPolicy(every=config.snapshot_every, num_steps=config.num_steps)
        self._log = get_logger("elastic.control.controller", job=config.job_name)
        self._loop: Callable[[Run], Any] | None = None
        self._live: LiveState | None = None
        self._run: Run | None = None
        self._recovering = False
        self._snapshot_soon = False
        self._saved_for: int | None = None  # the step the newest snapshot request resumes at
        self._result: JobResult | None = None
        self._value: Any = None
        self._standby = runtime.StandbyCompiler(max_meshes=config.num_slices + 1)
        self._standby.warm(lambda: runtime.warm_probes(topology.slices))
        self._prepared_for: int | None = None  # the epoch standbys were last prepared for
        self._failure = ("", False)  # the last recoverable failure: its cause, and whether a step hung
        self._stall = StallReporter(config.step_wait_s(first=True), log=self._log, timeline=accounting.timeline)

    # -- the driver ----------------------------------------------------------------------------
    def run(self, loop: Callable[[Run], Any]) -> JobResult:
        """Run ``loop`` to the last step through the state machine, re-entering it on each view change."""
        self._loop = loop
        view = self._watcher.wait_for(lambda v: bool(v.active), self.config.startup_timeout_s, what="any slice")
        self._acct.timeline.add("started", slices=len(view.active), epoch=view.epoch)
        machine, event = Machine(), Started(view)
        self._stall.start()
        try:
            while True:
                machine, action = transition(machine, event, self.config.max_transient_retries)
                self._log.debug("transition", state=machine.state.value, action=type(action).__name__,
                                epoch=machine.view.epoch)
                next_event = self._execute(machine, action)
                if next_event is None:
                    assert self._result is not None
                    return self._result
                event = next_event
        finally:
            self._stall.stop()
            self._standby.close()
            runtime.hangs.release_all()  # no simulated hang outlives the job (no thread stays blocked)

    def _execute(self, machine: Machine, action: Action) -> Event | None:
        try:
            if isinstance(action, Prepare):
                return self._prepare(action)
            if isinstance(action, RunPass):
                return self._run_pass(machine)
        except Exception as err:  # noqa: BLE001 - only slice loss and hangs are recovered; the rest ends the job
            kind = runtime.classify_failure(err)
            if kind is runtime.FailureKind.OTHER:
                raise
            # Whatever was live may sit on lost devices (or be a hung step's results): restore from a
            # snapshot. Drop it now, so that the restore reuses its memory instead of allocating it twice.
            self._live = self._run = None
            cause = f"{type(err).__name__}: {err}"
            self._failure = (cause, kind is runtime.FailureKind.HUNG)
            steps = self._acct.ledger.steps
            self._log.warning("step_hung" if self._failure[1] else "slice_loss_error", epoch=machine.view.epoch,
                              step=steps[-1] + 1 if steps else 0, state=machine.state.value, error=cause[:300])
            return Failed(cause)
        if isinstance(action, NoteFailure):
            self._acct.failure(action.cause)
            self._recovering = True
            return Noted(self._watcher.view)
        if isinstance(action, Probe):
            return self._probe(action)
        if isinstance(action, AwaitView):
            return self._await_view(action)
        if isinstance(action, Finish):
            report = self._acct.finish(machine.view)
            self._tiers.fill(report)
            stats = self._standby.stats
            report.standby_compiles, report.standby_skipped = stats.compiled, stats.skipped
            report.standby_compile_seconds = round(stats.seconds, 3)
            assert self._run is not None
            self._result = JobResult(state=self._run.state, value=self._value, report=report)
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
        mesh = runtime.build_mesh(self._topology.select(view.active), self._mesh_fn)
        shardings = self._shardings(mesh)
        devices = tuple(mesh.devices.flat)
        self._acct.on_view(view)
        if self._recovering or action.live:  # moving to another mesh: did the standbys cover it?
            ready = self._standby.ready(mesh)
            self._acct.timeline.add("standby_ready" if ready else "standby_missing", epoch=view.epoch,
                                    slices=len(view.active))
        if self._recovering:
            self._acct.report.recoveries += 1
            self._acct.timeline.add("detected", epoch=view.epoch, slices=len(view.active), reason=view.reason)
            self._recovering = False
        live, self._live = self._live, None
        before, self._active = self._active, len(view.active)
        if action.live and live is not None:
            moved = runtime.guarded(runtime.reshard, devices)(live.state, shardings)
            self._during_prepare("grow" if len(view.active) > before else "reshard", live.next_step, view)
            state = runtime.wait_ready(moved, devices, timeout_s=self._wait_s, what=f"the move onto epoch {view.epoch}")
            self._acct.timeline.add("resharded", step=live.next_step, slices=len(view.active), epoch=view.epoch)
            self._run = Run(self, view=view, mesh=mesh, state=state, start_step=live.next_step, extras=live.extras)
            return Ready()
        restored = self._tiers.restore(shardings, devices, epoch=view.epoch)
        if restored is None:
            self._acct.fresh_start()
            if self._initial_state is not None:
                state = runtime.guarded(self._initial_state, devices)(shardings)
            else:
                init = runtime.guarded(jax.jit(self._init_fn, out_shardings=shardings), devices)
                state = init(jax.random.key(self.seed))
            state = runtime.wait_ready(state, devices, timeout_s=self._wait_s, what="the initial state")
            self._save(0, state, {})
            self._run = Run(self, view=view, mesh=mesh, state=state, start_step=0, extras={})
            return Ready()
        self._during_prepare("restore", restored.step, view)
        state = runtime.wait_ready(restored.state, devices, timeout_s=self._wait_s,  # the copies have landed
                                   what=f"the restore of step {restored.step}")
        self._acct.restored(restored.meta, step=restored.step, tier=restored.tier, generation=restored.generation,
                            view=view, waited_s=round(self._tiers.last_wait_seconds, 3), source=restored.source,
                            shards_kept=restored.shards_kept)
        self._log.info("restored", step=restored.step, tier=restored.tier, epoch=view.epoch, slices=sorted(view.active))
        extras = copy.deepcopy(restored.meta["extras"])
        # The restored generation lost its copies on the dead slices: snapshot again at the first commit
        # (after the first step, off its path), so every piece regains its copies on the survivors.
        self._snapshot_soon = True
        self._run = Run(self, view=view, mesh=mesh, state=state, start_step=restored.step, extras=extras)
        return Ready()

    def _during_prepare(self, phase: str, step: int, view: View) -> None:
        """The fault-injection seam inside a move: the transfers are dispatched, not yet waited on."""
        for hook in self._during:
            hook(phase, step, view)

    def _run_pass(self, machine: Machine) -> Event:
        assert self._run is not None and self._loop is not None
        self._stall.progress(self._run.start_step)
        try:
            self._value = self._loop(self._run)
        except Regroup as regroup:
            self._acct.regrouped(machine.view, regroup.view)
            self._live = regroup.live
            return Boundary(regroup.view)
        finally:
            self._stall.idle()
        steps = self._acct.ledger.steps
        return LoopReturned(complete=steps[-1:] == [self.num_steps - 1], last_committed=steps[-1] if steps else None,
                            last_step=self.num_steps - 1)

    def _probe(self, action: Probe) -> Event:
        """Which slices answer a tiny computation within ``step_timeout_s`` (one that does not is dead)."""
        slices = self._topology.select(action.slices)
        dead = frozenset(runtime.probe_slices(slices, timeout_s=self.config.step_timeout_s))
        attempt = self._acct.failures_in_a_row
        if not dead and attempt <= self.config.max_transient_retries:
            self._log.warning("transient_failure_retry", attempt=attempt, hung=self._failure[1])
        cause, hung = self._failure
        return Probed(dead, attempt, cause=cause, hung=hung)

    def _await_view(self, action: AwaitView) -> Event:
        self._log.warning("slices_lost", dead=sorted(action.dead), epoch=action.after_epoch)
        self._group.supervisor.report_lost.remote(sorted(action.dead), "client probe after a slice-loss error",
                                                  self._group.token)
        view = self._watcher.wait_for(lambda v: v.epoch > action.after_epoch and not v.active & action.dead,
                                      self.config.recovery_timeout_s, what=f"slices {sorted(action.dead)} removed")
        return ViewSeen(view)

    @property
    def _wait_s(self) -> float | None:
        """The bound on moving, restoring or initialising the state (as long as a pass's first step)."""
        return self.config.step_wait_s(first=True)

    # -- what Run calls ------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        self._stall.progress(step)
        for hook in self._hooks:
            hook(step)

    def wait_for_standbys(self, timeout: float) -> bool:
        """Until the standby compiles asked for so far are done (tests and benchmarks)."""
        return self._standby.wait(timeout)

    def record_call(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh) -> None:
        self._standby.record(fn, args, mesh)

    def committed(self, run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None:
        self._acct.committed(step, batch, metrics, run.view)
        self._stall.progress(step)
        if self._prepared_for != run.epoch:  # the first step on this mesh ran: compile where we may go next
            self._prepared_for = run.epoch
            self._standby.prepare(self._next_meshes(run.view))
        if self._policy.due(step + 1) or self._snapshot_soon:
            self._snapshot_soon = False
            self._save(step + 1, state, run.extras)
        if self._on_step is not None:
            self._on_step(step, metrics, run)

    def boundary(self, run: Run, next_step: int) -> Regroup | None:
        """Before ``next_step`` starts: a ``Regroup`` when the supervisor's view has changed."""
        view = self._watcher.view
        if view.epoch == run.epoch:
            return None
        if view.gave_up is not None:
            return Regroup(view, None)
        if self._saved_for != next_step:  # committed() has not saved this boundary already
            self._save(next_step, run.state, run.extras)  # the snapshot boundary: nothing is lost
        return Regroup(view, LiveState(state=run.state, next_step=next_step, extras=copy.deepcopy(run.extras)))

    def _next_meshes(self, view: View) -> list[Mesh]:
        """Every mesh one slice loss away (while at least ``min_slices`` remain), then the grow-back mesh."""
        active = sorted(view.active)
        sets = [frozenset(active) - {s} for s in active if len(active) - 1 >= self.config.policy.min_slices]
        everything = frozenset(self._topology.indices)
        if everything != view.active:
            sets.append(everything)
        return [runtime.build_mesh(self._topology.select(s), self._mesh_fn) for s in sets]

    def _save(self, next_step: int, state: Any, extras: dict[str, Any]) -> None:
        self._saved_for = next_step
        self._tiers.save(next_step, state, self._acct.meta(copy.deepcopy(extras), self.seed))
