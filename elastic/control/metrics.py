"""The job's health as Ray metrics (``ray.util.metrics``), on Ray's metrics endpoint like any Ray metric.

``JobMetrics(job).attach(accounting)`` follows a job's commits (``Accounting.commit_sinks``) and its
timeline (``Timeline.sinks``); ``ElasticJob.start`` does so in every process connected to Ray. Each
metric is tagged ``job``; Ray exports it with a ``ray_`` prefix (a counter also gains ``_total``):

* ``elastic_steps_committed`` (counter): steps committed for the first time in this process.
  ``elastic_steps_recomputed`` (counter): commits of steps already committed once (after a rollback).
* ``elastic_step_seconds`` (histogram): seconds between consecutive commits on the same view.
* ``elastic_slices_active``, ``elastic_epoch`` (gauges): the view the job trains on.
* ``elastic_failures`` (counter): slice-loss errors (or hung steps) caught. ``elastic_recoveries``
  (counter): recoveries from them (the report's ``recoveries``). ``elastic_regroups`` (counter, tag
  ``kind``: shrink/grow): moves of the live state at a step boundary.
* ``elastic_recovery_seconds`` (histogram): the failure caught -> the first step committed after it (the
  report's ``recovery_seconds``); ``elastic_recovery_phase_seconds`` (histogram, tag ``phase``) splits
  it as benchmarks/recovery.py does: ``detect`` (an injected fault -> the error caught; only for
  injected faults, whose moment is known), ``decide`` (-> a view without the slice), ``restore`` (-> the
  state restored or moved onto it), ``first_step`` (-> the first step committed).
* ``elastic_snapshot_blocking_seconds`` (counter): time the loop was held by snapshot requests;
  ``elastic_snapshots_taken`` (counter); ``elastic_snapshot_held_bytes`` (gauge): host memory the copies
  hold. Read from the snapshotter's stats once a second (off the training thread) and at the end.
* ``elastic_goodput`` (gauge): committed-step time over wall time, as benchmarks/goodput.py defines it,
  estimated live: steps gained in the lineage since this process's first commit, times the median of
  the recent steady step times, over the wall time since that commit.

Ray records a histogram's sum from its buckets' midpoints: use the counts, not the sums. Ray drops a
gauge that was not set for two report intervals, so a thread sets the gauges again every second while
the job runs and for a minute after it finished (a job whose process is gone leaves no gauges behind).
Commits are counted on the loop's thread and passed to Ray by the refresher thread once a second (and at the
end): the loop's thread makes no Ray metric call on a steady step. Nothing here raises into training: an error is
logged once and that update is skipped.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from elastic.control.accounting import Accounting
from elastic.log import get_logger
from elastic.supervision.membership import View

__all__ = ["JobMetrics", "STEP_BUCKETS", "RECOVERY_BUCKETS"]

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FAULT_EVENTS = frozenset({"inject_kill", "inject_silence", "inject_hang", "inject_transient"})
REFRESH_S = 1.0  # gauges are set again (and snapshot stats read) this often
LINGER_S = 60.0  # ... until this long after the job finished (a scraper reads the final values)
WINDOW = 100  # steady step times the goodput's median is taken over

_log = get_logger("elastic.control.metrics")
_lock = threading.Lock()
_instruments: dict[str, Any] = {}
_followed: weakref.WeakSet[JobMetrics] = weakref.WeakSet()  # the jobs the refresher keeps fresh


def instruments() -> dict[str, Any]:
    """This process's metric objects, made once (Ray registers a metric name once per process)."""
    with _lock:
        if not _instruments:
            job = ("job",)
            _instruments.update(
                steps=Counter("elastic_steps_committed", "Steps committed for the first time", job),
                recomputed=Counter("elastic_steps_recomputed", "Commits of steps already committed once", job),
                step_s=Histogram(
                    "elastic_step_seconds", "Seconds between consecutive commits on one view", list(STEP_BUCKETS), job
                ),
                slices=Gauge("elastic_slices_active", "Slices the job trains on", job),
                epoch=Gauge("elastic_epoch", "Epoch of the membership view the job trains on", job),
                failures=Counter("elastic_failures", "Slice-loss errors or hung steps caught", job),
                recoveries=Counter("elastic_recoveries", "Recoveries from a caught failure", job),
                regroups=Counter("elastic_regroups", "Live moves at a step boundary", ("job", "kind")),
                recovery_s=Histogram(
                    "elastic_recovery_seconds", "Failure caught -> first step committed", list(RECOVERY_BUCKETS), job
                ),
                phase_s=Histogram(
                    "elastic_recovery_phase_seconds", "A recovery's phases", list(RECOVERY_BUCKETS), ("job", "phase")
                ),
                blocking=Counter("elastic_snapshot_blocking_seconds", "Seconds the loop was held by snapshots", job),
                taken=Counter("elastic_snapshots_taken", "Snapshots completed", job),
                held=Gauge("elastic_snapshot_held_bytes", "Host bytes the snapshot copies hold", job),
                goodput=Gauge("elastic_goodput", "Committed-step time over wall time (estimate)", job),
            )
            threading.Thread(target=_refresh_forever, name="elastic-metrics", daemon=True).start()
        return _instruments


