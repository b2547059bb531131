"""The pool's Ray metrics (``ray.util.metrics``), exported by the pool actor, on Ray's metrics endpoint like any Ray
metric (with a ``ray_`` prefix; a counter gains ``_total``). Each is tagged ``pool``; the per-job ones ``job`` too:

* ``elastic_pool_slices`` (gauge, tag ``kind``: size/free/failed/reclaiming): the pool's slices.
* ``elastic_pool_queue_length`` (gauge): jobs not running (waiting or suspended).
* ``elastic_pool_job_slices_lent``, ``elastic_pool_job_slices_asked`` (gauges): what a job holds and asks.
* ``elastic_pool_job_seconds_below_asked`` (gauge): the job's seconds below what it asked (as its lease says).
* ``elastic_pool_job_state`` (gauge, tag ``state``: running/waiting/suspended): 1 for the job's state, 0 for the
  others.
* ``elastic_pool_reclaims`` (counter, tag ``kind``: reclaim/hot_swap/suspend): slices a job was given notice for,
  by why (``suspend``: every slice of a job taken below its minimum).

Ray drops a gauge not set for two report intervals: a thread sets them again every second while the actor lives
(a job that left is no longer set, and drops out). The counters start again from zero when the actor restarts.
Nothing here raises into the pool: an error is logged once and that update is skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ray.util.metrics import Counter, Gauge

from elastic.log import get_logger
from elastic.pool.model import Plan, PoolState

__all__ = ["STATES", "PoolMetrics", "reclaim_kind"]

STATES = ("running", "waiting", "suspended")
REFRESH_S = 1.0

_log = get_logger("elastic.pool.metrics")
_lock = threading.Lock()
_instruments: dict[str, Any] = {}


def _made() -> dict[str, Any]:
    """This process's metric objects, made once (Ray registers a metric name once per process)."""
    with _lock:
        if not _instruments:
            job = ("pool", "job")
            _instruments.update(
                slices=Gauge("elastic_pool_slices", "The pool's slices, by kind", ("pool", "kind")),
                queue=Gauge("elastic_pool_queue_length", "Jobs of the pool not running", ("pool",)),
                lent=Gauge("elastic_pool_job_slices_lent", "Slices the job holds", job),
                asked=Gauge("elastic_pool_job_slices_asked", "Slices the job asks", job),
                below=Gauge("elastic_pool_job_seconds_below_asked", "Seconds the job held less than it asked", job),
                state=Gauge("elastic_pool_job_state", "1 for the job's state, 0 for the others", (*job, "state")),
                reclaims=Counter("elastic_pool_reclaims", "Slices a job was given notice for", (*job, "kind")),
            )
        return _instruments


def reclaim_kind(reason: str, *, suspend: bool) -> str:
    """A notice's kind for ``elastic_pool_reclaims``."""
    if suspend:
        return "suspend"
    return "hot_swap" if reason.startswith("hot swap") else "reclaim"


class PoolMetrics:
    """Pool ``pool``'s metrics; ``snapshot()`` answers (state, {job: status dict with ``state``, ``asked`` and
    ``seconds_below_asked``}), read every second by :meth:`start`'s thread."""

    def __init__(self, pool: str, snapshot: Callable[[], tuple[PoolState, Mapping[str, Mapping[str, Any]]]]) -> None:
        self.pool = pool
        self._snapshot = snapshot
        self._failed = False
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._forever, name=f"pool-metrics-{self.pool}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _forever(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self.refresh()

    def _guard(self, what: Callable[[], None]) -> None:
        try:
            what()
        except Exception as err:  # noqa: BLE001 - metrics never stop the pool
            if not self._failed:
                self._failed = True
                _log.warning("pool_metrics_update_failed", pool=self.pool, error=repr(err))

    def refresh(self) -> None:
        """Set every gauge from the pool's state now."""
        self._guard(self._refresh)

    def _refresh(self) -> None:
        m = _made()
        state, jobs = self._snapshot()
        p = {"pool": self.pool}
        m["slices"].set(state.size, tags={**p, "kind": "size"})
        m["slices"].set(len(state.free()), tags={**p, "kind": "free"})
        m["slices"].set(len(state.failed), tags={**p, "kind": "failed"})
        m["slices"].set(len(state.reclaiming), tags={**p, "kind": "reclaiming"})
        m["queue"].set(sum(1 for s in jobs.values() if s["state"] != "running"), tags=p)
        for name, status in jobs.items():
            tags = {**p, "job": name}
            m["lent"].set(len(state.holding(name)), tags=tags)
            m["asked"].set(status["asked"], tags=tags)
            m["below"].set(status["seconds_below_asked"], tags=tags)
            for s in STATES:
                m["state"].set(1.0 if status["state"] == s else 0.0, tags={**tags, "state": s})

    def decided(self, plan: Plan) -> None:
        """Count the plan's notices (then set the gauges: the state changed)."""

        def count() -> None:
            m = _made()
            for r in plan.reclaims:
                suspend = not plan.state.holding(r.job) - plan.state.reclaiming.keys()
                kind = reclaim_kind(r.reason, suspend=suspend)
                m["reclaims"].inc(len(r.slices), tags={"pool": self.pool, "job": r.job, "kind": kind})

        self._guard(count)
        self.refresh()
