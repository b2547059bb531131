"""The loop's stall reporter: a hang the step watchdog cannot interrupt is at least loud.

``run.commit`` bounds the wait for a step's device work (``runtime.StepHungError``). A hang elsewhere in
the loop's thread (the user's data loader, a ``float(loss)`` on a hung step before ``commit``, a host-side
deadlock) blocks inside code that Python cannot interrupt. This thread notices when the loop has made no
progress (no step started or committed) for ``after_s`` and logs, once per stall, where the loop's thread
is (its stack), and marks the timeline; the job does not recover from it by itself.
"""

from __future__ import annotations

import threading
import time
import traceback
from sys import _current_frames
from typing import Any

from elastic.control.report import Timeline

__all__ = ["StallReporter"]


class StallReporter:
    """Watches the thread that calls :meth:`start`; :meth:`progress` on every step started or committed."""

    def __init__(self, after_s: float | None, *, log: Any, timeline: Timeline) -> None:
        self._after_s = after_s
        self._log = log
        self._timeline = timeline
        self._lock = threading.Lock()
        self._since: float | None = None  # when the loop last made progress (None: not in a pass)
        self._step: int | None = None
        self._reported = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread = 0

    def start(self) -> None:
        if self._after_s is None or self._thread is not None:
            return
        self._loop_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="elastic-stall-reporter", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        with self._lock:
            self._since, self._step, self._reported = time.monotonic(), step, False

    def idle(self) -> None:
        """The loop is not running a step (between passes: the controller's own waits are bounded)."""
        with self._lock:
            self._since = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _watch(self) -> None:
        assert self._after_s is not None
        while not self._stop.wait(min(self._after_s / 4, 5.0)):
            with self._lock:
                if self._since is None or self._reported or time.monotonic() - self._since < self._after_s:
                    continue
                self._reported = True
                step, stalled_s = self._step, time.monotonic() - self._since
            frame = _current_frames().get(self._loop_thread)  # the stdlib's way to see a thread
            where = "".join(traceback.format_stack(frame, limit=8)) if frame is not None else "unknown"
            self._timeline.add("stalled", step=step, seconds=round(stalled_s, 1))
            self._log.error(
                "loop_stalled",
                step=step,
                seconds=round(stalled_s, 1),
                where=where,
                hint="no step started or committed: 'where' is the loop's thread (run.commit's wait is "
                "bounded by step_timeout_s; a data loader, a host sync such as float(loss) on a "
                "hung step, or a deadlock elsewhere is not)",
            )
