"""A slice's process in multi-process mode: one Ray actor per slice, on the slice's host.

It is two things at once. It is the slice's *agent*: it registers with the job's supervisor, heartbeats from
a thread of its own, and its death (its process killed, its node gone) fails the supervisor's lifeline call at
once, so the supervisor sees a lost worker the way it sees any lost agent. And it runs the user's loop SPMD
with its peers: the driver (:mod:`elastic.placements.processes`) hands every member of a group a
:class:`GroupPlan`; :meth:`SliceWorker.prepare` joins the group's ``jax.distributed`` runtime in place (the
previous group left, same process), builds the mesh over every member's devices, and restores the state
(:mod:`elastic.placements.restore`); :meth:`SliceWorker.run_pass` runs the loop with the same
:class:`~elastic.loop.run.Run` as single-process mode, its host a :class:`~elastic.loop.host.PassHost`
whose snapshots go to this worker's :class:`~elastic.placements.holdings.Holdings` (the buddy copy in the next
member's process, keeper parts, Orbax checkpoints written by every worker). A collective broken by a dead peer
(:func:`runtime.distributed.is_peer_loss`) ends the pass with status ``failed``; the worker waits for the next
plan. The actor is threaded: the driver's polls, stop requests and the peers' buddy copies are served while
the loop runs on its own thread.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import ray

from elastic import priority, runtime
from elastic.config import ElasticConfig
from elastic.control.hooks import StepContext, WorkerHook
from elastic.control.report import Ledger
from elastic.log import get_logger
from elastic.loop.host import PassHost
from elastic.loop.run import Regroup, Run
from elastic.loop.shardings import replicate_all, state_shardings
from elastic.placements.group_tiers import GroupTiers
from elastic.placements.holdings import Holdings
from elastic.placements.restore import Layout, covers, layout_of, restore_state
from elastic.placements.signal_notice import SignalNotice
from elastic.runtime import distributed
from elastic.snapshot.gated import gated_actor
from elastic.supervision.agent import check_control
from elastic.supervision.membership import View

__all__ = ["GroupPlan", "SliceWorker", "WorkerSpec"]

FETCH_TIMEOUT_S = 30.0
DEPART_EXIT_S = 0.5  # a departing worker's reply goes out before its process ends
DRIVER_LEASE_S = 5.0  # a pass stops when the driver has not read its progress for this long (the driver died)


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What every worker of a job is built with: the job's configuration and the user's functions (pickled to
    each worker once), the worker-side faults of a drill, and where compiled executables are cached."""

    config: ElasticConfig
    init_fn: Callable[[jax.Array], Any]
    shardings_fn: Callable[..., Any] | None = None
    mesh_fn: runtime.MeshFn | None = None
    init_from: str | None = None  # an Orbax checkpoint whose state replaces init_fn's at step ``init_step``
    init_step: int = 0  # where a fresh start begins (the checkpoint's step: the run continues there)
    step_hooks: tuple[WorkerHook, ...] = ()  # run in the worker as each step starts (a drill's faults)
    cache_dir: str | None = None  # JAX's persistent compilation cache, shared with the standby group
    keepers: bool = False  # the job keeps keeper actors (in its namespace)
    keeper_credential: str | None = None  # what the job's keepers answer (elastic.supervision.credential "keeper")
    identity_key: str | None = None  # checks the job's record of each keeper's actor ID (elastic.supervision.identity)


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Group ``epoch``: ``members`` (slices, in process order) served at ``address``; the state comes from
    ``source`` (``memory``: the members' host snapshots, ``keeper``, ``persistent``, or ``fresh``) at ``step``;
    ``peers``: every member's actor; ``donors``: the workers of slices leaving on notice, not members, asked for
    what no member holds; ``pids``: the driver processes the job has had (kept in snapshots)."""

    epoch: int
    address: str
    members: tuple[int, ...]
    peers: dict[int, Any]
    source: str
    step: int | None
    view: View
    live: bool = False  # a move at a step boundary: the boundary's snapshot (maybe still being copied) is restored
    pids: tuple[int, ...] = ()
    keeper: str | None = None  # the keeper to read a keeper restore from
    rendezvous_timeout_s: int = 5
    record_calls: bool = False  # report the jitted calls of this pass for standby compiles
    fault_floor: int = -1  # faults at or below this step fired already (a recomputed step does not fire again)
    loop: Any = None
    donors: dict[int, Any] = field(default_factory=dict)


@gated_actor  # private methods unreachable through Ray; each public one takes the control credential
class SliceWorker:
    """One slice's process. Wrapped by the placement with ``ray.remote(max_concurrency=...)``."""

    def __init__(
        self,
        slice_index: int,
        incarnation: int,
        supervisor: Any,
        spec: WorkerSpec,
        env: dict[str, str] | None = None,
        control: str | None = None,
    ) -> None:
        priority.normal("worker", job=spec.config.job_name, slice=slice_index)  # its threads to come inherit it
        if env:  # before this process's jax backend starts (its devices, the collective timeout)
            distributed.setup_process(env)
        self.slice = slice_index
        self.incarnation = incarnation
        self._supervisor = supervisor
        self._control = control  # digest of the job's control credential: its agent duties answer only that
        self._spec = spec
        cfg = spec.config
        self._config = cfg
        if spec.cache_dir:
            jax.config.update("jax_compilation_cache_dir", spec.cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self._log = get_logger("elastic.worker", job=cfg.job_name, slice=slice_index)
        self._holdings = Holdings(keep=cfg.keep_snapshots, on_busy=cfg.tiers.on_busy)
        self._lock = threading.Lock()
        self._silent = threading.Event()
        self._stop_beats = threading.Event()
        self._epoch = -1
        self._aborted = threading.Event()
        self._ended: threading.Event | None = None
        self._stop_at: dict[int, tuple[int, View]] = {}  # epoch -> (the step the group stops before, the new view)
        self._next_step = 0
        self._commits: list[tuple[int, int, dict[str, Any]]] = []  # this pass's commits, in order
        self._prepared: tuple[Any, Any, int, dict[str, Any], Ledger] | None = None
        self._calls: list[tuple[bytes, Any]] = []  # jitted calls recorded for standby compiles
        self._tiers = GroupTiers(
            cfg,
            self._holdings,
            slice_index,
            keepers=spec.keepers,
            keeper_credential=spec.keeper_credential,
            identity_key=spec.identity_key,
            log=self._log,
        )
        self._compile_s = 0.0
        self._abstract: Any = None
        self._polled = time.monotonic()  # the driver's last progress read: its lease on this worker's pass
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)  # type: ignore[arg-type]
        self._started = False
        self._signals: SignalNotice | None = None
        if cfg.notices.signal is not None:  # a scheduler's warning before it takes this host: a notice
            self._signals = SignalNotice(
                cfg.notices.signal, cfg.notices.signal_grace_s, self._give_notice, self._log, exit=os._exit
            )
            self._signals.install()
        gc.freeze()  # what the imports made lives as long as the process: a re-formation's collection skips it

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self._compile_s += duration

    # -- agent duties ---------------------------------------------------------------------------------------------
    def start(self, token: str | None = None) -> int:
        """Register with the supervisor and start heartbeating; returns the incarnation."""
        check_control(self._control, token, "start", self._log)
        me = ray.get_runtime_context().current_actor
        ray.get(
            self._supervisor.register.remote(self.slice, self.incarnation, me), timeout=self._config.startup_timeout_s
        )
        if not self._started:
            self._started = True
            threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        return self.incarnation

    def _beat(self) -> None:
        me = ray.get_runtime_context().current_actor
        interval = self._config.heartbeat_interval_s
        while not self._stop_beats.wait(interval):
            if self._silent.is_set():
                continue
            try:
                known = ray.get(self._supervisor.heartbeat.remote(self.slice, self.incarnation), timeout=10)
                if not known:  # the supervisor restarted or dropped us: register again
                    ray.get(self._supervisor.register.remote(self.slice, self.incarnation, me), timeout=10)
            except Exception as err:  # noqa: BLE001 - keep beating while the supervisor restarts
                self._log.warning("heartbeat_failed", error=repr(err)[:200])

    def _give_notice(self, deadline: float, reason: str) -> Any:
        """A notice for this worker's slice (its process was signalled), down the one notice path."""
        pair = [(self.slice, self.incarnation)]
        return ray.get(self._supervisor.agent_notice.remote(pair, deadline, reason, "sigterm"), timeout=30)

    def depart(self, token: str | None = None) -> dict[str, Any]:
        """The slice left the job on notice and the survivors have re-formed without it: leave the old group, stop
        beating, and end this process with exit code 0 once the reply is sent. Returns the exit code and the pid."""
        check_control(self._control, token, "depart", self._log)
        self._stop_beats.set()
        self._holdings.end()
        self._tiers.close()
        self._prepared = self._final = None
        left_s = distributed.leave() if distributed.joined() else 0.0
        self._log.info("departed", left_s=round(left_s, 3))
        threading.Timer(DEPART_EXIT_S, os._exit, (0,)).start()  # after Ray has sent this reply
        return {"exit_code": 0, "pid": os.getpid(), "left_s": round(left_s, 3)}

    def lifeline(self, token: str | None = None) -> None:
        """Never returns; the caller's wait fails when this process dies."""
        check_control(self._control, token, "lifeline", self._log)
        threading.Event().wait()

    def alive(self, slice_index: int | None = None, token: str | None = None) -> bool:
        """Answer the supervisor's check of a silent slice: True at once while this worker works; not while it is
        silenced (a hung host answers nothing)."""
        check_control(self._control, token, "alive", self._log)
        while self._silent.is_set() and not self._stop_beats.is_set():
            time.sleep(0.1)
        return True

    def silence(self, token: str | None = None) -> None:
        """Stop heartbeating while the process lives on (as a hung agent would; the job's close silences it)."""
        check_control(self._control, token, "silence", self._log)
        self._silent.set()

    def stop_process(self, token: str | None = None) -> None:
        """A hung host (``elastic inject --fault stop``): the whole process stops (SIGSTOP), heartbeats included."""
        check_control(self._control, token, "stop_process", self._log)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()

    def stall(self, seconds: float, token: str | None = None) -> float:
        """No heartbeat goes out for ``seconds`` (a long pause of the host), then beating resumes."""
        check_control(self._control, token, "stall", self._log)
        self._silent.set()
        time.sleep(seconds)
        self._silent.clear()
        return time.time()

    # -- what the driver and the peers ask --------------------------------------------------------------------------
    def where(self, token: str | None = None) -> tuple[int, str]:
        """This worker's process id and Ray node id."""
        check_control(self._control, token, "where", self._log)
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def ping(self, token: str | None = None) -> int:
        check_control(self._control, token, "ping", self._log)
        return os.getpid()

    def held(self, wait: bool = True, token: str | None = None) -> dict[int, dict[str, Any]]:
        """What this worker holds (see :meth:`Holdings.held`); ``wait``: for the snapshot being copied."""
        check_control(self._control, token, "held", self._log)
        return self._holdings.held(60.0 if wait else 0.0)

    def pieces(self, step: int, leaf: int, index: Any, token: str | None = None) -> list[tuple[Any, Any]]:
        """What this worker holds of region ``index`` of leaf ``leaf`` at ``step`` (pieces cut to it)."""
        check_control(self._control, token, "pieces", self._log)
        return self._holdings.overlapping(step, leaf, tuple(tuple(b) for b in index))

    def meta(self, step: int, token: str | None = None) -> dict[str, Any] | None:
        check_control(self._control, token, "meta", self._log)
        return self._holdings.meta(step)

    def hold(self, slice_index: int, image: Any, token: str | None = None) -> None:
        check_control(self._control, token, "hold", self._log)
        self._holdings.hold(slice_index, image)

    def progress(self, since: int = 0, token: str | None = None) -> dict[str, Any]:
        """The pass's progress: the next step, and the commits from index ``since`` on (step, batch, metrics as
        numbers), with the jitted calls recorded for standby compiles once there are some."""
        check_control(self._control, token, "progress", self._log)
        self._polled = time.monotonic()
        commits = [(s, b, _numbers(m)) for s, b, m in self._commits[since:]]
        return {
            "epoch": self._epoch,
            "next_step": self._next_step,
            "commits": commits,
            "pid": os.getpid(),
            "calls": list(self._calls),
            "snapshots": self._holdings.stats(),
        }

    def renew(self, token: str | None = None) -> None:
        """The driver is alive (its lease on this worker's pass; see ``DRIVER_LEASE_S``)."""
        check_control(self._control, token, "renew", self._log)
        self._polled = time.monotonic()

    def request_stop(self, epoch: int, step: int, view: View, token: str | None = None) -> bool:
        """Stop group ``epoch`` before ``step`` (a step boundary), for ``view``. False if this worker is past it."""
        check_control(self._control, token, "request_stop", self._log)
        with self._lock:
            self._stop_at[epoch] = (step, view)
            return not (self._epoch == epoch and self._next_step > step)

    def abort(self, epoch: int, token: str | None = None) -> bool:
        """End group ``epoch``'s pass now (a member was lost): ``run_pass`` returns ``failed`` at once, and the
        pass's thread records nothing more. False if this worker is not in that group's pass."""
        check_control(self._control, token, "abort", self._log)
        with self._lock:
            if self._epoch != epoch or self._ended is None or self._ended.is_set():
                return False
            self._aborted.set()
            self._ended.set()
            return True

    # -- a group -----------------------------------------------------------------------------------------------------
    def prepare(self, plan: GroupPlan, token: str | None = None) -> dict[str, Any]:
        """Join group ``plan.epoch`` (leaving the previous one), build its mesh and put the state on it."""
        check_control(self._control, token, "prepare", self._log)
        start = time.monotonic()
        phases: dict[str, float] = {}
        self._holdings.end(keep_in_flight=plan.live)  # restoring an older step: the copy in flight is not wanted
        if self._tiers.persistent is not None and distributed.joined():
            # An Orbax save of the old group may wait at a barrier for members that are gone: shut the old group's
            # client first (that wait fails now), let the save end while the old backend still answers it, then
            # leave. (A thread asking jax for its backend between leave and join would start a local one.)
            distributed.disconnect()
        self._tiers.close(timeout_s=30.0)
        self._prepared = self._final = None
        phases["end_group"] = time.monotonic() - start
        with self._lock:
            self._epoch = plan.epoch
            self._commits = []  # a poll of the new group before its pass starts must not read the last pass's commits
        index = plan.members.index(self.slice)
        out: dict[str, Any] = {
            "slice": self.slice,
            "pid": os.getpid(),
            "epoch": plan.epoch,
            "node": ray.get_runtime_context().get_node_id(),
        }
        self._phase("forming", plan)
        try:
            out["reform_seconds"] = distributed.reform(
                plan.address, len(plan.members), index, timeout_s=plan.rendezvous_timeout_s, phases=phases
            )
        except Exception as err:  # noqa: BLE001 - a member died before the group formed: this one lives on
            return {
                **out,
                "status": "failed",
                "error": f"the rendezvous of group {plan.epoch} failed: {type(err).__name__}: {str(err)[:300]}",
            }
        wrong = self._wrong_devices()
        if wrong:
            return {**out, "status": "error", "error": wrong}
        self._compile_s = 0.0
        mark = time.monotonic()
        try:
            mesh = self._mesh(plan.members)
            if self._abstract is None:  # the state's shapes: traced once per process
                self._abstract = jax.eval_shape(self._spec.init_fn, jax.random.key(self._config.seed))
            abstract = self._abstract
            shardings = state_shardings(abstract, self._spec.shardings_fn or replicate_all(abstract), mesh)
            phases["shardings"] = time.monotonic() - mark
            self._phase("restore", plan)
            state, meta = self._restore(plan, abstract, shardings)
            state = jax.block_until_ready(state)  # part of preparing: the first snapshot must not wait for it
        except Exception as err:  # noqa: BLE001 - classified by the driver: a lost peer is recovered
            return {
                **out,
                "status": "failed" if distributed.is_peer_loss(err) else "error",
                "error": f"{type(err).__name__}: {str(err)[:400]}",
                "traceback": traceback.format_exc()[-2000:],
            }
        ledger = Ledger()
        if meta is not None:
            ledger.steps, ledger.batches = Ledger.expand(meta["ledger"])
            self._holdings.forget_after(plan.step or 0)
        extras = dict(meta["extras"]) if meta is not None else {}
        begin = plan.step if plan.step is not None else (self._spec.init_step if plan.source == "fresh" else 0)
        self._prepared = (mesh, state, begin, extras, ledger)
        phases["restore"] = time.monotonic() - mark
        phases.update({f"leave_{k}": v for k, v in distributed.LEAVE_TIMES.items()})
        self._tiers.begin(plan.members, plan.peers, mesh, state)
        out.update(
            status="ready",
            meta=meta,
            restore_seconds=round(time.monotonic() - start, 3),
            phases={k: round(v, 3) for k, v in phases.items()},
        )
        return out

    def _phase(self, name: str, plan: GroupPlan) -> None:
        """A drill's faults placed in a re-formation (only for a process that has trained: ``_next_step`` > 0)."""
        if self._next_step <= 0:
            return
        context = StepContext(
            step=self._next_step, slice=self.slice, floor=plan.fault_floor, supervisor=self._supervisor
        )
        for hook in self._spec.step_hooks:
            hook.phase(name, context)

    def _wrong_devices(self) -> str | None:
        """Why this process's devices cannot be its slice's (one line), or None when they number
        ``devices_per_slice``."""
        have, want = jax.local_device_count(), self._config.devices_per_slice
        if have == want:
            return None
        kind = jax.local_devices()[0].platform
        return (
            f"slice {self.slice}'s worker sees {have} {kind} device(s) but devices_per_slice={want}: set "
            f"devices_per_slice={have}, or give each worker {want} through processes.resources_per_worker "
            f"(e.g. {{'GPU': {want}}})" + ("" if self._config.simulated else ", or simulated=True to use CPU devices")
        )

    def _mesh(self, members: tuple[int, ...]) -> Any:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        slices = [
            runtime.Slice(index=s, devices=tuple(d for d in devices if d.process_index == p))
            for p, s in enumerate(members)
        ]
        return runtime.build_mesh(slices, self._spec.mesh_fn)

    def _restore(self, plan: GroupPlan, abstract: Any, shardings: Any) -> tuple[Any, dict[str, Any] | None]:
        if plan.source == "fresh":
            if self._spec.init_from is not None:
                from elastic.control import orbax_io

                path, _ = orbax_io.resolve(self._spec.init_from)
                state = orbax_io.restore_onto(path, abstract, shardings)
                start = self._spec.init_step
                return state, ({"ledger": {"runs": [[0, 0, start]]}, "extras": {}} if start else None)
            return jax.jit(self._spec.init_fn, out_shardings=shardings)(jax.random.key(self._config.seed)), None
        step = plan.step
        assert step is not None
        if plan.source == "persistent":
            from elastic.snapshot.persistent import PersistentTier

            tier = PersistentTier(
                self._config.tiers.persistent_dir,  # type: ignore[arg-type]
                every=self._config.tiers.persistent_every,
                job=self._config.job_name,
            )
            try:
                target = jax.tree_util.tree_map(
                    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
                )
                _, state, meta = tier.load(target, step=step)
            finally:
                tier.close()
            return state, meta
        if plan.source == "keeper":
            keepers = self._tiers.keepers()
            meta = keepers.part_meta(plan.keeper, step) if keepers is not None else None  # type: ignore[assignment]
            if meta is None:
                raise RuntimeError(f"keeper {plan.keeper} no longer holds step {step}")

            def fetch(leaf: int, index: Any, have: Any) -> Any:
                data = keepers.region(plan.keeper, step, leaf, index)
                return [] if data is None else [(index, data)]

            return restore_state(
                abstract,
                shardings,
                _layout(meta),
                local=lambda leaf: [],
                fetch=fetch,
                what=f"step {step} from the keepers",
            ), meta
        meta = self._holdings.meta(step) or self._ask(plan, lambda peer: peer.meta.remote(step), f"meta of step {step}")

        layout = _layout(meta)

        def fetch_peer(leaf: int, index: Any, have: Any) -> Any:
            """The peers' pieces of the region, asked one peer after another until they cover it."""
            got: list[Any] = []
            for slice_index, peer in {**plan.peers, **plan.donors}.items():
                if slice_index == self.slice:
                    continue
                try:
                    got += ray.get(peer.pieces.remote(step, leaf, index), timeout=FETCH_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a peer gone meanwhile: ask the next
                    continue
                if covers(index, have + got, layout[leaf][1]):
                    break
            return got

        state = restore_state(
            abstract,
            shardings,
            layout,
            local=lambda leaf: self._holdings.pieces(step, leaf),
            fetch=fetch_peer,
            what=f"step {step} from the group's host snapshots",
        )
        return state, meta

    def _ask(self, plan: GroupPlan, call: Callable[[Any], Any], what: str, *, required: bool = True) -> Any:
        """The first answer that is not None from the group's other members, then its donors (bounded per peer)."""
        for slice_index, peer in {**plan.peers, **plan.donors}.items():
            if slice_index == self.slice:
                continue
            try:
                got = ray.get(call(peer), timeout=FETCH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a peer gone meanwhile: ask the next
                continue
            if got is not None:
                return got
        if not required:
            return None
        raise RuntimeError(f"no member of group {plan.epoch} holds the {what} of step {plan.step}")

    def _save(self, plan: GroupPlan, ledger: Ledger, next_step: int, state: Any, extras: dict[str, Any]) -> None:
        meta = {"ledger": ledger.to_meta(), "extras": extras, "pids": list(plan.pids), "seed": self._config.seed}
        self._tiers.save(next_step, state, meta)

    # -- one pass of the loop ------------------------------------------------------------------------------------------
    def run_pass(self, plan: GroupPlan, token: str | None = None) -> dict[str, Any]:
        """Run the user's loop over the prepared group; returns how the pass ended and its commits."""
        check_control(self._control, token, "run_pass", self._log)
        assert self._prepared is not None, "run_pass before prepare"
        with self._lock:
            self._aborted = aborted = threading.Event()  # this pass's: an abandoned thread keeps seeing its own
            self._ended = ended = threading.Event()
            self._commits = commits = []  # type: ignore[var-annotated]  # self._commits is declared
            self._polled = time.monotonic()
        out: dict[str, Any] = {"slice": self.slice, "pid": os.getpid(), "epoch": plan.epoch}
        failure: dict[str, Any] = {}

        def body() -> None:
            try:
                self._pass(plan, out, commits, aborted)
            except _Aborted:
                pass
            except Exception as err:  # noqa: BLE001 - classified: a dead peer is recovered, the rest reported
                kind = runtime.classify_failure(err)
                status = (
                    "hung"
                    if kind is runtime.FailureKind.HUNG
                    else ("failed" if distributed.is_peer_loss(err) else "error")
                )
                failure.update(
                    status=status,
                    failed_at=time.time(),
                    error=f"{type(err).__name__}: {str(err)[:400]}",
                    traceback=traceback.format_exc()[-2000:],
                )
            finally:
                ended.set()

        # The pass runs on its own thread so that abort() can end it while a collective is stuck on a dead peer
        # (gloo notices only on its timeout): that thread is abandoned, and ends by itself on the timeout.
        thread = threading.Thread(target=body, name=f"pass-{plan.epoch}", daemon=True)
        thread.start()
        ended.wait()
        if aborted.is_set():
            out.update(
                status="failed",
                failed_at=time.time(),
                aborted=True,
                error="aborted: the driver saw a member of the group lost",
            )
        else:
            thread.join()
            out.update(failure)
        out["commits"] = [(s, b, _numbers(m)) for s, b, m in commits]
        out["next_step"] = self._next_step
        out["compile_seconds"] = round(self._compile_s, 4)
        out["snapshots"] = self._holdings.stats(wait_s=30.0 if out.get("status") == "finished" else 0.0)
        return out

    def _pass(self, plan: GroupPlan, out: dict[str, Any], commits: list[Any], aborted: threading.Event) -> None:
        assert self._prepared is not None
        mesh, state, start, extras, ledger = self._prepared
        self._prepared = None
        self._next_step = start
        first_commit: list[float] = []
        began = time.time()
        first_step: list[float] = []

        def on_commit(run: Run, step: int, new_state: Any, batch: int, metrics: dict[str, Any]) -> None:
            with self._lock:  # abort() waits for a commit in progress; none starts after it
                if aborted.is_set():
                    raise _Aborted(f"group {plan.epoch} was aborted at step {step}")
                ledger.commit(step, batch)
                commits.append((step, batch, metrics))
                self._next_step = step + 1
            if not first_commit:
                first_commit.append(time.time())
                out["first_step_compile_seconds"] = round(self._compile_s, 4)
                out["first_step_phases"] = {
                    "to_step": round(first_step[0] - began, 3) if first_step else None,
                    "step": round(first_commit[0] - (first_step or [began])[0], 3),
                }

        def changed(next_step: int) -> View | None:
            with self._lock:
                if aborted.is_set():
                    raise _Aborted(f"group {plan.epoch} was aborted before step {next_step}")
                stop = self._stop_at.get(plan.epoch)
            return stop[1] if stop is not None and next_step >= stop[0] else None

        def before(step: int) -> None:
            self._next_step = step
            if not first_step:
                first_step.append(time.time())
            silent = time.monotonic() - self._polled
            if silent > DRIVER_LEASE_S:  # a worker must not train on for a dead driver (Ray ends it soon)
                raise runtime.SliceLostError(
                    f"the driver has not read this pass's progress for {silent:.1f}s (more than {DRIVER_LEASE_S}s): "
                    "it is gone or stuck"
                )
            if self._spec.step_hooks:
                context = StepContext(step=step, slice=self.slice, floor=plan.fault_floor, supervisor=self._supervisor)
                for hook in self._spec.step_hooks:
                    hook(context)

        def record(fn: Callable[..., Any], args: tuple[Any, ...], mesh_: Any) -> None:
            if plan.record_calls:
                self._record(fn, args, mesh_)

        def save(next_step: int, state_: Any, extras_: dict[str, Any]) -> None:
            if not aborted.is_set():  # an abandoned pass snapshots nothing (the next group may be restoring)
                self._save(plan, ledger, next_step, state_, extras_)

        host = PassHost(
            self._config,
            save=save,
            changed=changed,
            on_commit=on_commit,
            before=before,
            record=record,
            snapshot_soon=plan.source != "fresh",
        )
        run = Run(host, view=plan.view, mesh=mesh, state=state, start_step=start, extras=extras)
        del state
        if plan.source == "fresh":
            host.save(start, run.state, {})
        try:
            self._loop_of(plan)(run)
            out.update(status="finished", ledger=ledger.to_meta())
        except Regroup:
            out.update(status="regroup", ledger=ledger.to_meta())
        finally:
            out["first_commit_at"] = first_commit[0] if first_commit else None
            with self._lock:  # an abandoned pass (aborted) ends late: it must not replace a later pass's state
                if not aborted.is_set():
                    self._final = run.state

    def _loop_of(self, plan: GroupPlan) -> Callable[[Run], Any]:
        """The user's loop (sent once per job, as an object reference; kept here after the first pass)."""
        if not isinstance(plan.loop, ray.ObjectRef):
            return plan.loop
        if getattr(self, "_loop_ref", None) != plan.loop:
            self._loop_ref, self._loop = plan.loop, ray.get(plan.loop)
        return self._loop

    def _record(self, fn: Callable[..., Any], args: tuple[Any, ...], mesh: Any) -> None:
        """Note a jitted call (pickled function, its signature relative to the mesh) for the standby group."""
        import cloudpickle

        try:
            signature = runtime.standby.Signature.of(args, mesh)
            parts = runtime.standby.portable(fn)
            if signature is not None and parts is not None:
                self._calls.append((cloudpickle.dumps(parts), signature))
        except Exception as err:  # noqa: BLE001 - an optimisation must never fail a step
            self._log.info("standby_record_skipped", error=repr(err)[:200])

    # -- the end ------------------------------------------------------------------------------------------------------
    def final_pieces(self, token: str | None = None) -> dict[str, Any]:
        """This worker's pieces of the final state (its own regions, host arrays) per leaf, and the state's layout
        (typed keys as their key data)."""
        check_control(self._control, token, "final_pieces", self._log)
        state = getattr(self, "_final", None)
        if state is None:
            return {"layout": [], "pieces": []}
        from elastic.snapshot.image import region

        leaves = jax.tree_util.tree_leaves(state)
        out = []
        for leaf in leaves:
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            seen: dict[Any, Any] = {}
            for shard in leaf.addressable_shards:
                index = region(shard.index, tuple(leaf.shape))
                if index not in seen:
                    seen[index] = jax.device_get(shard.data)
            out.append(list(seen.items()))
        return {"layout": layout_of(leaves), "pieces": out}

    def save_final(self, path: str, token: str | None = None) -> None:
        """Write the final state to ``path`` with Orbax (every worker its own shards)."""
        check_control(self._control, token, "save_final", self._log)
        from etils import epath

        from elastic.control import orbax_io

        orbax_io.save_final(epath.Path(path), self._final)

    def leave(self, token: str | None = None) -> float:
        """Leave the group (the job ends): snapshots closed, the runtime torn down. Seconds it took."""
        check_control(self._control, token, "leave", self._log)
        self._holdings.end()
        self._tiers.close()
        self._prepared = self._final = None
        self._stop_beats.set()
        return distributed.leave() if distributed.joined() else 0.0


class _Aborted(BaseException):
    """Ends an abandoned pass: the driver aborted the group while this thread was still in it."""


def _numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics a step committed, as Python numbers (arrays already computed: commit waited for them)."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def _layout(meta: dict[str, Any]) -> Layout:
    return [tuple(x) for x in meta["_layout"]]
