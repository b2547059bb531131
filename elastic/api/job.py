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
from elastic.api.pool_lease import PoolLease
from elastic.config import ElasticConfig, check_batch_splits
from elastic.control import orbax_io
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup, connect
from elastic.control.controller import Controller, JobResult, StepCallback
from elastic.control.hooks import DriverHook, FaultPlan, JobHandles
from elastic.control.job_events import ClientEvents
from elastic.control.metrics import JobMetrics
from elastic.control.placement import JobMode, Placement
from elastic.control.report import Ledger, Report, Timeline
from elastic.control.stop_signal import StopOnSignal, check_signal
from elastic.control.tokens import job_token
from elastic.control.watcher import ViewWatcher, supervisor_lost_after_s
from elastic.errors import ConfigError, ElasticError, NoticeError
from elastic.log import configure_logging, get_logger
from elastic.loop.run import Run
from elastic.loop.shardings import replicate_all, state_shardings
from elastic.placements.modes import JobParts, for_job
from elastic.snapshot import SnapshotInfo
from elastic.supervision import events
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
    ``stop_signal`` (e.g. ``"SIGTERM"``): while ``run`` runs, that signal to this process is :meth:`stop` (a later
    one ends the process); None (the default) leaves the signal's handling alone.
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
        stop_signal: str | None = None,
    ) -> None:
        if not isinstance(config, ElasticConfig):
            raise ConfigError(f"config must be an elastic.ElasticConfig, got {type(config).__name__}")
        for name, fn in (("init_fn", init_fn), ("shardings_fn", shardings_fn), ("mesh_fn", mesh_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be a callable, got {fn!r}")
        self.config = config
        self._stop_signal = check_signal(stop_signal)
        self._stop_reason: str | None = None
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
        self._mode: JobMode = for_job(
            JobParts(
                config=config,
                init_fn=init_fn,
                abstract=self._abstract,
                shardings_fn=self._shardings_fn,
                mesh_fn=mesh_fn,
                init_from=self._init_from,
                init_step=self.init_step,
                faults=faults,
                cache_dir=self._cache_dir,
            )
        )
        self.topology = self._mode.topology
        self._mode.check_meshes()  # bad specs fail at once, for every size the job may shrink to
        self._placement: Placement | None = None
        self._acct = Accounting(num_slices=config.num_slices, num_steps=config.num_steps)
        self._group: ActorGroup | None = None
        self._watcher: ViewWatcher | None = None
        self._ray_started = False
        self._pool: PoolLease | None = None  # with config.pool: the job's lease of its slices
        self.controller: Controller | None = None  # the controller of the current (or last) run

    # -- set-up ----------------------------------------------------------------------------
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

    def start(self) -> ElasticJob:
        """Connect to Ray, launch the supervisor and agents, and wait for the first view."""
        if self._group is not None:
            return self
        self._ray_started = connect(self._ray_address)
        # Ray metrics (elastic.control.metrics): always on once connected to Ray, cheap per step, never raise
        JobMetrics(self.config.job_name, snapshot_stats=self._snapshot_stats).attach(self._acct)
        try:
            if self.config.pool is not None:  # the pool lends the job its slices first (bounded, PoolError says why)
                self._pool = PoolLease(
                    self.config,
                    notice=lambda slices, deadline_s, why: self.notice(slices, deadline_s, why, source="pool"),
                    spawn=lambda index: self.group.spawn_agent(index),  # a new agent: the job grows onto it
                    extra=self._acct.report.extra,
                )
                self._pool.join()
            token = job_token(self.config)  # before the workers, whose spec carries the keepers' credential
            agents = self._mode.agents(token)
            self._group = ActorGroup(self.config, agent_nodes=self._agent_nodes, agents=agents, token=token)
            # The keepers' processes start while the agents do, and only once the job is this client's: a client
            # refused at launch never touches (nor, closing, kills) another client's keepers.
            self._group.launch(owned=self._start_tiers, slices=self._pool.launch_slices if self._pool else None)
            self._mode.ready()
        except BaseException:  # what start opened is closed before the error goes on
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
        if self._pool is not None:
            self._acct.commit_sinks.append(self._pool.committed)
            self._pool.start()  # the slices not lent are left before the first step
        return self

    def _start_tiers(self) -> None:
        """Ask for the job's keepers (and persistent tier) without waiting for them (the mode's)."""
        assert self._group is not None
        self._mode.start_tiers(self._group, self._acct)

    def _snapshot_stats(self) -> dict[str, Any]:
        if self._placement is not None:
            return self._placement.snapshot_stats()
        return self._mode.snapshot_stats()  # before the first run

    def _last_completed(self) -> tuple[int, str] | None:
        return self._mode.last_completed()

    def close(self) -> None:
        """Stop the watcher, kill the job's actors (keepers included), revive simulated slices, and stop Ray
        if started here. Only a client that dies without closing leaves its keepers for a successor."""
        if self._pool is not None:  # every slice back to the pool
            self._pool.close()
            self._pool = None
        self._mode.close()
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
        self._mode.release(owned=ours)
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
        before the first). Single-process mode (``ElasticError`` in multi-process mode)."""
        return self._mode.latest_snapshot()

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

    def stop(self, reason: str = "stop requested") -> None:
        """Stop at the next step boundary the job can reach: the state there is saved to the persistent tier
        (``Tiers.persistent_dir``; whatever ``persistent_every`` says) and ``run`` returns, its report's ``stopped``
        saying the step (a job started again from that tier resumes there, nothing recomputed). From any thread."""
        self._stop_reason = reason
        if self.controller is not None:
            self.controller.request_stop(reason)

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
            multi=self._mode.multi,
            group=lambda: self.group,
            accounting=self._acct,
            watcher=lambda: self._watcher,
            snapshots=self._mode.snapshots,
            keepers=self._mode.keepers,
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
        if self._pool is not None:  # a pool that takes every slice suspends the job (single-process mode)
            self._pool.attach(controller)
        if self._stop_reason is not None:  # asked before the run began
            controller.request_stop(self._stop_reason)
        try:
            with StopOnSignal(self._stop_signal, self.stop, self._log):
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

    def _new_placement(self) -> Placement:
        """A placement for one run (the mode's)."""
        return self._mode.placement(group=lambda: self.group, accounting=self._acct)

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
