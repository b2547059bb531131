"""The declared hooks a fault plan (a drill, a chaos run) plugs into, and the handles it is given.

The controller, the placements and the workers know nothing of faults: they call these protocols' methods,
never discover one by name. A plan is handed :class:`JobHandles` (explicit, public handles on the job's parts),
not the job, so no fault code reads a job's private fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from elastic import runtime
    from elastic.control.accounting import Accounting
    from elastic.control.cluster import ActorGroup
    from elastic.control.watcher import ViewWatcher

__all__ = ["DriverHook", "FaultPlan", "JobHandles", "StepContext", "WorkerHook"]


@dataclass(frozen=True, kw_only=True)
class JobHandles:
    """What a fault plan may act through: the job's topology and mode, its actor group (a getter: the group is made
    when the job starts), its accounting (to count what it injects), its membership watcher (single-process mode,
    once running), its in-memory snapshot tier (single-process mode) and its keeper client (multi-process mode)."""

    job: str
    topology: runtime.Topology
    simulated: bool
    multi: bool
    group: Callable[[], ActorGroup]
    accounting: Accounting
    watcher: Callable[[], ViewWatcher | None] = lambda: None
    snapshots: Callable[[], Any] = lambda: None
    keepers: Callable[[], Any] = lambda: None


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What a worker-side hook is told as a step starts: the step, this worker's slice, ``floor`` (the highest step
    the job had reached when the group formed: a step at or below it is being recomputed), and the job's supervisor
    (to read the membership view)."""

    step: int
    slice: int
    floor: int
    supervisor: Any


@runtime_checkable
class DriverHook(Protocol):
    """A hook the driver's controller runs before each step (in the client process)."""

    def __call__(self, step: int) -> None: ...

    def settle(self) -> None:
        """Wait (bounded) for what the hook started beside the loop; called once as the run ends."""
        ...


@runtime_checkable
class WorkerHook(Protocol):
    """A hook each worker process runs (multi-process mode); pickled to every worker."""

    def __call__(self, context: StepContext) -> None:
        """A step starts."""
        ...

    def phase(self, name: str, context: StepContext) -> None:
        """A re-formation reached ``name`` ("forming": before the rendezvous; "joined": after it, before the group's
        backend starts; "restore": formed, state not placed)."""
        ...

    def takes(self, slice: int) -> bool:
        """Whether a loss of ``slice`` may be this hook's doing (a drill's fault), not a failure a survivor caused."""
        ...


class FaultPlan(Protocol):
    """What a job needs of a fault plan (``elastic.Faults``): the job imports no fault machinery itself."""

    def validate(self, *, num_slices: int, num_steps: int) -> None: ...

    def __len__(self) -> int: ...

    def injector(self, handles: JobHandles) -> DriverHook:
        """The before-step hook that carries the plan out through ``handles`` (multi-process: the driver's half)."""
        ...

    def worker_hooks(self) -> list[WorkerHook]:
        """Multi-process mode: the hooks each worker runs to carry out its share of the plan."""
        ...