def _refresh_forever() -> None:
    """Ray drops a gauge not set for two report intervals: set the followed jobs' gauges again every second
    (and read their snapshot stats, off the training thread)."""
    while True:
        time.sleep(REFRESH_S)
        for metrics in list(_followed):
            metrics.refresh()


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(method)
    def guarded(self: JobMetrics, *args: Any) -> None:
        try:
            with self._lock:
                method(self, *args)
        except Exception as err:  # noqa: BLE001 - metrics never stop training
            if not self._failed:
                self._failed = True
                _log.warning("metrics_update_failed", job=self.job, error=repr(err))

    return guarded


class JobMetrics:
    """One job's metrics. ``snapshot_stats``: the snapshotter's ``stats()`` (None: no snapshot metrics)."""

    def __init__(
        self,
        job: str,
        *,
        snapshot_stats: Callable[[], dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        try:
            self._m = instruments()
        except Exception as err:  # noqa: BLE001 - no metrics rather than no training
            _log.warning("metrics_unavailable", job=job, error=repr(err))
            self._m = {}
        self._tags = {"job": job}
        self._snapshot_stats = snapshot_stats
        self._clock = clock
        self._lock = threading.Lock()  # the refresher and the stall reporter's events come from other threads
        self._failed = False
        self._gauges: dict[str, float] = {}  # the last value set, set again by the refresher
        self._finished_at: float | None = None
        self._lineage: Callable[[], int] = lambda: 0
        self._high = -1  # the highest step committed in this process (or restored from)
        self._last: tuple[int, int, float] | None = None  # the previous commit: step, epoch, time
        self._steady: deque[float] = deque(maxlen=WINDOW)
        self._anchor: tuple[float, int] | None = None  # the first commit here: time, lineage length
        self._fault_t: float | None = None  # timeline time of the injected fault being recovered from
        self._pending: dict[str, float] = {}  # the recovery in progress: timeline time of each event
        self._seen = {"blocking_seconds": 0.0, "snapshots_taken": 0}
        self._unsent = {"steps": 0, "recomputed": 0}  # commits counted, not yet passed to Ray (``_flush``)
        self._unsent_steps: list[float] = []  # step times observed, likewise

    def attach(self, accounting: Accounting) -> JobMetrics:
        """Follow ``accounting``'s commits and timeline (once: a second attach to it does nothing)."""
        if not self._m or any(isinstance(getattr(s, "__self__", None), JobMetrics) for s in accounting.commit_sinks):
            return self
        self._lineage = lambda: len(accounting.ledger.steps)
        accounting.commit_sinks.append(self.on_commit)
        accounting.timeline.sinks.append(self.on_event)
        _followed.add(self)
        return self

    @_never_raises
    def on_commit(self, step: int, view: View) -> None:
        """Counted here, on the loop's thread, and passed to Ray by the refresher (``_flush``): a Ray metric
        call costs the loop's thread tens of microseconds, five of them per step."""
        now = self._clock()
        if step > self._high:
            self._high = step
            self._unsent["steps"] += 1
        else:
            self._unsent["recomputed"] += 1
        if self._last is not None and step == self._last[0] + 1 and view.epoch == self._last[1]:
            took = now - self._last[2]
            self._unsent_steps.append(took)
            self._steady.append(took)
        self._last = (step, view.epoch, now)
        if self._gauges.get("slices") != len(view.active) or self._gauges.get("epoch") != view.epoch:
            self._set("slices", len(view.active))  # a new view: at once
            self._set("epoch", view.epoch)
        if self._anchor is None:
            self._anchor = (now, self._lineage())
            self._goodput(now)

    def _flush(self) -> None:
        """Pass the commits counted since the last flush on to Ray."""
        m, tags = self._m, self._tags
        for name, count in self._unsent.items():
            if count:
                m[name].inc(count, tags)
                self._unsent[name] = 0
        for took in self._unsent_steps:
            m["step_s"].observe(took, tags)
        self._unsent_steps.clear()

    @_never_raises
    def on_event(self, record: dict[str, Any]) -> None:
        m, tags = self._m, self._tags
        event, t = record["event"], record["t"]
        if isinstance(record.get("slices"), int):
            self._set("slices", record["slices"])
        if isinstance(record.get("epoch"), int):
            self._set("epoch", record["epoch"])
        if event in FAULT_EVENTS:
            if not self._pending and self._fault_t is None:
                self._fault_t = t
        elif event == "failure":
            m["failures"].inc(1, tags)
            self._pending.setdefault("failure", t)
        elif event == "detected":
            m["recoveries"].inc(1, tags)
            self._pending["detected"] = t
        elif event in ("restored", "resharded"):
            if self._pending:
                self._pending["restored"] = t
            if event == "restored":  # a new client resuming a job counts on from the restored step
                self._high = max(self._high, int(record.get("step", 0)) - 1)
        elif event == "first_step":
            self._recovered(t)
        elif event in ("shrink", "grow", "leave"):  # a leave: slices left on notice
            m["regroups"].inc(1, {**tags, "kind": event})
            if not self._pending:
                self._fault_t = None  # the fault (if any) was handled at a boundary, without an error
        elif event == "finished":
            self._flush()
            self._read_snapshot_stats()
            self._goodput(self._clock())
            self._finished_at = self._clock()
            self._snapshot_stats = None  # the final figures are in; hold no reference to the job

    @_never_raises
    def refresh(self) -> None:
        """Set the gauges again (Ray drops a gauge not set for two report intervals), and while the job runs,
        read the snapshot stats and let the goodput fall during a stall; stop ``LINGER_S`` after the end."""
        now = self._clock()
        if self._finished_at is not None and now - self._finished_at > LINGER_S:
            _followed.discard(self)
            return
        if self._finished_at is None:
            self._flush()
            self._read_snapshot_stats()
            self._goodput(now)
        for name, value in self._gauges.items():
            self._m[name].set(value, self._tags)

    def _set(self, gauge: str, value: float) -> None:
        self._gauges[gauge] = value
        self._m[gauge].set(value, self._tags)

    def _goodput(self, now: float) -> None:
        if self._anchor is not None and self._steady and now > self._anchor[0]:
            useful = (self._lineage() - self._anchor[1]) * statistics.median(self._steady)
            self._set("goodput", min(max(useful / (now - self._anchor[0]), 0.0), 1.0))

    def _recovered(self, t: float) -> None:
        """Observe the recovery that ``first_step`` at time ``t`` ends, and its phases."""
        p, tags = self._pending, self._tags
        failure, detected, restored = p.get("failure"), p.get("detected"), p.get("restored")
        phases = {
            "detect": failure - self._fault_t if failure is not None and self._fault_t is not None else None,
            "decide": detected - failure if detected is not None and failure is not None else None,
            "restore": restored - detected if restored is not None and detected is not None else None,
            "first_step": t - restored if restored is not None else None,
        }
        if failure is not None:
            self._m["recovery_s"].observe(max(t - failure, 0.0), tags)
        for phase, seconds in phases.items():
            if seconds is not None and seconds >= 0:
                self._m["phase_s"].observe(seconds, {**tags, "phase": phase})
        self._pending, self._fault_t = {}, None

    def _read_snapshot_stats(self) -> None:
        if self._snapshot_stats is None:
            return
        s = self._snapshot_stats()
        for key, name in (("blocking_seconds", "blocking"), ("snapshots_taken", "taken")):
            delta = s[key] - self._seen[key]
            if delta > 0:
                self._m[name].inc(delta, self._tags)
                self._seen[key] = s[key]
        self._set("held", s["held_bytes"])
