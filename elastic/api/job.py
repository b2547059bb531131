"""The public face of a job: ``ElasticJob(config, init_fn=...)`` and ``job.run(loop)``.

It checks the configuration and the state's shardings at construction (bad input fails at once),
connects to Ray, launches the supervisor and agents, and hands the loop to the
:class:`~elastic.control.controller.Controller`, whose state machine carries the job through failures in the
same process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import ray
import structlog
from jax.sharding import Mesh

from elastic import runtime
from elastic.config import ElasticConfig, check_batch_splits
from elastic.control import orbax_io
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup, connect
from elastic.control.controller import Controller, JobResult, StepCallback
from elastic.control.hooks import DriverHook, FaultPlan, JobHandles
from elastic.control.job_events import ClientEvents
from elastic.control.metrics import JobMetrics
from elastic.control.report import Ledger, Report, Timeline
from elastic.control.tiers import TierSet
from elastic.control.tokens import job_token
from elastic.control.watcher import ViewWatcher, supervisor_lost_after_s
from elastic.errors import ConfigError, ElasticError, NoticeError
from elastic.log import configure_logging, get_logger
from elastic.loop.run import Run
from elastic.loop.shardings import check_splits, replicate_all, state_shardings
from elastic.placements.local import LocalPlacement
from elastic.snapshot import SnapshotInfo
from elastic.supervision import events
from elastic.supervision.credential import derive
from elastic.supervision.events import EventStream
from elastic.supervision.membership import View
from elastic.supervision.notices import Notice, make_notice

__all__ = ["ElasticJob", "FaultPlan", "JobResult", "RECORD_DIR_ENV"]

RECORD_DIR_ENV = "ELASTIC_RECORD_DIR"  # where jobs write their run record when record_dir is not given

InitFn = Callable[[jax.Array], Any]


ShardingsFn = Callable[[Mesh], Any]


def _use_compilation_cache(job_name: str) -> str:
    """Turn on JAX's persistent compilation cache in a job-scoped directory (unless the application set
    one), so that a client restarted on this machine recompiles nothing it compiled before. JAX reads the
    setting once per process: the first job of a process names the directory. Returns the directory (the
    workers of a multi-process job and its standby group share it)."""
    if jax.config.jax_compilation_cache_dir:
        return str(jax.config.jax_compilation_cache_dir)
    from elastic.control.private import private_temp

    directory = str(private_temp("jax-cache", job_name))  # 0700, this user's: not a path another could plant
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


class ElasticJob:
    """One elastic training job. Use as a context manager, or call ``start``/``close``.

    ``init_fn(key) -> state`` builds the initial state; ``shardings_fn(mesh)`` gives one
    ``PartitionSpec`` or sharding per state leaf (default: replicated); ``mesh_fn`` lays out the mesh
    over the healthy slices' devices. ``agent_nodes`` pins slice agents to Ray nodes. ``microbatched``:
    the loop splits a batch that does not divide over the devices into micro-batches (as ``Trainer`` with
    ``optax_step`` does), so ``config.global_batch_size`` need not divide every device count.
    ``init_from``: an Orbax checkpoint whose state replaces ``init_fn``'s at step 0; ``save_final_to``: a new
    directory the final state is written to with Orbax at the end (see :mod:`elastic.control.orbax_io`).
    ``record_dir`` (default ``$ELASTIC_RECORD_DIR``): at close, the run's event stream and report are written
    to ``<record_dir>/<job_name>/<run>/`` (the stream itself lives in Ray's GCS, see :mod:`elastic.supervision.events`).
    """

    def __init__(
        self,
        config: ElasticConfig,
        *,
        init_fn: InitFn,
        shardings_fn: ShardingsFn | None = None,
        mesh_fn: runtime.MeshFn | None = None,
        faults: FaultPlan | None = None,
        agent_nodes: dict[int, str] | None = None,
        on_step: StepCallback | None = None,
        ray_address: str | None = None,
        microbatched: bool = False,
        init_from: str | os.PathLike | None = None,
        save_final_to: str | os.PathLike | None = None,
        record_dir: str | os.PathLike | None = None,
    ) -> None:
        if not isinstance(config, ElasticConfig):
            raise ConfigError(f"config must be an elastic.ElasticConfig, got {type(config).__name__}")
        for name, fn in (("init_fn", init_fn), ("shardings_fn", shardings_fn), ("mesh_fn", mesh_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be a callable, got {fn!r}")
        self.config = config
        self._init_fn = init_fn
        self._mesh_fn = mesh_fn
        self._faults = faults
        self._agent_nodes = agent_nodes
        self._on_step = on_step
        self._ray_address = ray_address
        # Fault-injection seam (elastic.chaos.catalogue): callables (phase, step, view) run inside each restore
        # ("restore")
        # and live move ("reshard", "grow"), once its transfers are dispatched and before they are waited on.
        self.during_prepare: list[Callable[[str, int, View], None]] = []
        if not structlog.is_configured():  # events go to stderr unless the application set structlog up
            configure_logging()
        self._log = get_logger("elastic.api.job", job=config.job_name)
        if faults is not None:
            faults.validate(num_slices=config.num_slices, num_steps=config.num_steps)
        if config.global_batch_size is not None and not microbatched:  # a shrink must not strand the batch
            check_batch_splits(config.global_batch_size, config, what="global_batch_size: a batch")
        self._cache_dir = _use_compilation_cache(config.job_name)
        self._multi = config.processes is not None
        self.topology = self._topology()
        self._abstract = jax.eval_shape(init_fn, jax.random.key(config.seed))
        if not jax.tree_util.tree_leaves(self._abstract):
            raise ConfigError(
                f"init_fn(key) returned a state with no array leaves ({self._abstract!r}): return "
                "the state to train, a pytree of arrays (e.g. a dict of parameters)"
            )
        self._init_from, self.init_step = None, 0
        if init_from is not None:  # read at the first fresh start; its tree is checked now
            self._init_from, found = orbax_io.resolve(init_from)
            orbax_io.check_matches(self._init_from, self._abstract)
            self.init_step = found or 0  # a CheckpointManager's step S: the job continues at step S
            if self.init_step >= config.num_steps:
                raise ConfigError(
                    f"init_from={str(init_from)!r} is the checkpoint of step {self.init_step}: the run "
                    f"continues from there, so num_steps ({config.num_steps}) must exceed it (num_steps "
                    "counts from step 0, as the checkpoint's run did)"
                )
        self._save_final_to = None if save_final_to is None else orbax_io.check_new_directory(save_final_to)
        self._record_dir = record_dir or os.environ.get(RECORD_DIR_ENV) or None
        self._client_events: ClientEvents | None = None
        self._shardings_fn = shardings_fn or replicate_all(self._abstract)
        for count in range(config.policy.min_slices, config.num_slices + 1):  # every size it may shrink to
            if self._multi:
                self._check_splits_abstract(count)
                continue
            try:
                mesh = runtime.build_mesh(self.topology.slices[:count], mesh_fn)
            except ValueError as err:
                raise ConfigError(f"mesh_fn over {count} slice(s): {err}") from err
            self._check_splits(mesh)  # bad specs fail at once
        self._tiers = None if self._multi else TierSet(config, self.topology, self._abstract)
        self._keepers: Any = None  # multi-process mode: the job's keeper actors (the workers push to them)
        self._placement: Any = None
        self._acct = Accounting(num_slices=config.num_slices, num_steps=config.num_steps)
        self._group: ActorGroup | None = None
        self._watcher: ViewWatcher | None = None
        self._ray_started = False
        self.controller: Controller | None = None  # the controller of the current (or last) run

    # -- set-up ----------------------------------------------------------------------------
    def _topology(self) -> runtime.Topology:
        cfg = self.config
        if self._multi:  # the slices' devices live in the workers: this process only names them
            return runtime.Topology(
                slices=tuple(
                    runtime.Slice(index=i, devices=tuple(range(cfg.devices_per_slice))) for i in range(cfg.num_slices)
                )
            )
        try:
            if cfg.simulated:
                return runtime.simulated_topology(cfg.num_slices, cfg.devices_per_slice)
            return runtime.device_topology(cfg.num_slices, cfg.devices_per_slice)
        except runtime.TopologyError as err:
            raise ConfigError(str(err)) from err

    def shardings(self, mesh: Mesh) -> Any:
        """The state's shardings on ``mesh``, one per leaf (``ConfigError`` when a spec does not fit)."""
        return state_shardings(self._abstract, self._shardings_fn, mesh)

    @property
    def init_fn(self) -> Callable[[Any], Any]:
        """The ``init_fn`` the job was built with (a reference run initialises as the job does)."""
        return self._init_fn

    @property
    def mesh_fn(self) -> Callable[..., Any] | None:
        """The ``mesh_fn`` the job was built with (None: the default mesh)."""
        return self._mesh_fn

    @property
    def shardings_fn(self) -> Callable[..., Any]:
        """The state's shardings function (the default replicates every leaf)."""
        return self._shardings_fn

    def _check_splits(self, mesh: Mesh) -> None:
        """``ConfigError`` naming the first state leaf that does not split over ``mesh``."""
        check_splits(self._abstract, self._shardings_fn, mesh)

    def _check_splits_abstract(self, count: int) -> None:
        """Multi-process mode: the same check on the default mesh of ``count`` slices, without its devices (a
        ``mesh_fn`` needs the devices: its meshes are checked by the workers as they form)."""
        if self._mesh_fn is not None:
            return
        mesh = jax.sharding.AbstractMesh(
            (count, self.config.devices_per_slice), (runtime.REPLICA_AXIS, runtime.LOCAL_AXIS)
        )
        try:
            check_splits(self._abstract, self._shardings_fn, mesh)  # type: ignore[arg-type]
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a shardings_fn that needs real devices: the workers check it
            pass

    def start(self) -> ElasticJob:
        """Connect to Ray, launch the supervisor and agents, and wait for the first view."""
        if self._group is not None:
            return self
        self._ray_started = connect(self._ray_address)
        # Ray metrics (elastic.control.metrics): always on once connected to Ray, cheap per step, never raise
        JobMetrics(self.config.job_name, snapshot_stats=self._snapshot_stats).attach(self._acct)
        agents = None
        token = job_token(self.config)  # before the workers, whose spec carries the keepers' credential
        if self._multi:
            from elastic.placements.processes import WorkerProcesses

            agents = self._worker_processes = WorkerProcesses(self.config, self._worker_spec(token))
            try:
                agents.check_fits()
            except ConfigError:
                self.close()
                raise
        self._group = ActorGroup(self.config, agent_nodes=self._agent_nodes, agents=agents, token=token)
        try:
            # The keepers' processes start while the agents do, and only once the job is this client's: a client
            # refused at launch never touches (nor, closing, kills) another client's keepers.
            self._group.launch(owned=self._start_keepers)
            if self._tiers is not None:
                self._tiers.ready()
            if self._keepers is not None:
                self._keepers.ready()
        except BaseException:
            self.close()
            raise
        if self._client_events is None:  # this client's share of the job's event stream
            stream = EventStream(
                self.config.job_name, self._group.run, f"client-{os.getpid()}", key=self._group.stream_key
            )
            self._client_events = ClientEvents(stream, self._last_completed).attach(self._acct)
        self._watcher = ViewWatcher(
            self._group.supervisor, View(), job=self.config.job_name, lost_after_s=supervisor_lost_after_s(self.config)
        )
        return self

    def _start_keepers(self) -> None:
        """Ask for the job's keepers (and persistent tier) without waiting for them: single-process mode's through
        its tiers, multi-process mode's attached (a taken-over job's) or created for the workers to push to."""
        assert self._group is not None
        if self._tiers is not None:
            self._tiers.on_event = self._acct.timeline.add
            self._tiers.start(token=self._group.token, wait=False)
        elif self.config.tiers.keeper_every:
            from elastic.snapshot.keeper import KeeperTier, keepers_for

            keeper, actors = derive(self._group.token, "keeper"), self._group.actors
            self._keepers = KeeperTier.attach(
                self.config.namespace, adopt=actors.find, credential=keeper
            ) or KeeperTier(
                self.config.namespace,
                num_keepers=keepers_for(self.config.tiers.keepers),
                keep=1,
                credential=keeper,
                adopt=actors.find,
                created=actors.record,
            ).start(wait=False)

    def _snapshot_stats(self) -> dict[str, Any]:
        if self._placement is not None:
            return self._placement.snapshot_stats()
        if self._tiers is not None:  # before the first run
            return self._tiers.snapshot_stats()
        return {"blocking_seconds": 0.0, "snapshots_taken": 0, "held_bytes": 0}

    def _last_completed(self) -> tuple[int, str] | None:
        return self._tiers.last_completed if self._tiers is not None else None

    def _worker_spec(self, token: str) -> Any:
        from elastic.placements.worker import WorkerSpec

        hooks = self._faults.worker_hooks() if self._faults is not None and len(self._faults) else ()
        return WorkerSpec(
            config=self.config,
            init_fn=self._init_fn,
            shardings_fn=self._shardings_fn,
            mesh_fn=self._mesh_fn,
            init_from=None if self._init_from is None else str(self._init_from),
            init_step=self.init_step,
            step_hooks=tuple(hooks),
            cache_dir=self._cache_dir,
            keepers=bool(self.config.tiers.keeper_every),
            keeper_credential=derive(token, "keeper"),
            identity_key=derive(token, "identity"),
        )

    def close(self) -> None:
        """Stop the watcher, kill the job's actors (keepers included), revive simulated slices, and stop Ray
        if started here. Only a client that dies without closing leaves its keepers for a successor."""
        if self._tiers is not None:
            self._tiers.close()
        if self._keepers is not None:
            self._keepers.close(kill=True)
            self._keepers = None
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._client_events is not None:
            self._client_events.flush()
        ours = self._group is None or self._group.owns_job  # a client refused at launch leaves the job alone
        if self._group is not None:
            self._group.shutdown()
            self._record()
            self._group = None
        if self.config.simulated and not self._multi and ours:
            for s in self.topology.slices:
                runtime.simulated.revive_slice(s)
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False

    def _record(self) -> None:
        """With ``record_dir`` (or ``ELASTIC_RECORD_DIR``): write the run's event stream and report to
        ``<record_dir>/<job>/<run>/``, for ``elastic report``/``events`` once the cluster is gone."""
        if self._record_dir is None or self._group is None or self._group.run is None:
            return
        try:
            from elastic.control.private import private_dir

            records, _ = events.verify(events.read(self.config.job_name, self._group.run), self._group.stream_key)
            where = private_dir(Path(self._record_dir) / self.config.job_name) / self._group.run  # 0700: this user's
            events.dump(records, where, report=self.report.to_dict())
        except Exception as err:  # noqa: BLE001 - a record is a convenience: the job's result stands
            self._log.warning("record_failed", error=repr(err))

    def __enter__(self) -> ElasticJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest_snapshot(self) -> SnapshotInfo:
        """The newest complete in-memory snapshot, once any in flight has finished (``NoSnapshotError``
        before the first). Single-process mode."""
        if self._tiers is None:
            raise ElasticError(
                "latest_snapshot() reads the single-process snapshotter; in multi-process mode each "
                "worker holds its own (see the report's snapshot figures)"
            )
        return self._tiers.latest()

    def notice(self, slices: Iterable[int] | int, deadline_s: float, reason: str, source: str = "api") -> Notice:
        """Slice(s) ``slices`` will go within ``deadline_s`` seconds, for ``reason`` (a scheduler's warning): the job
        leaves them at the next step boundary, its live state moved onto the rest, nothing recomputed, no failure
        counted; past the deadline, or if they die first, the failure path takes over. Callable from any thread
        while ``run`` runs (a timer, a signal handler's thread, a scheduler's callback). Returns the notice taken.
        ``NoticeError`` (one line; the job unharmed) for a slice the job does not hold, a deadline already past, or
        a job not started. Both modes: in multi-process mode the leaving slice's worker process ends (exit code 0)
        once the rest have re-formed."""
        notice = make_notice(slices, deadline_s, reason, source)
        if self._group is None:
            raise NoticeError("notice refused: the job is not started (call it while job.run runs)")
        try:
            view = ray.get(self._group.supervisor.notice.remote(notice), timeout=self.config.startup_timeout_s)
        except NoticeError as err:  # the supervisor's refusal (raised through Ray, as a subclass of it)
            raise NoticeError(str(getattr(err, "cause", None) or err).splitlines()[0]) from None
        except Exception as err:
            raise NoticeError(f"notice not delivered: {type(err).__name__}: {str(err).splitlines()[0][:200]}") from err
        if self._watcher is not None:
            self._watcher.offer(view)  # the loop sees the view at its next step boundary, not the next long poll
        self._log.warning("notice_taken", slices=sorted(notice.slices), source=source, epoch=view.epoch)
        return notice

    @property
    def group(self) -> ActorGroup:
        """The job's Ray actors (supervisor, agents); raises ``ElasticError`` before the job is started."""
        if self._group is None:
            raise ElasticError("the job is not started: use `with ElasticJob(...) as job:` or job.start()")
        return self._group

    @property
    def handles(self) -> JobHandles:
        """The handles a fault plan acts through (a drill, a chaos run): the job's own parts, named."""
        return JobHandles(
            job=self.config.job_name,
            topology=self.topology,
            simulated=self.config.simulated,
            multi=self._multi,
            group=lambda: self.group,
            accounting=self._acct,
            watcher=lambda: self._watcher,
            snapshots=lambda: None if self._tiers is None else self._tiers.snapshots,
            keepers=lambda: self._keepers,
        )

    # -- running ---------------------------------------------------------------------------------
    def run(self, loop: Callable[[Run], Any]) -> JobResult:
        """Run ``loop`` to the last step, re-entering it on each membership change."""
        self.start()
        assert self._watcher is not None
        hooks: list[DriverHook] = []
        if self._faults is not None and len(self._faults):
            hooks.append(self._faults.injector(self.handles))
        self._placement = placement = self._new_placement()
        self.controller = controller = Controller(
            config=self.config,
            placement=placement,
            watcher=self._watcher,
            group=self.group,
            accounting=self._acct,
            before_step=hooks,
            on_step=self._on_step,
            during_prepare=self.during_prepare,
        )
        try:
            result = controller.run(loop)
            if self._save_final_to is not None:
                placement.save_final(str(self._save_final_to))
                self._acct.timeline.add("saved_final", step=self.config.num_steps, path=str(self._save_final_to))
                self._log.info("saved_final", path=str(self._save_final_to))
        finally:
            for hook in hooks:  # an injector's agent kills still under way end with the run
                hook.settle()
            placement.close()
            if self._client_events is not None:
                self._client_events.flush()  # the run's records are in the stream when run returns
        return result

    def _new_placement(self) -> Any:
        if not self._multi:
            assert self._tiers is not None
            return LocalPlacement(
                self.config,
                topology=self.topology,
                mesh_fn=self._mesh_fn,
                shardings=self.shardings,
                init_fn=self._init_fn,
                tiers=self._tiers,
                initial_state=self._initial_state,
                init_step=self.init_step,
            )
        from elastic.placements.processes import ProcessPlacement

        return ProcessPlacement(
            self.config,
            spec=self._worker_processes.spec,
            group=lambda: self.group,
            accounting=self._acct,
            keepers=lambda: self._keepers,
            cache_dir=self._cache_dir,
            factory=self._worker_processes,
        )

    @property
    def _initial_state(self) -> Callable[[Any], Any] | None:
        """``init_from``'s reader: the checkpoint's state on the given shardings (None: ``init_fn``)."""
        path = self._init_from
        if path is None:
            return None
        return lambda shardings: orbax_io.restore_onto(path, self._abstract, shardings)

    @property
    def ledger(self) -> Ledger:
        """The committed steps, as ranges, with the batches each consumed."""
        return self._acct.ledger

    @property
    def report(self) -> Report:
        """The run's report so far (recoveries, restores, snapshot figures); final once ``run`` returns."""
        return self._acct.report

    @property
    def timeline(self) -> Timeline:
        """The run's events in order (failure, detection, restore, first step, grow, ...)."""
        return self._acct.timeline
