"""The client's copy of the membership view, kept current by a background thread.

The thread long-polls ``Supervisor.wait_for_epoch`` (the supervisor answers when the epoch changes,
or after ``poll_s``), so the training loop reads the latest view without any remote call, and
``wait_for`` blocks on a condition variable with a bound.

A supervisor that Ray restarts answers again once its new process has replayed its log: seconds, or tens of
seconds on a loaded machine (calls wait for it meanwhile; a call that gets no answer within ``poll_s`` and a grace is
given up and asked again, since one in flight when the actor died may never be answered). The supervisor is gone for
good when Ray says its actor died (``ActorDiedError``: it will not be restarted), or when it has answered no call for
``lost_after_s`` (alive but stuck): from then on ``view`` and ``wait_for`` raise
:class:`~elastic.errors.SupervisorLostError` (a waiter already blocked wakes at once), so the job ends with a clear
error instead of waiting out ``recovery_timeout_s``, or training on unsupervised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from elastic.config import ElasticConfig
from elastic.errors import GiveUpError, RecoveryTimeoutError, SupervisorLostError
from elastic.log import get_logger
from elastic.supervision.membership import View

__all__ = ["ViewWatcher", "supervisor_lost_after_s", "LOST_AFTER_S"]


def supervisor_lost_after_s(config: ElasticConfig) -> float:
    """How long a supervisor may stay silent before the job counts it gone for good: 5 heartbeat timeouts, at
    least 60 s. Silence is what a restart looks like (Ray starts a new process, which replays its log): on a loaded
    small machine that takes seconds to the new actor's first breath and tens of seconds to its first answer.
    A supervisor Ray reports dead is not waited for (see :class:`ViewWatcher`)."""
    return max(5 * config.heartbeat_timeout_s, 60.0)


_SLICE_S = 0.1  # how often a waiting call looks at the stop flag (stop returns within this)

LOST_AFTER_S = supervisor_lost_after_s(ElasticConfig())  # for the default configuration: 60 s


class ViewWatcher:
    def __init__(
        self, supervisor: Any, initial: View, *, job: str, poll_s: float = 2.0, lost_after_s: float = LOST_AFTER_S
    ) -> None:
        self._supervisor = supervisor
        self._view = initial
        self._job = job
        self._poll_s = poll_s
        self._lost_after_s = lost_after_s
        # One call may be lost across a supervisor restart (it was in flight when the actor died): it is given up
        # after this grace and a fresh one asked, so only lost_after_s of silence from every call counts as lost.
        self._call_grace_s = min(lost_after_s / 2, 5.0)
        self._lost: str | None = None  # why the supervisor counts as gone for good
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._log = get_logger("elastic.control.watcher", job=job)
        self._unreachable = False
        self._thread = threading.Thread(target=self._run, name="elastic-view-watcher", daemon=True)
        self._thread.start()

    @property
    def view(self) -> View:
        """The newest view seen (no remote call); raises ``SupervisorLostError`` once the supervisor is gone."""
        self._raise_if_lost()
        return self._view

    @property
    def supervisor_lost(self) -> SupervisorLostError | None:
        """Why the supervisor counts as gone for good, or None while it answers (or may still come back)."""
        return None if self._lost is None else SupervisorLostError(self._lost)

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise SupervisorLostError(self._lost)

    def _run(self) -> None:
        contact = time.monotonic()  # the last answer from the supervisor
        while not self._stop.is_set():
            try:
                ref = self._supervisor.wait_for_epoch.remote(self._view.epoch, self._poll_s)
                view = self._answer(ref)
                if view is None:  # stopped while waiting
                    return
            except ray.exceptions.ActorDiedError as err:  # dead, not restarting: Ray will not start it again
                if not self._stop.is_set():
                    self._give_up(err, time.monotonic() - contact)
                return
            except Exception as err:  # noqa: BLE001 - a restarting supervisor; retry with a bound pause
                if self._stop.is_set():
                    return
                silent = time.monotonic() - contact
                if silent > self._lost_after_s:
                    self._give_up(err, silent)
                    return
                if not self._unreachable:
                    self._log.warning("supervisor_unreachable", error=repr(err))
                    self._unreachable = True
                self._stop.wait(0.5)
                continue
            contact = time.monotonic()
            if self._unreachable:
                self._log.info("supervisor_reachable_again")
                self._unreachable = False
            if view.epoch > self._view.epoch:
                with self._cond:
                    self._view = view
                    self._cond.notify_all()

    def _answer(self, ref: Any) -> View | None:
        """The call's answer, waited for in short slices so that ``stop`` returns at once (None once stopped);
        raises ``GetTimeoutError`` past ``poll_s`` and the grace."""
        deadline = time.monotonic() + self._poll_s + self._call_grace_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ray.exceptions.GetTimeoutError(
                    f"no answer to wait_for_epoch within {self._poll_s + self._call_grace_s:.1f}s"
                )
            ready, _ = ray.wait([ref], timeout=min(_SLICE_S, left))
            if ready:
                view: View = ray.get(ready[0])
                return view
        return None

    def _give_up(self, err: Exception, silent: float) -> None:
        why = (
            "Ray reports its actor dead and will not restart it"
            if isinstance(err, ray.exceptions.ActorDiedError)
            else f"no answer for {silent:.1f}s (more than {self._lost_after_s:.1f}s)"
        )
        reason = (
            f"the supervisor of job {self._job!r} is gone: {why} (last error: {type(err).__name__}: "
            f"{(str(err).splitlines() or [''])[0]}); without it no failure can be detected or recovered, "
            "so the job ends here"
        )
        self._log.error("supervisor_lost", silent_s=round(silent, 1), error=repr(err), epoch=self._view.epoch)
        with self._cond:
            self._lost = reason
            self._cond.notify_all()

    def offer(self, view: View) -> None:
        """A view the supervisor answered another call with (its reply to ``report_lost``): taken when newer, so
        a waiter need not wait for the long poll to bring the same view."""
        with self._cond:
            if view.epoch > self._view.epoch:
                self._view = view
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[View], bool], timeout_s: float, *, what: str) -> View:
        """The first view satisfying ``predicate``; raises on give-up, on losing the supervisor for good, or
        after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_if_lost()
                view = self._view
                if view.gave_up is not None:
                    raise GiveUpError(view.gave_up, epoch=view.epoch)
                if predicate(view):
                    return view
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoveryTimeoutError(
                        f"no membership view with {what} within {timeout_s}s (last: epoch {view.epoch}, "
                        f"slices {sorted(view.active)}, reason {view.reason!r})"
                    )
                self._cond.wait(left)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
