"""Where each byte of a snapshot lives: ``copies`` copies of every distinct shard, on distinct slices.

A leaf's distinct shards are its regions (replicas of a region are one region). A region held on at
least ``copies`` slices is copied on ``copies`` of them, each into the host memory of a device that
already holds it (no transfer between devices). A region held on fewer slices (state sharded across
slices) is copied where it lives and gets buddy copies on other slices. Choices balance bytes per
device. The plan depends only on shapes, dtypes and shardings, so it is computed once per layout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .image import Index, region

__all__ = ["CopyPlan", "LeafPlan", "PiecePlan", "SliceOf", "default_slice_of", "devices_by_slice", "plan_leaf"]

SliceOf = Callable[[Any], int]


def default_slice_of(device: Any) -> int:
    """A device's slice: ``device.slice_index`` where the backend has one (TPU), else 0."""
    return int(getattr(device, "slice_index", 0) or 0)


@dataclass(frozen=True, kw_only=True)
class CopyPlan:
    shard: int  # position in ``leaf.addressable_shards`` of the shard read
    dest: Any  # the device whose host memory holds the copy
    slice: int  # the slice of ``dest``


@dataclass(frozen=True, kw_only=True)
class PiecePlan:
    index: Index
    copies: tuple[CopyPlan, ...]
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class LeafPlan:
    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[PiecePlan, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one logical copy of the leaf."""
        return sum(p.nbytes for p in self.pieces)


def _device_id(device: Any) -> int:
    return int(device.id)


def devices_by_slice(leaves: Sequence[jax.Array], slice_of: SliceOf) -> dict[int, list[Any]]:
    """Every device holding a shard of ``leaves``, grouped by slice."""
    out: dict[int, list[Any]] = defaultdict(list)
    for leaf in leaves:
        for d in sorted(leaf.sharding.device_set, key=_device_id):
            if d not in out[slice_of(d)]:
                out[slice_of(d)].append(d)
    return dict(out)


def plan_leaf(
    leaf: jax.Array, copies: int, slice_of: SliceOf, load: dict[Any, int], devices_of_slice: dict[int, list[Any]]
) -> LeafPlan:
    """The copies of ``leaf``'s distinct shards; ``load`` (bytes per device so far) is updated in place.

    ``devices_of_slice``: the state's devices by slice (buddies are chosen among them); ``copies`` is
    capped at the number of slices.
    """
    mesh_slices = sorted(devices_of_slice)
    want = min(copies, len(mesh_slices))
    shards = leaf.addressable_shards
    by_region: dict[Index, list[int]] = defaultdict(list)
    for i, shard in enumerate(shards):
        by_region[region(shard.index, leaf.shape)].append(i)
    pieces = []
    for index in sorted(by_region):
        holders: dict[int, list[int]] = defaultdict(list)  # slice -> shard positions holding the region
        for i in by_region[index]:
            holders[slice_of(shards[i].device)].append(i)
        nbytes = (
            int(np.prod([hi - lo for lo, hi in index], dtype=np.int64)) * leaf.dtype.itemsize
            if leaf.ndim
            else leaf.dtype.itemsize
        )

        def lightest(options: list[Any]) -> Any:
            return min(options, key=lambda d: (load[d], d.id))

        def slice_load(s: int) -> int:
            return min(load[d] for d in devices_of_slice[s])

        chosen = sorted(holders, key=lambda s: (slice_load(s), s))[:want]
        plans: list[CopyPlan] = []
        first_shard = -1
        for s in chosen:
            i = min(holders[s], key=lambda j: (load[shards[j].device], shards[j].device.id))
            dev = shards[i].device
            first_shard = i if first_shard < 0 else first_shard
            plans.append(CopyPlan(shard=i, dest=dev, slice=s))
            load[dev] += nbytes
        source = shards[first_shard].device
        others = [s for s in mesh_slices if s not in holders]
        ring = max(mesh_slices) + 1
        for s in sorted(others, key=lambda s: (slice_load(s), (s - slice_of(source)) % ring))[: want - len(plans)]:
            dev = lightest(devices_of_slice[s])
            plans.append(CopyPlan(shard=first_shard, dest=dev, slice=s))
            load[dev] += nbytes
        pieces.append(PiecePlan(index=index, copies=tuple(plans), nbytes=nbytes))
    return LeafPlan(shape=tuple(leaf.shape), dtype=np.dtype(leaf.dtype), pieces=tuple(pieces))
