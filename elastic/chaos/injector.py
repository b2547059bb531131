"""Fault injection for drills and tests: fires a plan's :class:`~elastic.chaos.fault.Fault` records when they are due.

The controller knows nothing of faults: an injector is one of its before-step hooks. A killed slice's
agent actor dies for real and its simulated devices fail, so detection and recovery run exactly as for
a real failure; ``kill_client`` is a real SIGKILL of this process. What each kind does is written once, in
:mod:`elastic.chaos.effects`; the injectors here decide when, and in which process, it is done.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic.chaos import effects
from elastic.chaos.fault import Fault
from elastic.errors import RecoveryTimeoutError
from elastic.log import get_logger
from elastic.snapshot import Snapshotter

if TYPE_CHECKING:
    from elastic.control.hooks import JobHandles

__all__ = ["DriverFaults", "FaultInjector", "WorkerFaults", "snapshotter_of"]

PHASE_KILLS = ("forming", "joined", "restore")  # kills a worker places in a re-formation (see phase), not in a step
DRILL_NAMESPACE = "elastic-drills"  # Ray KV namespace of the marks of worker faults fired


class FaultInjector:
    """Fires each fault once, when the loop reaches its step (a recomputed step does not fire it again). A
    ``revive`` returns once the slice is back in the membership view (at most ``hold_s``), so the job grows onto
    it at the next step boundary however long its new agent took to start (``hold=False``: it returns at once)."""

    def __init__(self, faults: Sequence[Fault], handles: JobHandles, *, hold_s: float = 60.0) -> None:
        self._faults = tuple(faults)
        self._handles = handles
        self._acct = handles.accounting
        self.hold_s = hold_s
        self._fired: set[Fault] = set()
        self._kills: list[threading.Thread] = []  # agents being killed beside the loop
        self._log = get_logger("elastic.chaos.faults", job=handles.job)

    def __call__(self, step: int) -> None:
        for fault in self._faults:
            if fault.at_step == step and fault not in self._fired:
                self._fired.add(fault)
                self._inject(fault)

    def _kill_beside(self, index: int) -> None:
        """Kill slice ``index``'s agent on a thread of its own: a host's death does not hold the training loop
        for the actor kill's round trip, which the injection would otherwise add to the time the loss takes to be
        seen."""

        def kill() -> None:
            try:
                effects.kill_agent(self._handles, index)
            except Exception as err:  # noqa: BLE001 - a drill whose cluster is gone: nothing left to kill
                self._log.info("agent_kill_failed", slice=index, error=f"{type(err).__name__}: {err}"[:200])

        thread = threading.Thread(target=kill, name=f"kill-agent-{index}", daemon=True)
        thread.start()
        self._kills.append(thread)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until the agents killed beside the loop are dead (a revive, or a drill's end, comes after)."""
        kills, self._kills = self._kills, []
        deadline = time.monotonic() + timeout
        for thread in kills:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def fire(self, fault: Fault) -> None:
        """Inject ``fault`` now, whatever its step (the chaos runner's seams: mid-step, after a restore...)."""
        self._fired.add(fault)
        self._inject(fault)

    def _inject(self, fault: Fault) -> None:
        self._log.warning("fault_injected", kind=fault.kind, slice=fault.slice, step=fault.at_step)
        self._acct.timeline.add(f"inject_{fault.kind}", step=fault.at_step, slice=fault.slice)
        if fault.kind == "kill_client":
            effects.kill_this_process()
        if fault.kind == "transient":
            self._acct.report.failures_injected += 1
            effects.transient_failure(fault.at_step)
        if fault.kind == "supervisor_restart":
            self._acct.report.failures_injected += 1
            effects.restart_supervisor(self._handles)
            return
        if fault.kind == "hang":  # the step's next compiled call never completes until the watchdog aborts it
            self._acct.report.failures_injected += 1
            effects.hang(None if fault.slice is None else self._handles.topology.slice(fault.slice))
            return
        assert fault.slice is not None
        if fault.kind == "kill":
            self._acct.report.failures_injected += 1
            if self._handles.simulated:  # the devices die at once; the agent's death (a GCS round trip) goes on beside
                effects.kill_simulated_slice(self._handles, fault.slice)
                self._kill_beside(fault.slice)
            else:
                effects.kill_agent(self._handles, fault.slice)
        elif fault.kind == "silence":
            self._acct.report.failures_injected += 1
            effects.silence_agent(self._handles, fault.slice)
        elif fault.kind == "revive":
            self.settle()  # its agent's kill first
            if self._handles.simulated:
                effects.revive_simulated_slice(self._handles, fault.slice)
            if fault.hold:
                self._handles.group().spawn_agent(fault.slice)
                self._await_back(fault.slice)
            else:  # the new agent starts and registers on its own; the job grows when the view has it
                self._handles.group().revive(fault.slice)

    def _await_back(self, index: int) -> None:
        watcher = self._handles.watcher()
        if watcher is None:
            return
        try:
            watcher.wait_for(lambda v: index in v.active, self.hold_s, what=f"slice {index} back")
        except RecoveryTimeoutError:  # the drill goes on; the job grows whenever the slice does come back
            self._log.warning("revive_late", slice=index, waited_s=self.hold_s)


