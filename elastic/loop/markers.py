"""Step markers: something to wait on for a step whose state the next step donates.

With ``steps_in_flight`` above 1, ``run.commit`` of step k waits for step k-1; when k-1's state was donated to
step k and no metrics were committed, nothing of k-1 is left to wait on. A marker is what is waited on instead.
When the call that computed k-1's state (a ``jax.jit`` function through ``run.jit`` or ``run.guard``: one
execution) returned something else too, such as the step's loss, that other output is the marker
(:func:`sibling`): it costs nothing to make. Otherwise a marker
is one element of one device's shard of a leaf of k-1's state, copied out by a tiny program dispatched at k-1's
commit: it is queued behind k-1 on that device, outlives the donation, and is ready once k-1's result there is.

The marked leaf is chosen once per pass: the smallest leaf still being computed (typically a replicated scalar,
such as an optimizer's step count, whose shard keeps its shape on every mesh). The marker's program is compiled
for that shard's shape on every local device in the background, so a pass on other devices after a recovery
or a grow compiles nothing on its first commit.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

__all__ = ["StepMarkers", "sibling", "wait_warm"]

_SIBLING_BYTES = 1 << 16  # a step's output held as its marker: a loss or a few metrics, not its activations
_PICK_TRIES = 3  # commits of a pass that look for a leaf being computed (a synchronous step leaves none)

_tap = jax.jit(lambda x: x.reshape(-1)[:1])  # one element of one device's shard: a tiny single-device program
_warmed: set[tuple[tuple[int, ...], str, int]] = set()  # (shard shape, dtype, device id) compiled for
_lock = threading.Lock()
_warming: list[threading.Thread] = []  # the background compiles started, until joined by ``wait_warm``


def _computing(array: Any) -> bool:
    return not array.is_ready()  # jax.Array's stubs lack is_ready


def _markable(leaf: Any) -> bool:
    return (
        isinstance(leaf, jax.Array)
        and leaf.size > 0
        and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
        and not leaf.is_deleted()
    )


def _shard_shape(leaf: jax.Array) -> tuple[int, ...]:
    return tuple(leaf.sharding.shard_shape(leaf.shape))


class StepMarkers:
    """One pass's markers. ``mark(state, metrics)``: the marker of the step whose result ``state`` is (None where
    none is needed: the metrics hold an array, which is never donated, or the marked leaf is computed)."""

    def __init__(self) -> None:
        self._at: int | None = None  # the marked leaf's index among the state's leaves
        self._tries = 0
        self._dtype: Any = None  # the marked leaf's (a markable dtype: another leaf there is not marked)

    def mark(self, state: Any, metrics: dict[str, Any], outputs: Any = None) -> jax.Array | None:
        """``outputs``: what the call that computed ``state`` returned, when known (see :func:`sibling`)."""
        if any(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(metrics)):
            return None
        found = sibling(state, outputs)
        if found is not None:
            return found
        leaves = jax.tree_util.tree_leaves(state)
        if self._at is None:
            if self._tries >= _PICK_TRIES:
                return None
            self._tries += 1
            self._at = _pick(leaves)
            if self._at is None:
                return None
            self._dtype = leaves[self._at].dtype
            _warm(leaves[self._at])
        leaf = leaves[self._at] if self._at < len(leaves) else None
        if not isinstance(leaf, jax.Array) or leaf.dtype != self._dtype or leaf.is_deleted() or not _computing(leaf):
            return None
        return _tap(leaf.addressable_data(0))


def sibling(state: Any, outputs: Any) -> jax.Array | None:
    """The smallest array beside ``state`` among ``outputs``, what the call that computed it returned (a tuple
    or list holding ``state`` itself, as in ``state, loss = step(state, batch)``), when it holds at most
    ``_SIBLING_BYTES`` and is still being computed: typically the step's loss. Every output of one execution
    is ready once that execution is, on every device, so it marks the step without a program of its own, and
    the next step does not donate it. None when ``outputs`` is not such a tuple (another call's, or the state
    alone) or holds no such array."""
    if not isinstance(outputs, tuple | list) or not any(o is state for o in outputs):
        return None
    others = [
        x
        for o in outputs
        if o is not state
        for x in jax.tree_util.tree_leaves(o)
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)  # no PRNG keys
    ]
    if not others:
        return None
    best = min(others, key=lambda x: x.nbytes)
    if (best.ndim and best.nbytes > _SIBLING_BYTES) or best.is_deleted() or not _computing(best):
        return None  # computed already: a program's output is not ready before the program is done
    return best


def _pick(leaves: list[Any]) -> int | None:
    """The index of the smallest leaf (by shard) still being computed; None if there is none."""
    candidates = [(math.prod(_shard_shape(x)), i) for i, x in enumerate(leaves) if _markable(x) and _computing(x)]
    return min(candidates)[1] if candidates else None


def _warm(leaf: jax.Array) -> None:
    """Compile the marker's program for ``leaf``'s shard on every local device not compiled for yet, in the
    background (a failed compile is left to the first mark on that device)."""
    shape, dtype = _shard_shape(leaf), leaf.dtype
    with _lock:
        devices = [d for d in jax.local_devices() if (shape, str(dtype), d.id) not in _warmed]
        _warmed.update((shape, str(dtype), d.id) for d in devices)
    if not devices:
        return

    def compile_all() -> None:
        for device in devices:
            try:
                _tap.lower(jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))).compile()
            except Exception:  # noqa: BLE001 - the call compiles it then
                continue

    thread = threading.Thread(target=compile_all, name="elastic-marker-warm", daemon=True)
    with _lock:
        _warming.append(thread)
    thread.start()


def wait_warm(timeout_s: float) -> bool:
    """Until the marker programs' background compiles started so far are done (False: not within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    with _lock:
        threads = list(_warming)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _lock:
        _warming[:] = [t for t in _warming if t.is_alive()]
        return not _warming
