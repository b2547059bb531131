"""The client's copy of the membership view, kept current by a background thread.

The thread long-polls ``Supervisor.wait_for_epoch`` (the supervisor answers when the epoch changes,
or after ``poll_s``), so the training loop reads the latest view without any remote call, and
``wait_for`` blocks on a condition variable with a bound.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from elastic.errors import GiveUpError, RecoveryTimeoutError
from elastic.log import get_logger
from elastic.membership import View

__all__ = ["ViewWatcher"]


class ViewWatcher:
    def __init__(self, supervisor: Any, initial: View, *, job: str, poll_s: float = 2.0) -> None:
        self._supervisor = supervisor
        self._view = initial
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._log = get_logger("elastic.watcher", job=job)
        self._unreachable = False
        self._thread = threading.Thread(target=self._run, name="elastic-view-watcher", daemon=True)
        self._thread.start()

    @property
    def view(self) -> View:
        return self._view

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ref = self._supervisor.wait_for_epoch.remote(self._view.epoch, self._poll_s)
                view = ray.get(ref, timeout=self._poll_s + 30)
                if self._unreachable:
                    self._log.info("supervisor_reachable_again")
                    self._unreachable = False
            except Exception as err:  # noqa: BLE001 - a restarting supervisor; retry with a bound pause
                if not self._unreachable:
                    self._log.warning("supervisor_unreachable", error=repr(err))
                    self._unreachable = True
                self._stop.wait(0.5)
                continue
            if view.epoch > self._view.epoch:
                with self._cond:
                    self._view = view
                    self._cond.notify_all()

    def wait_for(self, predicate: Callable[[View], bool], timeout_s: float, *, what: str) -> View:
        """The first view satisfying ``predicate``; raises on give-up or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
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
        self._thread.join(timeout=self._poll_s + 5)
