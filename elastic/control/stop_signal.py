"""A signal to the driver as "save and stop": ``ElasticJob(stop_signal="SIGTERM")``.

A scheduler that ends a whole job warns its entry point first: Slurm's ``--signal=B:TERM@secs`` before the
allocation's time limit, Kubernetes' SIGTERM before ``terminationGracePeriodSeconds``. While ``job.run`` runs,
:class:`StopOnSignal` turns the first such signal into ``stop(reason)``: the job saves its state to the persistent
tier at the next step boundary and ``run`` returns, the report saying where it stopped. A second signal, a second or
more after the first, ends the process at once (``SystemExit(128 + signum)``), as the signal's default would have;
closer together they count as one (a scheduler signalling a whole process tree while a launcher forwards it too).
The handler only records the request: the controller acts on it at the boundary.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic.errors import ConfigError

__all__ = ["StopOnSignal", "check_signal"]

SAME_SIGNAL_S = 1.0  # signals this close to the first are the same request delivered twice


def check_signal(name: str | None) -> str | None:
    """``name`` when it is a signal a process can catch ("SIGTERM", "SIGUSR1"...); ``ConfigError`` otherwise."""
    if name is None:
        return None
    if not (isinstance(name, str) and name.startswith("SIG") and hasattr(signal, name)) or name in (
        "SIGKILL",
        "SIGSTOP",
    ):
        raise ConfigError(
            f"stop_signal is the name of a signal a process can catch ('SIGTERM'...) or None; got {name!r}"
        )
    return name


class StopOnSignal:
    """While entered (on the main thread; elsewhere nothing is installed): the first ``name`` calls
    ``stop(reason)``, a later one (``SAME_SIGNAL_S`` on) raises ``SystemExit(128 + signum)``. The previous handler
    comes back on exit."""

    def __init__(self, name: str | None, stop: Callable[[str], Any], log: Any) -> None:
        self._name = name
        self._stop = stop
        self._log = log
        self._previous: Any = None
        self.received = 0
        self.first_at: float | None = None  # time.monotonic() of the first signal

    def __enter__(self) -> StopOnSignal:
        if self._name is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(getattr(signal, self._name), self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(getattr(signal, str(self._name)), self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received += 1
        if self.first_at is not None:
            if time.monotonic() - self.first_at >= SAME_SIGNAL_S:
                raise SystemExit(128 + signum)
            return
        self.first_at = time.monotonic()
        reason = f"{self._name} to the driver (pid {os.getpid()})"
        self._log.warning("stop_signal", signal=self._name, reason=reason)
        self._stop(reason)
