"""The dispatch seam: run a computation so that device loss and hangs surface where real hardware has them.

Real backends raise ``JaxRuntimeError`` from dispatch or when a result is awaited; simulated slices
raise the same error here, before dispatch and again once the result is ready (a slice killed
mid-step loses that step's result). A wait with a bound polls the results' readiness and raises
:class:`StepHungError` past it (a hung collective, a wedged device): the step watchdog.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

from . import hangs, simulated

__all__ = ["StepHungError", "guarded", "wait_ready"]

F = TypeVar("F", bound=Callable[..., Any])

_POLL_MIN_S = 1e-4
_POLL_MAX_S = 5e-3  # a result is seen at most this late (or 5% of the wait so far, if less)


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
        _poll(tree, devices, timeout_s, what, hint)
    jax.block_until_ready(tree)  # ready by now, unless unbounded: raises a computation's error
    simulated.check_devices(devices)
    return tree


def _poll(tree: Any, devices: tuple[Any, ...], timeout_s: float, what: str, hint: str) -> None:
    """Return once every array of ``tree`` is ready (done or failed); ``StepHungError`` past ``timeout_s``."""
    arrays: list[Any] = [
        getattr(leaf, "_base_array", leaf)  # a typed PRNG key array: readiness is its key data's
        for leaf in jax.tree_util.tree_leaves(tree)
        if isinstance(leaf, jax.Array)
    ]
    start = time.monotonic()
    deadline = start + timeout_s
    for i, array in enumerate(arrays):  # an array once ready stays ready: each is checked until it is
        while not array.is_ready():
            now = time.monotonic()
            if now >= deadline:
                simulated.check_devices(devices)  # a slice lost meanwhile is a slice loss, not a hang
                pending = sum(not a.is_ready() for a in arrays[i:])
                hangs.abort(devices)
                raise StepHungError(what, timeout_s, pending=pending, total=len(arrays), hint=hint)
            time.sleep(min(max((now - start) * 0.05, _POLL_MIN_S), _POLL_MAX_S, deadline - now))


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
