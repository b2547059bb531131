"""The dispatch seam: run a computation so that device loss surfaces where real hardware raises it.

Real backends raise ``JaxRuntimeError`` from dispatch or when a result is awaited; simulated slices
raise the same error here, before dispatch and again once the result is ready (a slice killed
mid-step loses that step's result).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

from runtime import simulated

__all__ = ["guarded", "wait_ready"]

F = TypeVar("F", bound=Callable[..., Any])


def wait_ready(tree: Any, devices: Iterable[Any]) -> Any:
    """Block until ``tree`` is computed; raise the slice-loss error if ``devices`` were lost meanwhile."""
    jax.block_until_ready(tree)
    simulated.check_devices(devices)
    return tree


def guarded(fn: F, devices: Iterable[Any]) -> F:
    """``fn`` whose calls fail like a lost slice when any of ``devices`` is down."""
    devices = tuple(devices)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        simulated.check_devices(devices)
        out = fn(*args, **kwargs)
        simulated.check_devices(devices)
        return out

    return call  # type: ignore[return-value]
