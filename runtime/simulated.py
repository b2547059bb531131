"""Simulated slice failures for CPU testing.

Once a simulated slice is killed, every guarded computation that touches one of its devices raises
:class:`~runtime.faults.DeviceUnavailableError` with an ``UNAVAILABLE`` status, as real hardware's
``JaxRuntimeError`` for a lost slice has, and :func:`runtime.classify.is_slice_loss` calls it slice loss alike.
The registry is process-wide, because devices are.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import jax

from .faults import DeviceUnavailableError
from .topology import Slice

__all__ = ["kill_slice", "revive_slice", "dead_device_ids", "check_devices", "devices_of", "reset"]

_lock = threading.Lock()
_dead: dict[int, int] = {}  # device id -> slice index


def kill_slice(s: Slice) -> None:
    """From now on, computations touching ``s``'s devices fail as a lost slice does."""
    with _lock:
        for d in s.devices:
            _dead[d.id] = s.index


def revive_slice(s: Slice) -> None:
    """``s``'s devices work again (a repaired or replaced slice)."""
    with _lock:
        for d in s.devices:
            _dead.pop(d.id, None)


def reset() -> None:
    with _lock:
        _dead.clear()


def dead_device_ids() -> frozenset[int]:
    with _lock:
        return frozenset(_dead)


def devices_of(tree: Any) -> set[Any]:
    """Every device holding a jax.Array leaf of ``tree``."""
    found: set[Any] = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            found |= set(leaf.sharding.device_set)
    return found


def check_devices(devices: Iterable[Any]) -> None:
    """Raise the slice-loss error if any of ``devices`` belongs to a killed simulated slice."""
    if not _dead:  # fast path: nothing killed
        return
    with _lock:
        hit = sorted({(_dead[d.id], d.id) for d in devices if d.id in _dead})
    if hit:
        slices = sorted({s for s, _ in hit})
        ids = [i for _, i in hit]
        raise DeviceUnavailableError(f"UNAVAILABLE: simulated slice(s) {slices} lost: devices {ids} are unreachable")