class WorkerFaults:
    """The faults a worker process carries out itself in multi-process mode, on its own slice, as the step starts:
    ``kill`` (SIGKILL: a real process death), ``silence`` and a ``hang`` of a slice (SIGSTOP: a hung host, heartbeats
    included), a ``hang`` of no slice (every worker's step never completes until the step watchdog ends it) and
    ``transient`` (every worker's step raises a slice-loss error). A ``revive`` of slice k at step n holds every
    worker before step n + 1 until slice k is back in the membership view (its new process, started by the driver
    at step n, joins there), at most ``hold_s`` (not with ``hold=False``). Pickled to every worker; each fault
    fires once per process, and never at a step the job had reached before (a recomputed step)."""

    KINDS = ("kill", "silence", "hang", "transient", "revive")

    def __init__(self, faults: tuple[Fault, ...], *, hold_s: float = 60.0) -> None:
        self.faults = tuple(f for f in faults if f.kind in self.KINDS)
        self.hold_s = hold_s
        self._fired: set[Fault] = set()
        self._drill = uuid.uuid4().hex  # this plan, in every worker it is sent to (its marks in Ray's KV store)

    def _first(self, fault: Fault) -> bool:
        """Whether ``fault`` fires here: once per drill across every process of the job, a replacement process
        included (a worker that dies before the driver saw its step would otherwise fire it again in its
        successor, forever). Marked in Ray's key-value store (cluster-wide) before it fires."""
        from elastic.supervision.ray_internals import kv_put

        key = f"{self._drill}:{self.faults.index(fault)}".encode()
        try:
            return not kv_put(key, b"1", overwrite=False, namespace=DRILL_NAMESPACE)
        except Exception:  # noqa: BLE001 - no KV (not a Ray worker): once per process, as the caller ensures
            return True

    def __call__(self, context: Any) -> None:
        step, slice_index = context.step, context.slice
        for fault in self.faults:
            due = fault.at_step + 1 if fault.kind == "revive" else fault.at_step
            if due != step or fault in self._fired or step <= context.floor:
                continue
            if fault.kind == "revive":
                self._fired.add(fault)
                if fault.hold:
                    self._hold(context, fault)
                continue
            if (fault.slice is not None and fault.slice != slice_index) or fault.during in PHASE_KILLS:
                continue
            self._fired.add(fault)
            if fault.slice is not None and not self._first(fault):
                continue
            get_logger("elastic.faults").warning(
                "fault_injected", kind=fault.kind, step=step, slice=slice_index, during=fault.during
            )
            if fault.kind == "kill":  # "collective": the step's work dispatched and running
                effects.kill_this_process(in_collective=fault.during == "collective")
            elif fault.kind in ("silence", "hang") and fault.slice is not None:
                effects.stop_this_process()  # a hung host: the whole process stops
            elif fault.kind == "hang":
                effects.hang(None)
            elif fault.kind == "transient":
                effects.transient_failure(step)

    def takes(self, slice: int) -> bool:
        """Whether a fault of this plan takes ``slice`` down (a kill, a silence, a hang of that slice)."""
        return any(f.slice == slice and f.kind in ("kill", "silence", "hang") for f in self.faults)

    def phase(self, name: str, context: Any) -> None:
        """A re-formation of the group reached ``name`` ("forming": before the rendezvous; "joined": after it,
        before the group's backend starts; "restore": the group formed, the state not placed yet): kill this
        worker if a fault of its slice is due there. Only a process that trained up to the fault's step itself
        fires it (a replacement process does not kill itself again)."""
        for fault in self.faults:
            if (
                fault.kind == "kill"
                and fault.during == name
                and fault.slice == context.slice
                and fault not in self._fired
                and context.step >= fault.at_step
            ):
                self._fired.add(fault)
                if not self._first(fault):
                    continue
                get_logger("elastic.faults").warning(
                    "fault_injected", kind="kill", during=name, slice=context.slice, step=context.step
                )
                effects.kill_this_process()

    def _hold(self, context: Any, fault: Fault) -> None:
        import ray

        deadline = time.monotonic() + self.hold_s
        while time.monotonic() < deadline:
            view = ray.get(context.supervisor.view.remote(), timeout=10)
            if fault.slice in view.active or view.gave_up is not None:
                return
            time.sleep(0.05)


class DriverFaults:
    """The driver's half of a drill in multi-process mode (the workers carry out the rest: :class:`WorkerFaults`).
    Called with the group's progress; each fault is due once the group reaches its step. A ``revive`` starts a
    new process for its slice unless the slice is back already (``Processes.replace_lost`` may have started one);
    ``kill_client`` SIGKILLs this process. The workers' faults are counted and marked on the timeline here."""

    def __init__(self, faults: Sequence[Fault], handles: JobHandles) -> None:
        self._faults = tuple(faults)
        self._handles = handles
        self._acct = handles.accounting
        self._fired: set[Fault] = set()
        self._log = get_logger("elastic.faults", job=handles.job)

    def settle(self) -> None:
        """Nothing runs beside the loop: the workers carry out their faults themselves."""

    def __call__(self, step: int) -> None:
        for fault in self._faults:
            if fault.at_step <= step and fault not in self._fired:
                self._fired.add(fault)
                self._fire(fault)

    def _fire(self, fault: Fault) -> None:
        self._acct.timeline.add(f"inject_{fault.kind}", step=fault.at_step, slice=fault.slice)
        if fault.kind == "kill_client":
            self._log.warning("fault_injected", kind=fault.kind, step=fault.at_step)
            effects.kill_this_process()
        if fault.kind == "revive":
            assert fault.slice is not None
            self._handles.group().revive(fault.slice)  # unless a replacement is starting, or the slice is back
            return
        if fault.kind == "supervisor_restart":
            self._log.warning("fault_injected", kind=fault.kind, step=fault.at_step)
            effects.restart_supervisor(self._handles)
        self._acct.report.failures_injected += 1


def snapshotter_of(handles: JobHandles) -> Snapshotter:
    """The in-memory snapshot tier of a single-process job (a testing seam: corrupt a copy, read its stats)."""
    snaps = handles.snapshots()
    assert snaps is not None, "a single-process job"
    return snaps
