"""Probe which slices can still compute: dispatch a tiny computation per slice, then collect (bounded: a
slice whose probe does not answer in time, e.g. wedged behind a hung collective, counts as dead)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import simulated
from .classify import is_slice_loss
from .guard import StepHungError, wait_ready
from .topology import Slice

__all__ = ["SliceProbe", "probe_slices", "warm_probes"]

_probe = jax.jit(lambda x: x.sum())


def _probe_input(s: Slice) -> jax.Array:
    mesh = Mesh(np.array(s.devices), ("d",))
    return jax.device_put(np.ones((len(s.devices),), np.float32), NamedSharding(mesh, PartitionSpec("d")))


def warm_probes(slices: Sequence[Slice]) -> None:
    """Compile each slice's probe ahead, so that probing during a recovery compiles nothing."""
    for s in slices:
        mesh = Mesh(np.array(s.devices), ("d",))
        sharding = NamedSharding(mesh, PartitionSpec("d"))
        _probe.lower(jax.ShapeDtypeStruct((len(s.devices),), np.float32, sharding=sharding)).compile()


@dataclass
class SliceProbe:
    """Two steps, so every slice's probe is in flight before any answer is awaited."""

    slices: Sequence[Slice]

    def dispatch(self) -> list[tuple[Slice, jax.Array | BaseException]]:
        """Start every slice's probe; a slice whose dispatch fails carries its error."""
        pending: list[tuple[Slice, jax.Array | BaseException]] = []
        for s in self.slices:
            try:
                simulated.check_devices(s.devices)
                pending.append((s, _probe(_probe_input(s))))
            except Exception as err:  # noqa: BLE001 - classified below
                pending.append((s, err))
        return pending

    def collect(
        self, pending: list[tuple[Slice, jax.Array | BaseException]], timeout_s: float | None = None
    ) -> frozenset[int]:
        """Indices of the slices that failed their probe with a slice-loss error, or (``timeout_s``: a bound
        for all of them together) did not answer it in time."""
        dead: set[int] = set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for s, result in pending:
            try:
                if isinstance(result, BaseException):
                    raise result
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                wait_ready(result, s.devices, timeout_s=left, what=f"the probe of slice {s.index}")
            except StepHungError:
                dead.add(s.index)  # unresponsive: as good as gone for this job
            except Exception as err:
                if not is_slice_loss(err):
                    raise
                dead.add(s.index)
        return frozenset(dead)


def probe_slices(
    slices: Sequence[Slice],
    timeout_s: float | None = None,
    *,
    early: Callable[[frozenset[int]], None] | None = None,
) -> frozenset[int]:
    """Indices of the slices whose probe failed or did not answer within ``timeout_s``. ``early``, when given,
    is called with the slices whose probe failed at dispatch (a lost slice's), if any, before the others'
    answers are awaited: those wait behind whatever is in flight on their devices."""
    probe = SliceProbe(slices)
    pending = probe.dispatch()
    failed = frozenset(s.index for s, result in pending if isinstance(result, BaseException) and is_slice_loss(result))
    if failed and early is not None:
        early(failed)
    return probe.collect(pending, timeout_s)
