"""Each fault kind's effect, written once, acting through the handles it is given (a job's :class:`JobHandles`, an
agent's actor handle) or on the process it runs in (a worker of a multi-process job).

The injectors (:mod:`elastic.chaos.injector`), the chaos runner's seams and its notices decide *when* and *where*
a fault strikes; what it does is here.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any, NoReturn

import ray

from elastic import runtime
from elastic.log import get_logger

if TYPE_CHECKING:
    from elastic.control.hooks import JobHandles

__all__ = [
    "COLLECTIVE_DELAY_S",
    "hang",
    "kill_agent",
    "kill_simulated_slice",
    "kill_this_process",
    "kill_worker",
    "restart_supervisor",
    "revive_simulated_slice",
    "silence_agent",
    "stop_this_process",
    "transient_failure",
]

COLLECTIVE_DELAY_S = 0.02  # a kill "during the collective": this long into the step, its work in flight


def transient_failure(step: int) -> NoReturn:
    """Raise a slice-loss error although every slice is healthy (classified as a real ``UNAVAILABLE``)."""
    raise runtime.TransientUnavailableError(f"UNAVAILABLE: injected transient failure at step {step}")


def kill_this_process(*, in_collective: bool = False) -> None:
    """SIGKILL this process now (a crashed host or driver); ``in_collective``: a moment into the step, its work
    dispatched and running."""
    if in_collective:
        threading.Timer(COLLECTIVE_DELAY_S, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def stop_this_process() -> None:
    """SIGSTOP this process: a hung host, heartbeats included."""
    os.kill(os.getpid(), signal.SIGSTOP)


def hang(slice_: runtime.Slice | None) -> None:
    """The next compiled call (on ``slice_``'s devices; None: any) never completes until the step watchdog aborts it."""
    runtime.hangs.arm(slice_)


def restart_supervisor(handles: JobHandles, *, for_good: bool = False) -> None:
    """Kill the job's supervisor actor: Ray restarts it (it rebuilds its view from the event stream), unless
    ``for_good``."""
    handles.group().kill_supervisor(no_restart=for_good)


def kill_agent(handles: JobHandles, index: int) -> None:
    """Kill slice ``index``'s agent actor for real, as its host dying would."""
    handles.group().kill_agent(index)


def kill_simulated_slice(handles: JobHandles, index: int) -> None:
    """Slice ``index``'s simulated devices fail from now on."""
    runtime.simulated.kill_slice(handles.topology.slice(index))


def revive_simulated_slice(handles: JobHandles, index: int) -> None:
    """Slice ``index``'s simulated devices work again (a repaired slice)."""
    runtime.simulated.revive_slice(handles.topology.slice(index))


def silence_agent(handles: JobHandles, index: int) -> None:
    """Slice ``index``'s agent stays alive but stops heartbeating (a hung host)."""
    group = handles.group()
    group.agent(index).silence.remote()


def kill_worker(handle: Any, index: int) -> None:
    """Multi-process mode, from the driver: kill the worker process behind the agent ``handle`` of slice ``index``
    (one that already exited, or was replaced since the handle was taken, is left as it is)."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception as err:  # noqa: BLE001 - the process is gone already
        get_logger("elastic.chaos.notices").info("worker_kill_failed", slice=index, error=type(err).__name__)
