"""The controller: wrap a training loop so it survives slice loss in the same process.

``ElasticJob.run(loop)`` calls ``loop(run)`` with the current mesh and the state restored onto it. On a
slice-loss error it probes which slices are gone, reports them to the supervisor, waits (bounded) for
a view without them, restores the newest snapshot onto a mesh of the survivors and calls the loop
again. When the supervisor publishes a larger view (a slice came back), the commit at the next step
boundary snapshots the state and the loop is re-entered on the grown mesh. The process never restarts.
"""
from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import ray
import structlog
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

import runtime
from elastic.cluster import ActorGroup, connect
from elastic.config import ElasticConfig
from elastic.errors import ConfigError, ElasticError, GiveUpError
from elastic.faults import Fault, Faults
from elastic.log import configure_logging, get_logger
from elastic.membership import View
from elastic.report import Ledger, Report, Timeline
from elastic.run import LiveState, Regroup, Run
from elastic.watcher import ViewWatcher
from elastic.tiers import TierSet
from snapshot import SnapshotError, SnapshotInfo

__all__ = ["ElasticJob", "JobResult"]

InitFn = Callable[[jax.Array], Any]
ShardingsFn = Callable[[Mesh], Any]
StepCallback = Callable[[int, dict[str, Any], Run], None]


@dataclass(frozen=True, kw_only=True)
class JobResult:
    state: Any  # the state after the last committed step
    value: Any  # what the loop returned
    report: Report


def replicate_all(abstract_state: Any) -> Callable[[Mesh], Any]:
    """Default shardings: every leaf replicated on every device (data parallel)."""
    return lambda mesh: jax.tree_util.tree_map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract_state)


