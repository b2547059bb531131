"""Simulated hangs, for drills of the step watchdog: a computation that really never completes.

``arm(slice)`` makes the results of the next guarded compiled call wait on a host callback blocked on a
``threading.Event``: its arrays never become ready, and (on CPU, as behind a hung collective on real
hardware) every later multi-device computation queues behind it. When the watchdog gives up on them
(:func:`runtime.guard.wait_ready` past its bound) it calls :func:`abort`, as a real runtime aborts a
timed-out collective: the callbacks return, the hung results are left to be discarded, and a hang armed
for one slice leaves that slice wedged (from then on its devices fail as a lost slice's do).
:func:`release_all` frees every blocked callback and disarms the rest (the end of a job), so no thread
stays blocked and the process can exit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from jax.sharding import SingleDeviceSharding

from . import simulated
from .topology import Slice

__all__ = ["abort", "arm", "attach", "blocked", "release_all"]

_lock = threading.Lock()
_armed: list[_Hang] = []
_blocked: list[_Hang] = []


@dataclass(eq=False)
class _Hang:
    slice: Slice | None  # None: every device the computation spans hangs, and all recover once aborted
    event: threading.Event = field(default_factory=threading.Event)
    device_ids: frozenset[int] = frozenset()


def arm(s: Slice | None = None) -> None:
    """The next guarded compiled call hangs (on ``s``'s devices, or on all of its devices)."""
    with _lock:
        _armed.append(_Hang(s))


def blocked() -> int:
    """How many hung computations still wait to be aborted or released."""
    with _lock:
        return sum(not h.event.is_set() for h in _blocked)


def attach(tree: Any, devices: tuple[Any, ...]) -> Any:
    """``tree`` unchanged, or (when a hang is armed) a copy whose arrays wait on the hang's callback."""
    if not _armed:  # fast path: nothing armed
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    if not where:
        return tree
    with _lock:
        if not _armed:
            return tree
        hang = _armed.pop(0)
        ids = frozenset(d.id for d in devices)
        hit = [d for d in (hang.slice.devices if hang.slice is not None else devices) if d.id in ids]
        if not hit:
            return tree  # the slice is not in this computation: nothing of it can hang here
        if len(ids) < 2:
            raise ValueError(
                "a simulated hang needs a computation over 2 or more devices (a single-device CPU "
                "computation runs inline, in the caller's thread)"
            )
        hang.device_ids = ids
        _blocked.append(hang)
    arrays = [leaves[i] for i in where]
    at = min(hit, key=lambda d: d.id)  # the device whose callback blocks

    def wait(token: Any) -> Any:
        hang.event.wait()
        return token

    def hung(xs: list[jax.Array]) -> list[jax.Array]:
        token = io_callback(wait, jax.ShapeDtypeStruct((), jnp.int32), jnp.int32(0), sharding=SingleDeviceSharding(at))
        return jax.lax.optimization_barrier((token, xs))[1]

    out = jax.jit(hung, out_shardings=[a.sharding for a in arrays])(arrays)
    for i, leaf in zip(where, out, strict=True):
        leaves[i] = leaf
    return jax.tree_util.tree_unflatten(treedef, leaves)


def abort(devices: tuple[Any, ...]) -> int:
    """Abort the hung computations on ``devices`` (the watchdog gave up on them); return how many. A hang
    armed for a slice leaves that slice wedged: its devices fail from now on."""
    ids = {d.id for d in devices}
    with _lock:
        hit = [h for h in _blocked if h.device_ids & ids and not h.event.is_set()]
        _blocked[:] = [h for h in _blocked if h not in hit]
    for h in hit:
        if h.slice is not None:
            simulated.kill_slice(h.slice)
        h.event.set()
    return len(hit)


def release_all() -> None:
    """Free every blocked callback and disarm every armed hang (the job ends)."""
    with _lock:
        hangs, _blocked[:], _armed[:] = list(_blocked), [], []
    for h in hangs:
        h.event.set()
