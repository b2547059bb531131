"""Host-memory snapshots of a sharded pytree at one step, and restore onto any target shardings.

A snapshot copies each distinct shard of every ``jax.Array`` leaf to host memory once (replicas are
stored once), keeps a CRC32 per leaf, and carries controller state (``meta``: step, RNG, data
position, user extras) as plain Python data.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from snapshot.errors import SnapshotCorruptError, SnapshotStructureError

__all__ = ["Snapshot", "capture", "restore", "verify"]


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """A consistent copy of the whole state after ``step - 1``: training resumes at ``step``."""

    step: int
    treedef: Any
    leaves: tuple[np.ndarray, ...]
    checksums: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)


def _checksum(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _to_host(leaf: Any) -> np.ndarray:
    if not isinstance(leaf, jax.Array):
        return np.array(leaf, copy=True)
    if leaf.is_fully_replicated:
        return np.array(leaf.addressable_shards[0].data, copy=True)
    out = np.empty(leaf.shape, dtype=leaf.dtype)
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
            out[shard.index] = np.asarray(shard.data)
    return out


def capture(step: int, state: Any, meta: dict[str, Any] | None = None) -> Snapshot:
    """Copy ``state`` to host memory. Blocks until the state is computed and copied."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    host = tuple(_to_host(leaf) for leaf in leaves)
    return Snapshot(
        step=step, treedef=treedef, leaves=host, checksums=tuple(_checksum(a) for a in host), meta=dict(meta or {})
    )


def verify(snap: Snapshot) -> None:
    """Raise :class:`SnapshotCorruptError` if any leaf changed since capture."""
    for i, (leaf, crc) in enumerate(zip(snap.leaves, snap.checksums, strict=True)):
        if _checksum(leaf) != crc:
            raise SnapshotCorruptError(snap.step, i)


def restore(snap: Snapshot, shardings: Any) -> Any:
    """The snapshot's state placed on ``shardings``; each device gets its shard straight from host memory.

    Shards are copied out of the snapshot, so the snapshot stays intact whatever the restored state's
    later computations (donation included) do.
    """
    targets, target_def = jax.tree_util.tree_flatten(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    if target_def != snap.treedef:
        raise SnapshotStructureError(
            f"target shardings have structure {target_def} ({target_def.num_leaves} leaves) but the snapshot of "
            f"step {snap.step} holds {snap.treedef} ({snap.treedef.num_leaves} leaves): pass one sharding per leaf "
            "of the saved state"
        )
    verify(snap)
    placed = []
    for i, (data, sharding) in enumerate(zip(snap.leaves, targets, strict=True)):
        if not isinstance(sharding, Sharding):
            raise SnapshotStructureError(f"leaf {i}: expected a jax.sharding.Sharding, got {type(sharding).__name__}")
        placed.append(jax.make_array_from_callback(data.shape, sharding, lambda idx, d=data: np.array(d[idx])))
    return jax.tree_util.tree_unflatten(snap.treedef, placed)
