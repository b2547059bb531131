"""A pool of slices shared by many jobs: lent by priority and quota, taken back by notice, given back when free.

:mod:`.model` holds the data, :mod:`.policy` the pure decision (:func:`decide`), :mod:`.actor` the restartable
Ray actor that carries it out (its log replayed by :mod:`.replay`, its calls checked by :mod:`.access`),
:mod:`.client` starts and finds it, and :mod:`.member` is a job's side of its lease.
"""

from elastic.pool.model import (
    Arrive,
    Event,
    JobSpec,
    JobStatus,
    Leave,
    Plan,
    PoolState,
    Reclaim,
    Release,
    Resize,
    SliceFailed,
    SliceReturned,
    new_state,
)
from elastic.pool.policy import decide, targets

__all__ = [
    "Arrive",
    "Event",
    "JobSpec",
    "JobStatus",
    "Leave",
    "Plan",
    "PoolState",
    "Reclaim",
    "Release",
    "Resize",
    "SliceFailed",
    "SliceReturned",
    "decide",
    "new_state",
    "targets",
]
