"""A schedule's notices, given to the job as a scheduler gives them: ``job.notice(...)`` from a thread of its own,
then the noticed slice killed where the schedule says (phase ``notice``: as soon as the notice is taken;
``deadline``: when its deadline passes).

Both modes, one giver. Single-process mode gives a notice at its phase through the runner's seams and waits for it
to be taken (a notice given as a step starts is in before the step's body, so the job leaves at the next boundary),
and the run's last step waits for a kill still due at a deadline (:meth:`NoticeGiver.hold`), so that it strikes
while the job runs. Multi-process mode gives it from the driver once the group has committed its step, and holds
the driver's last commit likewise (:meth:`NoticeGiver.reached`). What differs, how a slice is killed, is the
``aim`` the runner passes: called with a slice as its notice is given, it returns what kills that slice's host of
that moment (:func:`aim_for`).

Every notice given is recorded (:attr:`NoticeGiver.given`: its reason, the one ``report.notice_details`` carries,
its deadline, whether it was refused, when its slice was killed): the invariants read it
(:func:`elastic.chaos.invariants.notices_recompute_nothing`). :meth:`NoticeGiver.close` at the run's end cancels
the kills not yet due, so none strikes the next run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from elastic.chaos import effects
from elastic.chaos.catalogue import ChaosFault, Schedule
from elastic.chaos.fault import Fault
from elastic.chaos.injector import FaultInjector
from elastic.errors import NoticeError
from elastic.log import get_logger
from elastic.supervision.membership import View

if TYPE_CHECKING:
    from elastic.api.job import ElasticJob

__all__ = ["NoticeGiver", "aim_for", "view_of"]

BOUND_S = 30.0  # the longest a notice's delivery may hold the loop (single-process mode waits for it)
Aim = Callable[[int, int], Callable[[], None]]  # (slice, step) -> what kills its host of the notice's moment


def view_of(job: ElasticJob) -> Callable[[], View]:
    """The supervisor's newest view of ``job`` (both modes)."""
    return lambda: ray.get(job.group.supervisor.view.remote(), timeout=BOUND_S)


def aim_for(job: ElasticJob) -> Aim:
    """How a noticed slice is killed in ``job``'s mode. Single-process: its simulated devices fail and its agent dies
    (``FaultInjector``'s kill). Multi-process: the worker process that ran the slice when the notice was given is
    killed (``ray.kill``; a worker that already left on the notice has exited, and a newer one is left alone)."""
    if job.config.processes is None:
        injector = FaultInjector((), job.handles)
        return lambda s, step: lambda: injector.fire(Fault(kind="kill", at_step=step, slice=s))

    def aim(s: int, step: int) -> Callable[[], None]:
        handle = job.group.agent(s).handle

        def kill() -> None:
            job.timeline.add("inject_kill", step=step, slice=s)
            job.report.failures_injected += 1
            effects.kill_worker(handle, s)

        return kill

    return aim