class ElasticJob:
    """One elastic training job. Use as a context manager, or call ``start``/``close``.

    ``init_fn(key) -> state`` builds the initial state; ``shardings_fn(mesh)`` gives one
    ``PartitionSpec`` or sharding per state leaf (default: replicated); ``mesh_fn`` lays out the mesh
    over the healthy slices' devices. ``agent_nodes`` pins slice agents to Ray nodes.
    """

    def __init__(self, config: ElasticConfig, *, init_fn: InitFn, shardings_fn: ShardingsFn | None = None,
                 mesh_fn: runtime.MeshFn | None = None, faults: Faults | None = None,
                 agent_nodes: dict[int, str] | None = None, on_step: StepCallback | None = None,
                 ray_address: str | None = None) -> None:
        self.config = config
        self._init_fn = init_fn
        self._mesh_fn = mesh_fn
        self._faults = faults or Faults()
        self._fired: set[Fault] = set()
        self._agent_nodes = agent_nodes
        self._on_step = on_step
        self._ray_address = ray_address
        if not structlog.is_configured():  # events go to stderr unless the application set structlog up
            configure_logging()
        self._log = get_logger("elastic.job", job=config.job_name)
        self._faults.validate(num_slices=config.num_slices, num_steps=config.num_steps)
        self.topology = self._topology()
        self._abstract = jax.eval_shape(init_fn, jax.random.key(config.seed))
        self._shardings_fn = shardings_fn or replicate_all(self._abstract)
        for count in range(config.policy.min_slices, config.num_slices + 1):  # every size it may shrink to
            self._check_splits(runtime.build_mesh(self.topology.slices[:count], mesh_fn))  # bad specs fail at once
        self._tiers = TierSet(config, self.topology, self._abstract)
        self.ledger = Ledger()
        self.report = Report(slices_initial=config.num_slices, min_slices_seen=config.num_slices)
        self.timeline = Timeline()
        self._group: ActorGroup | None = None
        self._watcher: ViewWatcher | None = None
        self._ray_started = False
        self._pids: set[int] = set()
        self._failure_at: float | None = None  # when the failure being recovered from was seen
        self._failures_in_a_row = 0  # failures before a step past ``_failed_step`` commits
        self._failed_step = -1
        self._last_loss: float | None = None

    # -- set-up ----------------------------------------------------------------------------
    def _topology(self) -> runtime.Topology:
        cfg = self.config
        try:
            if cfg.simulated:
                return runtime.simulated_topology(cfg.num_slices, cfg.devices_per_slice)
            topo = runtime.topology_from_devices(devices_per_slice=cfg.devices_per_slice)
        except runtime.TopologyError as err:
            raise ConfigError(str(err)) from err
        if topo.num_slices != cfg.num_slices:
            raise ConfigError(f"found {topo.num_slices} slices of {cfg.devices_per_slice} devices, "
                              f"but num_slices={cfg.num_slices}")
        return topo

    def _shardings(self, mesh: Mesh) -> Any:
        """The state's shardings on ``mesh``, one per leaf (``ConfigError`` if the structure differs)."""
        specs = self._shardings_fn(mesh)
        try:
            runtime.check_structure(self._abstract, specs)
        except runtime.StructureError as err:
            raise ConfigError(str(err)) from err
        return runtime.as_shardings(mesh, specs)

    def _check_splits(self, mesh: Mesh) -> None:
        """``ConfigError`` naming the first state leaf that does not split over ``mesh``."""
        shardings = self._shardings(mesh)
        targets = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
        for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(self._abstract), targets, strict=True):
            try:
                sharding.shard_shape(leaf.shape)
            except ValueError as err:
                raise ConfigError(
                    f"state leaf {jax.tree_util.keystr(path)} of shape {leaf.shape} does not split over the "
                    f"mesh {dict(mesh.shape)}: {err}; pick sizes that divide every device count you may shrink to"
                ) from err

    def start(self) -> ElasticJob:
        """Connect to Ray, launch the supervisor and agents, and wait for the first view."""
        if self._group is not None:
            return self
        self._ray_started = connect(self._ray_address)
        self._group = ActorGroup(self.config, agent_nodes=self._agent_nodes)
        try:
            self._group.launch()
            self._tiers.start()
        except BaseException:
            self.close()
            raise
        self._watcher = ViewWatcher(self._group.supervisor, View(), job=self.config.job_name)
        return self

    def close(self) -> None:
        """Stop the watcher, kill the job's actors (keepers included), revive simulated slices, and stop Ray
        if started here. Only a client that dies without closing leaves its keepers for a successor."""
        self._tiers.close()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        if self.config.simulated:
            for s in self.topology.slices:
                runtime.simulated.revive_slice(s)
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False

    def __enter__(self) -> ElasticJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest_snapshot(self) -> SnapshotInfo:
        """The newest complete in-memory snapshot, once any in flight has finished (``NoSnapshotError``
        before the first)."""
        return self._tiers.latest()

    @property
    def group(self) -> ActorGroup:
        if self._group is None:
            raise ElasticError("the job is not started: use `with ElasticJob(...) as job:` or job.start()")
        return self._group

    # -- the controller loop --------------------------------------------------------------------
    def run(self, loop: Callable[[Run], Any]) -> JobResult:
        """Run ``loop`` to the last step, re-entering it on each membership change."""
        self.start()
        assert self._watcher is not None
        cfg = self.config
        view = self._watcher.wait_for(lambda v: bool(v.active), cfg.startup_timeout_s, what="any slice")
        self.timeline.add("started", slices=len(view.active), epoch=view.epoch)
        live: LiveState | None = None
        while True:
            try:
                run = self._prepare(view, live)
                live = None
                value = loop(run)
            except Regroup as regroup:
                if regroup.view.gave_up is not None:
                    raise GiveUpError(regroup.view.gave_up, epoch=regroup.view.epoch) from None
                grew = len(regroup.view.active) > len(view.active)
                self.report.grows += grew
                self.timeline.add("grow" if grew else "shrink", epoch=regroup.view.epoch,
                                  slices=len(regroup.view.active), reason=regroup.view.reason)
                view, live = regroup.view, regroup.live
                continue
            except Exception as err:
                live = None  # whatever was live may sit on lost devices: restore from the snapshot
                if not runtime.is_slice_loss(err):
                    raise
                view = self._recover(err, view)
                continue
            if self.ledger.steps[-1:] != [cfg.num_steps - 1]:
                raise ConfigError(
                    f"the loop returned before committing step {cfg.num_steps - 1} (last committed: "
                    f"{self.ledger.steps[-1] if self.ledger.steps else 'none'}): iterate run.steps to the end"
                )
            self._finish(view)
            return JobResult(state=run.state, value=value, report=self.report)

    def _prepare(self, view: View, live: LiveState | None) -> Run:
        """A run over ``view``: the live state moved device to device, else the newest snapshot restored."""
        mesh = runtime.build_mesh(self.topology.select(view.active), self._mesh_fn)
        shardings = self._shardings(mesh)
        devices = tuple(mesh.devices.flat)
        self.report.min_slices_seen = min(self.report.min_slices_seen, len(view.active))
        if live is not None:
            state = runtime.wait_ready(runtime.guarded(runtime.reshard, devices)(live.state, shardings), devices)
            self.timeline.add("resharded", step=live.next_step, slices=len(view.active), epoch=view.epoch)
            return Run(self, view=view, mesh=mesh, state=state, start_step=live.next_step, extras=live.extras)
        restored = self._tiers.restore(shardings, devices, epoch=view.epoch)
        if restored is None:  # nothing saved anywhere: a fresh start (commits so far, if any, are redone)
            self.ledger.rollback({"runs": []})
            init = runtime.guarded(jax.jit(self._init_fn, out_shardings=shardings), devices)
            state = runtime.wait_ready(init(jax.random.key(self.config.seed)), devices)
            self._save(0, state, {})
            return Run(self, view=view, mesh=mesh, state=state, start_step=0, extras={})
        self.ledger.rollback(restored.meta["ledger"])
        self._pids = set(restored.meta["pids"])
        self.report.restores.append({"step": restored.step, "tier": restored.tier, "generation": restored.generation})
        if self.report.resumed_from_tier is None and os.getpid() not in self._pids:
            self.report.resumed_from_tier = restored.tier  # a new client picking up a crashed one's job
        self._log.info("restored", step=restored.step, tier=restored.tier, epoch=view.epoch, slices=sorted(view.active))
        self.timeline.add("restored", step=restored.step, tier=restored.tier, generation=restored.generation,
                          slices=len(view.active), epoch=view.epoch)
        state = runtime.wait_ready(restored.state, devices)
        return Run(self, view=view, mesh=mesh, state=state, start_step=restored.step,
                   extras=copy.deepcopy(restored.meta["extras"]))

    def _recover(self, err: BaseException, view: View) -> View:
        """After a slice-loss error: find the dead slices, report them, wait for a view without them.

        With every slice healthy (a transient error) it retries on the same view, at most
        ``max_transient_retries`` times before a step past the failed one is committed.
        """
        assert self._watcher is not None
        self._failures_in_a_row += 1
        failed_step = self.ledger.steps[-1] + 1 if self.ledger.steps else 0
        self._failed_step = max(self._failed_step, failed_step)
        self._failure_at = self._failure_at or time.time()
        self.timeline.add("failure", error=str(err).splitlines()[0][:160])
        dead = runtime.probe_slices(self.topology.select(view.active))
        log = self._log.bind(epoch=view.epoch, dead=sorted(dead))
        if not dead:
            if self._failures_in_a_row > self.config.max_transient_retries:
                raise ElasticError(f"slice-loss errors persist with every slice healthy after "
                                   f"{self._failures_in_a_row - 1} retries; last: {err}") from err
            log.warning("transient_failure_retry", attempt=self._failures_in_a_row, error=str(err)[:200])
            self.report.recoveries += 1
            return view
        log.warning("slices_lost", error=str(err)[:200])
        self.group.supervisor.report_lost.remote(sorted(dead), str(err)[:200])
        new = self._watcher.wait_for(lambda v: v.epoch > view.epoch and not v.active & dead,
                                     self.config.recovery_timeout_s, what=f"slices {sorted(dead)} removed")
        self.report.recoveries += 1
        self.timeline.add("detected", epoch=new.epoch, slices=len(new.active), reason=new.reason)
        return new

    # -- hooks called by Run ------------------------------------------------------------------
    def _before_step(self, step: int) -> None:
        for fault in self._faults.faults:
            if fault.at_step == step and fault not in self._fired:
                self._fired.add(fault)
                self._inject(fault)

    def _inject(self, fault: Fault) -> None:
        self._log.warning("fault_injected", kind=fault.kind, slice=fault.slice, step=fault.at_step)
        self.timeline.add(f"inject_{fault.kind}", step=fault.at_step, slice=fault.slice)
        if fault.kind == "kill_client":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "transient":
            self.report.failures_injected += 1
            raise jax.errors.JaxRuntimeError(f"UNAVAILABLE: injected transient failure at step {fault.at_step}")
        assert fault.slice is not None
        slice_ = self.topology.slice(fault.slice)
        if fault.kind == "kill":
            self.report.failures_injected += 1
            self.group.kill_agent(fault.slice)
            if self.config.simulated:
                runtime.simulated.kill_slice(slice_)
        elif fault.kind == "silence":
            self.report.failures_injected += 1
            self.group.agent(fault.slice).silence.remote()
        elif fault.kind == "revive":
            if self.config.simulated:
                runtime.simulated.revive_slice(slice_)
            self.group.spawn_agent(fault.slice)

    def _on_commit(self, run: Run, step: int, state: Any, batch: int, metrics: dict[str, Any]) -> None:
        self.ledger.commit(step, batch)
        self._pids.add(os.getpid())
        if "loss" in metrics:
            self._last_loss = float(metrics["loss"])
        if self._failure_at is not None:
            self.report.recovery_seconds.append(round(time.time() - self._failure_at, 3))
            self.timeline.add("first_step", step=step, slices=len(run.view.active), epoch=run.epoch)
            self._failure_at = None
        if step >= self._failed_step:
            self._failures_in_a_row = 0
        next_step = step + 1
        saved = next_step % self.config.snapshot_every == 0 or next_step == self.config.num_steps
        if saved:
            self._save(next_step, state, run.extras)
        if self._on_step is not None:
            self._on_step(step, metrics, run)
        assert self._watcher is not None
        view = self._watcher.view
        if view.epoch != run.epoch and next_step < self.config.num_steps:
            if view.gave_up is not None:
                raise Regroup(view, None)
            if not saved:
                self._save(next_step, state, run.extras)  # the snapshot boundary: nothing is lost
            raise Regroup(view, LiveState(state=state, next_step=next_step, extras=copy.deepcopy(run.extras)))

    def _save(self, next_step: int, state: Any, extras: dict[str, Any]) -> None:
        meta = {"ledger": self.ledger.to_meta(), "extras": copy.deepcopy(extras),
                "pids": sorted(self._pids | {os.getpid()}), "seed": self.config.seed}
        self._tiers.save(next_step, state, meta)

    def _finish(self, view: View) -> None:
        r = self.report
        r.slices_final = len(view.active)
        r.client_restarts = max(len(self._pids) - 1, 0)
        r.steps_committed = len(self.ledger.steps)
        r.steps_recomputed = self.ledger.recomputed
        r.duplicate_steps = self.ledger.duplicates()
        r.skipped_steps = self.ledger.skipped(self.config.num_steps)
        r.final_loss = self._last_loss
        r.wall_seconds = round(time.time() - self.timeline.start, 3)
        self._tiers.fill(r)
        self.timeline.add("finished", steps=r.steps_committed, slices=r.slices_final)
        r.timeline = self.timeline.events

