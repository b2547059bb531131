"""Probe which slices can still compute: dispatch a tiny computation per slice, then collect."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime import simulated
from runtime.classify import is_slice_loss
from runtime.topology import Slice

__all__ = ["SliceProbe", "probe_slices"]


@dataclass
class SliceProbe:
    """Two steps, so every slice's probe is in flight before any answer is awaited."""

    slices: Sequence[Slice]

    def dispatch(self) -> list[tuple[Slice, jax.Array | BaseException]]:
        pending: list[tuple[Slice, jax.Array | BaseException]] = []
        for s in self.slices:
            try:
                simulated.check_devices(s.devices)
                mesh = Mesh(np.array(s.devices), ("d",))
                x = jax.device_put(jnp.ones((len(s.devices),)), NamedSharding(mesh, PartitionSpec("d")))
                pending.append((s, x.sum()))
            except Exception as err:  # noqa: BLE001 - classified below
                pending.append((s, err))
        return pending

    def collect(self, pending: list[tuple[Slice, jax.Array | BaseException]]) -> frozenset[int]:
        """Indices of the slices that failed their probe with a slice-loss error."""
        dead: set[int] = set()
        for s, result in pending:
            try:
                if isinstance(result, BaseException):
                    raise result
                jax.block_until_ready(result)
                simulated.check_devices(s.devices)
            except Exception as err:  # noqa: BLE001
                if not is_slice_loss(err):
                    raise
                dead.add(s.index)
        return frozenset(dead)


def probe_slices(slices: Sequence[Slice]) -> frozenset[int]:
    probe = SliceProbe(slices)
    return probe.collect(probe.dispatch())
