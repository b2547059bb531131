"""The dispatch seam: run a computation so that device loss and hangs surface where real hardware has them.

Real backends raise ``JaxRuntimeError`` from dispatch or when a result is awaited; simulated slices raise
:class:`~runtime.faults.DeviceUnavailableError` (classified alike) here, before dispatch and again once the result
is ready (a slice killed mid-step loses that step's result). A wait with a bound raises :class:`StepHungError`
past it (a hung collective, a wedged device): the step watchdog. It does not poll: a waiter thread blocks in
``jax.block_until_ready`` while the caller sleeps on an event with the bound as its timeout.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

from . import freeing, hangs, simulated

__all__ = ["StepHungError", "guarded", "wait_ready"]

F = TypeVar("F", bound=Callable[..., Any])


class StepHungError(TimeoutError):
    """A computation made no progress within its bound: its results never became ready."""

    def __init__(self, what: str, timeout_s: float, *, pending: int = 0, total: int = 0, hint: str = "") -> None:
        self.what, self.timeout_s, self.pending, self.total, self.hint = what, timeout_s, pending, total, hint
        message = (
            f"{what} made no progress in {timeout_s:g}s: {pending} of {total} result arrays never became "
            "ready (a hung collective or a wedged device)"
        )
        super().__init__(message + (f"; {hint}" if hint else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.what, self.timeout_s, self.pending, self.total, self.hint))


def _rebuild(what: str, timeout_s: float, pending: int, total: int, hint: str) -> StepHungError:
    return StepHungError(what, timeout_s, pending=pending, total=total, hint=hint)


def wait_ready(
    tree: Any, devices: Iterable[Any], *, timeout_s: float | None = None, what: str = "a computation", hint: str = ""
) -> Any:
    """Wait until ``tree`` is computed; raise the slice-loss error if ``devices`` were lost meanwhile.

    ``timeout_s``: the bound (None: wait as long as it takes). Past it, hung computations of simulated
    hangs on ``devices`` are aborted and :class:`StepHungError` (naming ``what``, with ``hint``) is raised.
    """
    devices = tuple(devices)
    if timeout_s is not None:
        _wait_bounded(tree, devices, timeout_s, what, hint)
    elif not all(a.is_ready() for a in _arrays(tree)):
        freeing.wake()  # this thread is about to block: the release thread's drops take no core from it
    jax.block_until_ready(tree)  # ready by now, unless unbounded: raises a computation's error
    simulated.check_devices(devices)
    return tree


def _wait_bounded(tree: Any, devices: tuple[Any, ...], timeout_s: float, what: str, hint: str) -> None:
    """Return once every array of ``tree`` is ready (done or failed); ``StepHungError`` past ``timeout_s``."""
    arrays = _arrays(tree)
    if all(a.is_ready() for a in arrays):
        return
    freeing.wake()  # this thread is about to sleep: the release thread's drops take no core from it
    if _waiters.wait(arrays, timeout_s):
        return
    simulated.check_devices(devices)  # a slice lost meanwhile is a slice loss, not a hang
    pending = sum(not a.is_ready() for a in arrays)
    hangs.abort(devices)
    raise StepHungError(what, timeout_s, pending=pending, total=len(arrays), hint=hint)


def _arrays(tree: Any) -> list[Any]:
    return [
        getattr(leaf, "_base_array", leaf)  # a typed PRNG key array: readiness is its key data's
        for leaf in jax.tree_util.tree_leaves(tree)
        if isinstance(leaf, jax.Array)
    ]


class _Waiters:
    """Daemon threads that block in ``jax.block_until_ready`` on behalf of bounded waits, which sleep on an event
    instead of polling readiness (the loop's thread stays off the cores the devices compute on). A thread returns
    to the idle ones once its arrays are ready; one still blocked past its wait's bound (a hung computation, its
    arrays held until it completes or is aborted) is never handed another wait."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[tuple[list[Any], threading.Event]]] = []
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """A forked child has none of the parent's threads: it starts its own."""
        self._idle = []
        self._lock = threading.Lock()

    def wait(self, arrays: list[Any], timeout_s: float) -> bool:
        """True once ``arrays`` are all ready (computed or failed); False past ``timeout_s``."""
        done = threading.Event()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="elastic-ready-waiter", daemon=True).start()
        jobs.put((arrays, done))
        return done.wait(timeout_s)

    def _serve(self, jobs: queue.SimpleQueue[tuple[list[Any], threading.Event]]) -> None:
        while True:
            arrays, done = jobs.get()
            try:
                jax.block_until_ready(arrays)
            except Exception:  # noqa: BLE001 - a failed computation is ready too: the caller's own wait raises it
                pass
            del arrays
            with self._lock:
                self._idle.append(jobs)  # before the event: the next wait finds this thread idle
            done.set()


_waiters = _Waiters()


def guarded(fn: F, devices: Iterable[Any]) -> F:
    """``fn`` whose calls fail like a lost slice when any of ``devices`` is down (and hang, for a compiled
    ``fn``, when a simulated hang is armed)."""
    devices = tuple(devices)
    compiled = hasattr(fn, "lower")

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        simulated.check_devices(devices)
        out = fn(*args, **kwargs)
        simulated.check_devices(devices)
        return hangs.attach(out, devices) if compiled else out

    return call  # type: ignore[return-value]
