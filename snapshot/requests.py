"""The requests between a Snapshotter's training thread and its copy thread: at most one waiting (``pending``) and
one being copied (``in_flight``). A save while one waits replaces it (``on_busy="coalesce"``, counted) or waits
until it starts (``on_busy="wait"``); nothing is dropped without being counted."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from .errors import SnapshotConfigError, SnapshotFailedError
from .staged import StagedRequest

__all__ = ["Requests"]

log = structlog.get_logger("snapshot")


class Requests:
    """``cv`` guards the requests (and whatever else its owner shares between its threads); ``stats``: the owner's
    counters, which it counts requests, waits, coalesced, abandoned and failed saves into."""

    def __init__(self, on_busy: str, stats: dict[str, Any]) -> None:
        self.cv = threading.Condition()
        self.pending: StagedRequest | None = None
        self.in_flight: StagedRequest | None = None
        self.closed = False
        self._on_busy = on_busy
        self._stats = stats
        self._error: SnapshotFailedError | None = None
        self._numbers = 0

    def submit(self, step: int, make: Callable[[int], StagedRequest]) -> StagedRequest:
        """Queue the request ``make(number)`` builds (under the lock) as the one waiting."""
        with self.cv:
            if self.closed:
                raise SnapshotConfigError("the snapshotter is closed")
            self._numbers += 1
            req = make(self._numbers)
            self._stats["snapshots_requested"] += 1
            if self.pending is not None and self._on_busy == "wait":
                self._stats["snapshots_waited"] += 1
                self.cv.wait_for(lambda: self.pending is None or self.closed)
            if self.pending is not None:
                self._stats["snapshots_coalesced"] += 1
                # Said once at info (saves come faster than copies), then at debug: a line per save costs the loop.
                say = log.info if self._stats["snapshots_coalesced"] == 1 else log.debug
                say("snapshot_coalesced", step=self.pending.step, replaced_by=step)
            self.pending = req
            self.cv.notify_all()
        return req

    def take(self) -> StagedRequest | None:
        """The copy thread's next request, now in flight (None: closed, nothing waiting)."""
        with self.cv:
            self.cv.wait_for(lambda: self.pending is not None or self.closed)
            req, self.pending = self.pending, None
            self.in_flight = req
            self.cv.notify_all()
        return req

    def settle(self, counter: str | None = None, error: SnapshotFailedError | None = None) -> None:
        """The request in flight is done (``counter``: counted as abandoned or failed, with ``error`` to raise)."""
        with self.cv:
            if counter is not None:
                self._stats[counter] += 1
            if error is not None:
                self._error = error
            self.in_flight = None
            self.cv.notify_all()

    @property
    def busy(self) -> int:
        """How many requests wait or are in flight. Hold ``cv``."""
        return (self.pending is not None) + (self.in_flight is not None)

    def abandon_through(self, number: int | None) -> int:
        """Abandon the waiting and the in-flight request numbered ``number`` or less (None: any); how many. The
        waiting one is dropped (counted), the one in flight stops before its next piece. Hold ``cv``."""
        count = 0
        if self.pending is not None and (number is None or self.pending.number <= number):
            self.pending.abandoned = True
            self.pending = None
            self._stats["snapshots_abandoned"] += 1
            count += 1
        if self.in_flight is not None and (number is None or self.in_flight.number <= number):
            self.in_flight.abandoned = True
            count += 1
        return count

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing waits or is in flight; False past ``timeout`` seconds. Hold ``cv``."""
        return self.cv.wait_for(lambda: self.pending is None and self.in_flight is None, timeout)

    def failure(self) -> SnapshotFailedError | None:
        """The failed save not yet raised (once). Hold ``cv``."""
        error, self._error = self._error, None
        return error

    def close(self, timeout: float) -> None:
        """Wait (bounded) until idle, then take no more; a request still waiting past the bound is counted."""
        with self.cv:
            self.idle(timeout)
            self.closed = True
            if self.pending is not None:  # past the bound: counted, never silent
                self._stats["snapshots_coalesced"] += 1
                log.warning("snapshot_abandoned_at_close", step=self.pending.step)
                self.pending = None
            self.cv.notify_all()
