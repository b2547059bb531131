"""The CPU priority of the job's own Ray actors.

Ray starts its worker processes at nice 15 (its ``worker_niceness``), so that the raylet comes first. An actor of
this job then gets about a thirtieth of a core against any ordinary process (nice 0) that keeps a core busy: on a
2-core machine with two such neighbours, four multi-process workers took over 60 s to import jax and the job gave
up ("4 of 4 slice agents did not register"), and a supervisor or agent that late misjudges heartbeats. The job's
actors that do its work or judge its health call :func:`normal` as they start; helpers that only save time later
(the standby compiles) call :func:`background`.

Lowering the niceness needs ``CAP_SYS_NICE`` or a ``RLIMIT_NICE`` that allows it (root in most containers has the
capability). Without it the process stays where Ray put it, and the warning says what to do instead: start Ray
with ``RAY_worker_niceness=0`` in its environment (``connect`` does so for the embedded cluster).
"""

from __future__ import annotations

import os

from elastic.log import get_logger

__all__ = ["BACKGROUND", "NORMAL", "background", "normal", "set_niceness"]

NORMAL = 0  # an ordinary process's niceness
BACKGROUND = 15  # Ray's default for its workers


def set_niceness(value: int) -> int:
    """Set every thread of this process to niceness ``value`` (Linux keeps one per thread, and Ray's threads
    started before this call keep their own; threads started after inherit it). Returns the calling thread's
    niceness afterwards; raises ``PermissionError`` if a thread could not be raised to ``value``."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the call's process-wide there (macOS)
        threads = [0]
    denied: PermissionError | None = None
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != value:
                os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as err:
            denied = err
    if denied is not None:
        raise denied
    return os.getpriority(os.PRIO_PROCESS, 0)


def normal(role: str, **bound: object) -> int:
    """Run this actor at an ordinary process's priority (:data:`NORMAL`); returns the niceness it runs at. Where
    that is not allowed, logs ``niceness_kept`` (with ``role``) and carries on at Ray's niceness."""
    try:
        return set_niceness(NORMAL)
    except PermissionError as err:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        get_logger("elastic.priority", **bound).warning(
            "niceness_kept",
            role=role,
            niceness=now,
            error=str(err),
            fix="start Ray with RAY_worker_niceness=0 in its environment (or grant CAP_SYS_NICE): at this niceness "
            "any busy process on the host starves this one",
        )
        return now


def background() -> int:
    """Run this actor below ordinary processes (:data:`BACKGROUND`): its work only saves time later. Always
    allowed (a process may lower its own priority)."""
    try:
        return set_niceness(BACKGROUND)
    except PermissionError:  # a thread already below that priority (niceness above 15) may not be raised back
        return os.getpriority(os.PRIO_PROCESS, 0)
