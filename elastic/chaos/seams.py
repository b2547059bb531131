"""Where the chaos runner strikes inside a run: it wraps the user's loop and its ``run``.

``Seams.loop(user_loop)`` is the loop the job runs. On entering a pass it fires the ``after_restore`` /
``after_reshard`` / ``after_grow`` faults (the timeline says what preceded the pass); the ``run`` the user
loop receives fires ``step`` faults as each step starts (after ``elastic.Faults``' own), ``mid_step``
faults before ``commit`` waits for the step, and ``snapshot`` faults right after it. It also records
every commit in order (recomputed ones included), which the bounded-loss check reads. ``Seams.during`` is
the job's ``during_prepare`` hook: it fires the ``restore`` / ``reshard`` / ``grow`` faults inside the move. A
notice due at any of these phases is handed to the schedule's :class:`~elastic.chaos.notices.NoticeGiver`, and the
loop waits until it is taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from elastic.api.job import ElasticJob
from elastic.chaos import effects
from elastic.chaos.catalogue import ChaosFault, Schedule
from elastic.chaos.fault import Fault
from elastic.chaos.injector import FaultInjector, snapshotter_of
from elastic.chaos.notices import NoticeGiver
from elastic.log import get_logger
from elastic.loop.run import Run
from elastic.snapshot.testing import flip_byte

__all__ = ["Seams"]

HOLD_S = 5.0  # past heartbeat_timeout_s: how long a silenced slice's step waits for the supervisor to drop it


class Seams:
    def __init__(self, schedule: Schedule, job: ElasticJob, notices: NoticeGiver | None = None) -> None:
        self._job = job
        self._notices = notices
        self._pending = list(schedule.seams()) + [f for f in schedule.notices() if f.kind == "notice"]
        self._silences = {f.at_step: f.slice for f in schedule.faults if f.kind == "silence"}
        self._injector = FaultInjector((), job.handles)
        self._events_seen = 0
        self._slices: tuple[int, ...] | None = None
        self._reached = -1  # the highest step started
        self._log = get_logger("elastic.chaos.catalogue", job=job.config.job_name)

    def loop(self, user_loop: Callable[[Run], Any]) -> Callable[[Run], Any]:
        def chaos_loop(run: Run) -> Any:
            self._entered(run)
            return user_loop(ChaosRun(run, self))  # type: ignore[arg-type]

        return chaos_loop

    def during(self, phase: str, step: int, view: Any) -> None:
        """The job's ``during_prepare`` hook: inject the faults due inside this restore or move (the first once
        the loop has reached their step)."""
        due = [f for f in self._pending if f.phase == phase and self._reached >= f.at_step]
        for fault in due:
            self._pending.remove(fault)
            self._inject(fault, None, step)

    def _entered(self, run: Run) -> None:
        events = self._job.timeline.events
        kinds = {e["event"] for e in events[self._events_seen :]}
        self._events_seen = len(events)
        before, self._slices = self._slices, run.slices
        if before is None:
            return
        if "restored" in kinds:
            self.fire("after_restore", run, run.start_step)
        elif "resharded" in kinds:
            self.fire("after_grow" if len(run.slices) > len(before) else "after_reshard", run, run.start_step)

    def fire(self, phase: str, run: Run, step: int) -> None:
        """Inject the faults due at ``phase`` of ``step`` (an ``after_*`` fault: at the first such pass once the
        loop has reached its step)."""
        if phase == "step":
            self._reached = max(self._reached, step)
            if self._notices is not None and step == self._job.config.num_steps - 1:
                self._notices.hold()  # a deadline strikes inside the run, however fast it went
            if step in self._silences:
                self._hold(run, self._silences.pop(step))
        due = [
            f
            for f in self._pending
            if f.phase == phase
            and (f.at_step == step if not phase.startswith("after_") else self._reached >= f.at_step)
        ]
        for fault in due:
            self._pending.remove(fault)
            self._inject(fault, run, step)

    def _inject(self, fault: ChaosFault, run: Run | None, step: int) -> None:
        self._log.warning("chaos_fault", kind=fault.kind, phase=fault.phase, slice=fault.slice, step=step)
        if fault.kind == "notice":
            assert self._notices is not None, "a schedule with notices needs its NoticeGiver"
            self._notices.give(fault, step, wait=True)
        elif fault.kind in ("supervisor_restart", "supervisor_lost"):
            for_good = fault.kind == "supervisor_lost"
            self._job.timeline.add(f"inject_{fault.kind}", step=step)
            self._job.report.failures_injected += 1
            effects.restart_supervisor(self._job.handles, for_good=for_good)  # restartable: Ray starts it again
        elif fault.kind == "straggler":
            self._job.timeline.add("inject_straggler", step=step, seconds=fault.seconds)
            time.sleep(fault.seconds or 0.0)
        elif fault.kind == "corrupt":
            self._corrupt(step)
            self._injector.fire(Fault(kind="transient", at_step=step))  # the restore reads the corrupt copy
        else:
            self._injector.fire(Fault(kind=fault.kind, at_step=step, slice=fault.slice))  # type: ignore[arg-type]  # the kinds Fault takes

    def _corrupt(self, step: int) -> None:
        """Flip a byte of the first copy of a piece of the newest complete snapshot."""
        snaps = snapshotter_of(self._job.handles)
        snaps.wait_quietly()
        gen = snaps.generation()
        leaf = next(i for i, rec in enumerate(gen.leaves) if rec.is_array and rec.pieces)
        changed = flip_byte(snaps, leaf=leaf, piece=0, copy=0, byte=step)
        self._job.timeline.add("inject_corrupt", step=step, snapshot_step=gen.step, leaf=leaf, buffers=changed)

    def _hold(self, run: Run, slice_: int | None) -> None:
        """A silenced agent: wait (bounded) until the supervisor drops its slice, as a step on a hung host would."""
        cfg = self._job.config
        deadline = time.monotonic() + cfg.heartbeat_timeout_s + HOLD_S
        supervisor, epoch = self._job.group.supervisor, run.epoch
        while (left := deadline - time.monotonic()) > 0:
            view = ray.get(supervisor.wait_for_epoch.remote(epoch, left), timeout=left + 10)
            if slice_ not in view.active or view.gave_up is not None:
                return
            epoch = view.epoch
        self._log.warning("silenced_slice_still_active", slice=slice_)


class ChaosRun:
    """The user's ``run``, with the chaos seams around its steps and commits; everything else is the run's."""

    def __init__(self, run: Run, seams: Seams) -> None:
        self._run = run
        self._seams = seams
        self._step = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    @property
    def steps(self) -> Iterator[int]:
        return self._iterate(self._run.steps)

    def _iterate(self, steps: Iterator[int]) -> Iterator[int]:
        for step in steps:
            self._step = step
            self._seams.fire("step", self._run, step)
            yield step

    def commit(self, state: Any, **kwargs: Any) -> None:
        step = self._step
        self._seams.fire("mid_step", self._run, step)
        self._run.commit(state, **kwargs)
        self._seams.fire("snapshot", self._run, step)
