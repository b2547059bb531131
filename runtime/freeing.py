"""Drop references off the training loop's thread: what a donated state leaves behind is freed elsewhere.

Freeing a jax array frees a few small host allocations even when its device buffer was donated, and ``free``
takes the lock of the allocator arena the allocation came from. The runtime's own threads (on CPU, the
devices') hold that lock while they hand large buffers back to the system, so a loop thread that drops a
donated state can wait tens of milliseconds for an arena lock on a machine of few cores. :func:`release` hands such a
reference to one daemon thread that drops it instead.

Contract. ``release(obj)`` hands ``obj`` over only when its live arrays (jax arrays not deleted or donated,
numpy arrays) hold at most ``SMALL`` bytes; a reference that holds more is left to the caller, so device and
host memory are freed exactly when they were without this module. What is handed over is dropped, in order,
by that thread once the loop's thread is about to wait for the devices (:func:`wake`, called by
``runtime.wait_ready``; waking it earlier would take the core from the loop's thread), or once ``WAKE_AT``
handovers wait. At most ``BACKLOG`` wait at once; past that the caller drops its own. :func:`discard` hands over
a reference whatever it holds (what a failed pass left behind: nothing waits for its memory, and dropping it on the
loop's thread held it 29 ms on the way to the recovery). :func:`flush` drops what waits on its caller's thread and
waits, bounded, for a drop in progress. A forked child starts its own thread.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import jax
import numpy as np

__all__ = ["BACKLOG", "SMALL", "WAKE_AT", "discard", "flush", "held_bytes", "release", "wake"]

SMALL = 1 << 20  # bytes of live arrays a handover may hold: what a step's metrics and markers hold, not a state
WAKE_AT = 8  # handovers that wake the thread without a wait (a loop whose steps never wait for the devices)
BACKLOG = 64  # handovers waiting at most; past that, the caller drops its own


def held_bytes(obj: Any) -> int:
    """The bytes of the live arrays among ``obj``'s leaves (a donated or deleted jax array holds none)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(obj):
        if isinstance(leaf, jax.Array):
            total += 0 if leaf.is_deleted() else leaf.nbytes
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
    return total


class _Releaser:
    def __init__(self) -> None:
        self._forked()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._queue: collections.deque[Any] = collections.deque()
        self._woken = False  # the thread may drop what is queued
        self._busy = 0  # handovers taken off the queue and not dropped yet
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def release(self, obj: Any, held: int | None) -> None:
        if (held_bytes(obj) if held is None else held) > SMALL:
            return  # a state's memory: freed where the caller drops its own reference, as it would be
        if len(self._queue) >= BACKLOG:
            return  # the caller's reference is dropped as this frame returns: freed on its thread
        self._queue.append(obj)  # atomic: the thread takes from the left under the lock, flush likewise
        del obj
        if len(self._queue) >= WAKE_AT:
            with self._cond:
                self._wake()

    def discard(self, obj: Any) -> None:
        self._queue.append(obj)
        del obj

    def wake(self) -> None:
        if self._queue:  # read without the lock: a handover racing this call is dropped at the next wake
            with self._cond:
                self._wake()

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="elastic-release", daemon=True)
            self._thread.start()
        self._woken = True
        self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        with self._cond:
            taken = []  # dropped here, on the caller's thread, rather than waited for
            while self._queue:
                taken.append(self._queue.popleft())
            done = self._cond.wait_for(lambda: self._busy == 0, timeout_s)
        del taken
        return done

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._woken and bool(self._queue))
                obj = self._queue.popleft()
                self._woken = bool(self._queue)  # drains what is queued, then sleeps until woken again
                self._busy += 1
            del obj  # the drop itself, outside the lock
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()


_releaser = _Releaser()


def release(obj: Any, *, held: int | None = None) -> None:
    """Hand this reference to ``obj`` to the release thread, when it holds at most ``SMALL`` bytes of live arrays
    (the caller drops its own references). ``held``: those bytes, when the caller knows them (not measured)."""
    _releaser.release(obj, held)


def discard(obj: Any) -> None:
    """Hand this reference to ``obj`` to the release thread whatever it holds, to drop at the next :func:`wake`
    (the caller drops its own reference first, so that the memory is freed there) or :func:`flush`: for what a failed
    pass left behind, which nothing waits on."""
    _releaser.discard(obj)


def wake() -> None:
    """Let the release thread drop what it holds (the loop's thread is about to wait)."""
    _releaser.wake()


def flush(timeout_s: float = 10.0) -> bool:
    """Drop what is queued, on the caller's thread, and wait up to ``timeout_s`` for a drop in progress: True once
    every reference handed to :func:`release` so far has been dropped."""
    return _releaser.flush(timeout_s)
