"""A slice's process in multi-process mode: one Ray actor per slice, on the slice's host.

It is two things at once. It is the slice's *agent*: it registers with the job's supervisor, heartbeats from
a thread of its own, and its death (its process killed, its node gone) fails the supervisor's lifeline call at
once, so the supervisor sees a lost worker the way it sees any lost agent. And it runs the user's loop SPMD
with its peers: the driver (:mod:`elastic.placements.processes`) hands every member of a group a
:class:`GroupPlan`; :meth:`SliceWorker.prepare` joins the group's ``jax.distributed`` runtime in place (the
previous group left, same process), builds the mesh over every member's devices, and restores the state
(:mod:`elastic.placements.group_restore`); :meth:`SliceWorker.run_pass` runs the loop
(:class:`~elastic.placements.pass_runner.PassRunner`), its snapshots going to this worker's
:class:`~elastic.placements.holdings.Holdings` (the buddy copy in the next member's process, keeper parts, Orbax
checkpoints written by every worker). A pass ends with a :class:`~elastic.placements.outcome.PassOutcome`; the
worker waits for the next plan. The actor is threaded: the driver's polls, stop requests and the peers' buddy
copies are served while the loop runs on its own thread. This module is the actor's surface: what it answers.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ray

from elastic import priority, runtime
from elastic.control.hooks import StepContext
from elastic.control.report import Ledger
from elastic.control.sources import Source
from elastic.log import get_logger
from elastic.loop.shardings import replicate_all, state_shardings
from elastic.placements.forming import Forming
from elastic.placements.group_restore import restore_group
from elastic.placements.group_tiers import GroupTiers
from elastic.placements.holdings import Holdings
from elastic.placements.outcome import Ending, ErrorInfo, Joined, PassOutcome, classify, error_info
from elastic.placements.pass_runner import DRIVER_LEASE_S, PassRunner, Prepared
from elastic.placements.plan import GroupPlan, WorkerSpec
from elastic.placements.restore import own_pieces
from elastic.placements.signal_notice import SignalNotice
from elastic.runtime import distributed
from elastic.snapshot.calls import CallCheck
from elastic.snapshot.gated import gated_actor
from elastic.supervision.agent import check_control
from elastic.supervision.heartbeat import Heartbeat
from elastic.supervision.membership import View

__all__ = ["DRIVER_LEASE_S", "GroupPlan", "SliceWorker", "WorkerSpec"]

DEPART_EXIT_S = 0.5  # a departing worker's reply goes out before its process ends


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
        self._control = CallCheck(control)  # the call key of the job's control credential: its duties answer only that
        self._spec = spec
        cfg = spec.config
        self._config = cfg
        if spec.cache_dir:
            jax.config.update("jax_compilation_cache_dir", spec.cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self._log = get_logger("elastic.worker", job=cfg.job_name, slice=slice_index)
        self._holdings = Holdings(keep=cfg.keep_snapshots, on_busy=cfg.tiers.on_busy)
        self._silent = threading.Event()
        self._heartbeat = Heartbeat(supervisor, self._due, cfg.heartbeat_interval_s, self._log)
        self._prepared: Prepared | None = None
        self._tiers = GroupTiers(
            cfg,
            self._holdings,
            slice_index,
            keepers=spec.keepers,
            keeper_credential=spec.keeper_credential,
            identity_key=spec.identity_key,
            log=self._log,
        )
        self._runner = PassRunner(slice_index, spec, supervisor, self._holdings, self._save)
        self._abstract: Any = None
        self._forming = Forming()
        jax.monitoring.register_event_duration_secs_listener(self._runner.on_duration)  # type: ignore[arg-type]
        self._signals: SignalNotice | None = None
        if cfg.notices.signal is not None:  # a scheduler's warning before it takes this host: a notice
            self._signals = SignalNotice(
                cfg.notices.signal, cfg.notices.signal_grace_s, self._give_notice, self._log, exit=os._exit
            )
            self._signals.install()
        gc.freeze()  # what the imports made lives as long as the process: a re-formation's collection skips it

    # -- agent duties ---------------------------------------------------------------------------------------------
    def start(self, token: str | None = None) -> int:
        """Register with the supervisor and start heartbeating; returns the incarnation."""
        check_control(self._control, token, "start", self._log)
        me = ray.get_runtime_context().current_actor
        ray.get(
            self._supervisor.register.remote(self.slice, self.incarnation, me), timeout=self._config.startup_timeout_s
        )
        self._heartbeat.start_thread()  # once only
        return self.incarnation

    def _due(self) -> list[tuple[int, int]]:
        """What beats now: this worker's slice, unless silenced."""
        return [] if self._silent.is_set() else [(self.slice, self.incarnation)]

    def _give_notice(self, deadline: float, reason: str) -> Any:
        """A notice for this worker's slice (its process was signalled), down the one notice path."""
        pair = [(self.slice, self.incarnation)]
        return ray.get(self._supervisor.agent_notice.remote(pair, deadline, reason, "sigterm"), timeout=30)

    def depart(self, token: str | None = None) -> dict[str, Any]:
        """The slice left the job on notice and the survivors have re-formed without it: leave the old group, stop
        beating, and end this process with exit code 0 once the reply is sent. Returns the exit code and the pid."""
        check_control(self._control, token, "depart", self._log)
        self._heartbeat.stop()
        self._holdings.end()
        if self._tiers.persistent is not None and distributed.joined():
            # An Orbax save of the group this slice left may wait at a barrier for the survivors, who re-formed
            # without it and will never come: shut the client first so that the save fails now (as in prepare).
            distributed.disconnect()
        self._tiers.close(timeout_s=30.0)
        self._prepared = self._runner.final = None
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
        while self._silent.is_set() and not self._heartbeat.stopped:
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
        return self._runner.progress(since)

    def renew(self, token: str | None = None) -> None:
        """The driver is alive (its lease on this worker's pass; see ``DRIVER_LEASE_S``)."""
        check_control(self._control, token, "renew", self._log)
        self._runner.renew()

    def request_stop(self, epoch: int, step: int, view: View, final: bool = False, token: str | None = None) -> bool:
        """Stop group ``epoch`` before ``step`` (a step boundary), for ``view`` (``final``: the job stops there, its
        state saved to the Orbax tier). False if this worker is past it."""
        check_control(self._control, token, "request_stop", self._log)
        return self._runner.request_stop(epoch, step, view, final)

    def abort(self, epoch: int, token: str | None = None) -> bool:
        """End group ``epoch``'s pass now (a member was lost): ``run_pass`` returns ``PEER_LOST`` at once, and the
        pass's thread records nothing more. False if this worker is not in that group's pass."""
        check_control(self._control, token, "abort", self._log)
        return self._runner.abort(epoch)

    def abandon(self, epoch: int, token: str | None = None) -> bool:
        """Give up preparing group ``epoch`` (a member died as it formed: see :mod:`~elastic.placements.forming`):
        ``prepare`` then answers ``PEER_LOST`` at once and the state held here is kept for the next group. False if
        this process is not preparing that group."""
        check_control(self._control, token, "abandon", self._log)
        done = self._forming.abandon(epoch)
        if done:
            self._log.warning("group_abandoned", epoch=epoch)
        return done

    # -- a group -----------------------------------------------------------------------------------------------------
    def prepare(self, plan: GroupPlan, token: str | None = None) -> Joined:
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
        self._prepared = None
        self._runner.begin_group(plan.epoch)
        phases["end_group"] = time.monotonic() - start
        joined = functools.partial(
            Joined, slice=self.slice, pid=os.getpid(), epoch=plan.epoch, node=ray.get_runtime_context().get_node_id()
        )
        self._phase("forming", plan)
        with self._forming.preparing(plan.epoch):
            return self._form(plan, joined, phases, start)

    def _form(self, plan: GroupPlan, joined: Callable[..., Joined], phases: dict[str, float], start: float) -> Joined:
        """:meth:`prepare` from the rendezvous on."""
        try:
            reform = distributed.reform(
                plan.address,
                len(plan.members),
                plan.members.index(self.slice),
                timeout_s=plan.rendezvous_timeout_s,
                phases=phases,
                on_joined=functools.partial(self._joined, plan),
            )
        except Exception as err:  # noqa: BLE001 - a member died before the group formed: this one lives on
            info = error_info(err, context=f"the rendezvous of group {plan.epoch} failed", limit=300)
            return joined(ending=Ending.PEER_LOST, error=info)
        wrong = self._wrong_devices()
        if wrong:
            return joined(ending=Ending.ERROR, error=ErrorInfo(type_name="", message=wrong))
        self._runner.compile_s = 0.0
        mark = time.monotonic()
        try:
            mesh = self._mesh(plan.members)
            if self._abstract is None:  # the state's shapes: traced once per process
                self._abstract = jax.eval_shape(self._spec.init_fn, jax.random.key(self._config.seed))
            abstract = self._abstract
            shardings = state_shardings(abstract, self._spec.shardings_fn or replicate_all(abstract), mesh)
            phases["shardings"] = time.monotonic() - mark
            self._phase("restore", plan)
            state, meta = restore_group(
                plan,
                abstract,
                shardings,
                me=self.slice,
                spec=self._spec,
                holdings=self._holdings,
                keepers=self._tiers.keepers,
            )
            phases["place"] = time.monotonic() - mark - phases["shardings"]
            state = jax.block_until_ready(state)  # part of preparing: the first snapshot must not wait for it
            phases["placed"] = time.monotonic() - mark
            self._tiers.begin(plan.members, plan.peers, mesh, state)  # an Orbax tier syncs the group here
        except Exception as err:  # noqa: BLE001 - classified once: a lost peer is recovered, the rest reported
            ending = Ending.PEER_LOST if self._forming.abandoned(plan.epoch) else classify(err)
            ending = Ending.ERROR if ending is Ending.HUNG else ending  # no step ran: only a lost peer is recovered
            return joined(ending=ending, error=error_info(err), reform_seconds=reform)
        ledger = Ledger()
        if meta is not None:
            ledger.steps, ledger.batches = Ledger.expand(meta["ledger"])
            self._holdings.forget_after(plan.step or 0)
        extras = dict(meta["extras"]) if meta is not None else {}
        begin = plan.step if plan.step is not None else (self._spec.init_step if plan.source is Source.FRESH else 0)
        self._prepared = (mesh, state, begin, extras, ledger)
        phases["restore"] = time.monotonic() - mark
        phases.update({f"leave_{k}": v for k, v in distributed.LEAVE_TIMES.items()})
        return joined(
            meta=meta,
            reform_seconds=reform,
            restore_seconds=round(time.monotonic() - start, 3),
            phases={k: round(v, 3) for k, v in phases.items()},
        )

    def _joined(self, plan: GroupPlan) -> None:
        """Between the rendezvous and the backend's start: a drill's faults there, and a group given up meanwhile."""
        self._phase("joined", plan)
        self._forming.check(plan.epoch)

    def _phase(self, name: str, plan: GroupPlan) -> None:
        """A drill's faults placed in a re-formation (only for a process that has trained: a next step > 0)."""
        if self._runner.next_step <= 0:
            return
        context = StepContext(
            step=self._runner.next_step, slice=self.slice, floor=plan.fault_floor, supervisor=self._supervisor
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

    def _save(
        self, plan: GroupPlan, ledger: Ledger, next_step: int, state: Any, extras: dict[str, Any], final: bool = False
    ) -> int | None:
        """A snapshot resuming at ``next_step``; ``final``: the job stops there, to the Orbax tier now (its step)."""
        meta = {"ledger": ledger.to_meta(), "extras": extras, "pids": list(plan.pids), "seed": self._config.seed}
        if final:
            return self._tiers.persist(next_step, state, meta)
        self._tiers.save(next_step, state, meta)
        return None

    # -- one pass of the loop ------------------------------------------------------------------------------------------
    def run_pass(self, plan: GroupPlan, token: str | None = None) -> PassOutcome:
        """Run the user's loop over the prepared group; how the pass ended, and its commits."""
        check_control(self._control, token, "run_pass", self._log)
        prepared, self._prepared = self._prepared, None
        assert prepared is not None, "run_pass before prepare"
        return self._runner.run(plan, prepared)

    # -- the end ------------------------------------------------------------------------------------------------------
    def final_pieces(self, token: str | None = None) -> dict[str, Any]:
        """This worker's pieces of the final state (its own regions, host arrays) per leaf, and the state's layout
        (typed keys as their key data)."""
        check_control(self._control, token, "final_pieces", self._log)
        return own_pieces(self._runner.final)

    def save_final(self, path: str, token: str | None = None) -> None:
        """Write the final state to ``path`` with Orbax (every worker its own shards)."""
        check_control(self._control, token, "save_final", self._log)
        from etils import epath

        from elastic.control import orbax_io

        orbax_io.save_final(epath.Path(path), self._runner.final)

    def leave(self, token: str | None = None) -> float:
        """Leave the group (the job ends): snapshots closed, the runtime torn down. Seconds it took."""
        check_control(self._control, token, "leave", self._log)
        self._holdings.end()
        self._tiers.close()
        self._prepared = self._runner.final = None
        self._heartbeat.stop()
        return distributed.leave() if distributed.joined() else 0.0
