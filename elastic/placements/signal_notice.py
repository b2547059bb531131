"""A signal to a slice's worker process as a notice that the slice will go (``NoticeSources.signal``).

A scheduler that takes a host away signals its processes first and ends them a grace period later: Kubernetes sends
SIGTERM and waits ``terminationGracePeriodSeconds``; Slurm's ``--signal=TERM@secs`` warns before a time limit or a
preemption. :class:`SignalNotice` turns the first such signal into a notice for the worker's own slice (down the one
notice path: ``Supervisor.agent_notice``, the agents' credential), so that the job leaves the slice at a step
boundary. The process ends at the grace period's end whether it has left or not (the scheduler would end it then in
any case); a second signal ends it at once, as Ray's own handler would have.

Installed from the worker's ``__init__``: a threaded Ray actor runs it on the process's main thread, the only one
that may set a signal handler. The handler only starts a thread: it runs between two bytecodes of whatever the
main thread was running.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SignalNotice"]

EXIT_ON_SECOND = 128  # + the signal's number: the shell's convention for "ended by signal N"


class SignalNotice:
    """On ``name`` (a signal's name): ``give(deadline, reason)`` once, from a thread; the process exits with
    ``128 + signum`` at ``deadline`` unless it exited first (``departed``), or at once on a second signal."""

    def __init__(
        self, name: str, grace_s: float, give: Callable[[float, str], Any], log: Any, *, exit: Callable[[int], Any]
    ) -> None:
        self._signum = getattr(signal, name)
        self._name = name
        self._grace_s = grace_s
        self._give = give
        self._log = log
        self._exit = exit
        self._lock = threading.Lock()
        self.received_at: float | None = None  # wall clock of the first signal
        self.deadline: float | None = None

    def install(self) -> bool:
        """Set the handler (False, and nothing set, off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            self._log.warning("signal_notice_not_installed", signal=self._name, why="not on the main thread")
            return False
        signal.signal(self._signum, self._handle)
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        with self._lock:
            first = self.received_at is None
            if first:
                self.received_at = time.time()
                self.deadline = self.received_at + self._grace_s
        if not first:
            self._exit(EXIT_ON_SECOND + signum)
            return
        threading.Thread(target=self._notify, name="signal-notice", daemon=True).start()
        timer = threading.Timer(self._grace_s, self._exit, args=(EXIT_ON_SECOND + signum,))
        timer.daemon = True
        timer.start()

    def _notify(self) -> None:
        assert self.deadline is not None
        reason = f"{self._name} to the slice's worker (pid {os.getpid()}); it goes within {self._grace_s:g}s"
        try:
            self._give(self.deadline, reason)
            self._log.warning("signal_notice_given", signal=self._name, grace_s=self._grace_s)
        except Exception as err:  # noqa: BLE001 - refused or undelivered: the slice goes at the deadline, a failure then
            self._log.warning("signal_notice_refused", signal=self._name, error=str(err).splitlines()[0][:200])
