"""The client's share of the job's event stream: its timeline, and progress every few seconds.

``ClientEvents(stream, tiers).attach(accounting)`` passes every timeline event on as a ``timeline`` record
and, after commits, writes a ``progress`` record (step, steps per second since the last one, slices, epoch,
the newest complete snapshot and its deepest tier) at most every ``every_s`` seconds, and at once when the
slices change. Each is written behind the caller, in order (``EventStream.append_behind``: a GCS round
trip grows under load, and the recovery path adds several records); ``flush`` waits for them. A failed
write is counted by the stream, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic.control.accounting import Accounting
from elastic.supervision.events import EventStream
from elastic.supervision.membership import View

__all__ = ["ClientEvents", "PROGRESS_EVERY_S"]

PROGRESS_EVERY_S = 5.0


class ClientEvents:
    def __init__(
        self, stream: EventStream, snapshot: Callable[[], tuple[int, str] | None], *, every_s: float = PROGRESS_EVERY_S
    ) -> None:
        self.stream = stream
        self._snapshot = snapshot
        self._every_s = every_s
        self._last: tuple[float, int] | None = None  # (monotonic time, step) of the last progress record
        self._active: frozenset[int] | None = None  # ``view.active`` of the last progress record

    def attach(self, accounting: Accounting) -> ClientEvents:
        accounting.timeline.sinks.append(self.on_event)
        accounting.commit_sinks.append(self.on_commit)
        return self

    def on_event(self, record: dict[str, Any]) -> None:
        self.stream.append_behind("timeline", **record)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record passed on so far is written (the run's end, before its stream is read)."""
        return self.stream.flush(timeout_s)

    def on_commit(self, step: int, view: View) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self._every_s and view.active == self._active:
            return  # every commit's case: nothing to write
        slices = tuple(sorted(view.active))
        rate = None
        if self._last is not None and now > self._last[0] and step > self._last[1]:
            rate = round((step - self._last[1]) / (now - self._last[0]), 3)
        snap = self._snapshot()
        self.stream.append_behind(
            "progress",
            step=step,
            steps_per_s=rate,
            slices=list(slices),
            epoch=view.epoch,
            snapshot_step=snap[0] if snap else None,
            snapshot_tier=snap[1] if snap else None,
        )
        self._last, self._active = (now, step), view.active