class NoticeGiver:
    def __init__(self, schedule: Schedule, job: ElasticJob, aim: Aim, view: Callable[[], View] | None = None) -> None:
        """``view``: the supervisor's newest view (None: not asked), read as each notice is taken to record whether
        the job could spare its slice (``could_leave``: it is leaving, or ``min_slices`` others remain)."""
        faults = schedule.notices()
        self._pending = [f for f in faults if f.kind == "notice"]
        self._kills = [f for f in faults if f.kind == "kill"]
        self._job = job
        self._aim = aim
        self._view = view
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._timers: list[threading.Timer] = []
        self.given: list[dict[str, Any]] = []
        self._log = get_logger("elastic.chaos.notices", job=job.config.job_name)

    def give(self, fault: ChaosFault, step: int, *, wait: bool) -> None:
        """Give ``fault``'s notice now, from a thread of its own (``wait``: until it is taken or refused)."""
        with self._lock:
            if fault not in self._pending or self._closed:
                return
            self._pending.remove(fault)
        thread = threading.Thread(target=self._give, args=(fault, step), name="chaos-notice", daemon=True)
        self._threads.append(thread)
        thread.start()
        if wait:
            thread.join(BOUND_S)

    def reached(self, step: int) -> None:
        """Multi-process mode, from the driver's ``on_step``: give the notices at phase ``step`` due by ``step``; at
        the last step, wait for a kill still due at a deadline (:meth:`hold`)."""
        for fault in [f for f in self._pending if f.phase == "step" and f.at_step <= step]:
            self.give(fault, step, wait=False)
        if step == self._job.config.num_steps - 1:
            self.hold()

    def _give(self, fault: ChaosFault, step: int) -> None:
        assert fault.slice is not None and fault.seconds is not None  # the catalogue's notices name both
        s, seconds = fault.slice, fault.seconds
        kills = [k for k in self._kills if k.slice == s and k.at_step == fault.at_step]
        strike = self._aim(s, step) if kills else None  # the host the notice is about, before anything can replace it
        reason = f"chaos notice {len(self.given)}: slice {s} at step {step}"
        at = time.time()
        record: dict[str, Any] = {"reason": reason, "slices": [s], "seconds": seconds, "step": step, "at": at}
        record.update(deadline=at + seconds, refused=None, could_leave=None, killed_at=None)
        self.given.append(record)
        self._job.timeline.add("inject_notice", step=step, slice=s, seconds=seconds, phase=fault.phase)
        self._log.warning("chaos_notice", slice=s, step=step, seconds=seconds, phase=fault.phase)
        try:
            notice = self._job.notice(s, seconds, reason)
            record.update(at=notice.at, deadline=notice.deadline, could_leave=self._could_leave(s))
        except NoticeError as err:  # a deadline already past as it arrived, a slice already gone: the job unchanged
            record["refused"] = str(err)
            self._log.info("chaos_notice_refused", slice=s, why=str(err))
        for kill in kills:
            assert strike is not None
            if kill.phase == "notice":
                self._strike(record, strike, not_before=None)
                continue
            due = record["deadline"]
            timer = threading.Timer(max(due - time.time(), 0.0), self._strike, (record, strike), {"not_before": due})
            timer.daemon = True
            with self._lock:
                if self._closed:
                    return
                self._timers.append(timer)
            timer.start()

    def _could_leave(self, s: int) -> bool | None:
        """Whether the supervisor's view, as the notice is taken, lets the job leave slice ``s``."""
        if self._view is None:
            return None
        try:
            view = self._view()
        except Exception as err:  # noqa: BLE001 - unknown: the invariant does not judge on it
            self._log.info("chaos_notice_view_unread", slice=s, error=type(err).__name__)
            return None
        return s in view.leaving or len(view.active - {s}) >= self._job.config.policy.min_slices

    def _strike(self, record: dict[str, Any], strike: Callable[[], None], *, not_before: float | None) -> None:
        """Kill the noticed slice (``not_before``: its deadline, by the wall clock the notice's deadline is on)."""
        while not_before is not None and (early := not_before - time.time()) > 0 and not self._closed:
            time.sleep(min(early, 0.05))
        with self._lock:
            if self._closed:
                return
            record["killed_at"] = time.time()
        self._log.warning("chaos_notice_kill", slices=record["slices"], reason=record["reason"])
        strike()

    def hold(self) -> None:
        """Wait (bounded) until the kills due at a deadline have struck, so that the deadline falls inside the run
        however fast the job went: single-process mode as its last step starts, multi-process mode as the driver
        takes the last commit. The job must have left the slice by then; if it has not, the kill fails its step (or
        its end) and the failure path shows in the report."""
        with self._lock:
            timers = list(self._timers)
        until = time.monotonic() + BOUND_S
        for timer in timers:
            timer.join(max(until - time.monotonic(), 0.0))

    def close(self) -> None:
        """The run ended: no kill strikes after this; the notice threads are joined (bounded)."""
        with self._lock:
            self._closed = True
            timers, threads = list(self._timers), list(self._threads)
        for timer in timers:
            timer.cancel()
        deadline = time.monotonic() + BOUND_S
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
