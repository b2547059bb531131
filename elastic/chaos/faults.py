"""Fault injection through the public API: ``Faults().kill_slice(1, at_step=30).revive_slice(1, at_step=60)``.

Each fault fires once, when the loop reaches its step (a step recomputed after a rollback does not
fire it again). A killed slice's agent actor dies for real and its simulated devices fail, so
detection and recovery run exactly as for a real failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.chaos.fault import KILL_MOMENTS, During, Fault, FaultKind
from elastic.errors import ConfigError

if TYPE_CHECKING:
    from elastic.control.hooks import DriverHook, JobHandles, WorkerHook

__all__ = ["KILL_MOMENTS", "During", "Fault", "FaultKind", "Faults"]  # Fault and its types: from .fault


class Faults:
    """A fluent plan of faults (plain data: the :class:`Fault` records); pass it to ``ElasticJob(faults=...)`` or
    ``Trainer(faults=...)``. It satisfies :class:`~elastic.control.hooks.FaultPlan`: ``injector`` and
    ``worker_hooks`` hand its faults to :mod:`elastic.chaos.injector`, which knows nothing of this class."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []

    def kill_slice(self, slice: int, *, at_step: int, during: During = "step") -> Faults:
        """Slice ``slice`` dies as step ``at_step`` runs: its agent is killed and its devices fail.

        Multi-process mode only, ``during`` places the worker's SIGKILL elsewhere: ``"collective"``, a moment
        into the step (its computation and collectives in flight); ``"forming"`` / ``"joined"`` / ``"restore"``, in
        the first re-formation of the group once the job has reached ``at_step``: before its rendezvous, after it
        (the group's backend not started), or as it restores."""
        if during not in KILL_MOMENTS:
            raise ConfigError(f"kill_slice during={during!r}: choose one of {', '.join(KILL_MOMENTS)}")
        return self._add(Fault(kind="kill", slice=slice, at_step=at_step, during=during))

    def revive_slice(self, slice: int, *, at_step: int, hold: bool = True) -> Faults:
        """A repaired slice ``slice`` comes back (new agent, working devices) as step ``at_step`` starts; the
        job grows onto it at the next step boundary, so it computes from step ``at_step + 1`` on.

        ``hold=False``: the loop goes on while the new agent starts, as a repaired host's own agent would (no
        wait for Ray to start its process); the job grows at the first step boundary after it registered, so the
        step it computes from depends on how long that took."""
        return self._add(Fault(kind="revive", slice=slice, at_step=at_step, hold=hold))

    def silence_agent(self, slice: int, *, at_step: int) -> Faults:
        """Slice ``slice``'s agent stays alive but stops heartbeating (a hung host)."""
        return self._add(Fault(kind="silence", slice=slice, at_step=at_step))

    def transient_error(self, *, at_step: int) -> Faults:
        """Step ``at_step`` raises a slice-loss error although every slice is healthy."""
        return self._add(Fault(kind="transient", at_step=at_step))

    def hang_step(self, *, at_step: int, slice: int | None = None) -> Faults:
        """Step ``at_step``'s computation never completes (a hung collective) until the step watchdog
        (``step_timeout_s``) aborts it. ``slice=None``: every slice stays healthy (a transient hang, retried
        from the snapshot); ``slice=k``: slice k stays wedged (its probe fails), so the job shrinks without it
        (its agent still beats; ``revive_slice(k)`` brings it back)."""
        return self._add(Fault(kind="hang", slice=slice, at_step=at_step))

    def kill_client(self, *, at_step: int) -> Faults:
        """The client process is SIGKILLed as step ``at_step`` starts (a crashed driver): nothing unwinds,
        and the job's detached actors, keepers included, are left for a new client to take over."""
        return self._add(Fault(kind="kill_client", at_step=at_step))

    def restart_supervisor(self, *, at_step: int) -> Faults:
        """The job's supervisor actor is killed as step ``at_step`` starts; Ray restarts it and it rebuilds its view
        from the job's event stream (the job carries on; a slice lost after it is still seen). Both modes."""
        return self._add(Fault(kind="supervisor_restart", at_step=at_step))

    def _add(self, fault: Fault) -> Faults:
        for name in ("at_step", "slice"):
            value = getattr(fault, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{fault.kind} {name} must be an int, got {value!r} of type {type(value).__name__}")
        if not isinstance(fault.hold, bool):
            raise ConfigError(f"{fault.kind} hold must be True or False, got {fault.hold!r}")
        if fault.at_step < 0:
            raise ConfigError(f"{fault.kind} at_step must be 0 or more, got {fault.at_step}")
        self._faults.append(fault)
        return self

    @property
    def faults(self) -> tuple[Fault, ...]:
        """The planned faults, ordered by step."""
        return tuple(sorted(self._faults, key=lambda f: f.at_step))

    def validate(self, *, num_slices: int, num_steps: int) -> None:
        """Raise :class:`ConfigError` for a fault that could never happen as written."""
        down: set[int] = set()
        for f in self.faults:
            if f.at_step >= num_steps:
                raise ConfigError(f"{f.kind} at step {f.at_step} is past the last step {num_steps - 1}")
            if f.slice is not None and not 0 <= f.slice < num_slices:
                raise ConfigError(f"{f.kind} names slice {f.slice}; slices are 0..{num_slices - 1}")
            if f.kind == "revive":
                if f.slice not in down:
                    raise ConfigError(f"revive_slice({f.slice}) at step {f.at_step}: that slice is not down then")
                down.discard(f.slice)
            elif f.kind in ("kill", "silence") or (f.kind == "hang" and f.slice is not None):
                down.add(f.slice)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._faults)

    def injector(self, handles: JobHandles) -> DriverHook:
        """The before-step hook that carries this plan out through a job's ``handles``; in multi-process mode the
        driver's half of it (see :meth:`worker_hooks`)."""
        from elastic.chaos.injector import DriverFaults, FaultInjector

        placed = [f for f in self.faults if f.during != "step"]
        if placed and not handles.multi:
            raise ConfigError(
                f"kill_slice(during={placed[0].during!r}) needs multi-process mode (worker processes); "
                "in single-process mode the chaos runner's phases place a kill inside a step or a "
                "restore"
            )
        return (DriverFaults if handles.multi else FaultInjector)(self.faults, handles)

    def worker_hooks(self) -> list[WorkerHook]:
        """Multi-process mode: the step hooks each worker runs to carry out its share of this plan."""
        from elastic.chaos.injector import WorkerFaults

        hooks = WorkerFaults(self.faults)
        return [hooks] if hooks.faults else []
