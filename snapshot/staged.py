"""A snapshot requested and staged but not yet copied, and its restore straight from what it staged.

A save stages zero-copy views of the shards its copies will read; they keep those buffers from being
donated until the copy is done. A failure in that window need not wait for the copy: the survivors'
staged shards are the newest state, exactly. A survivor holding its own shard of its target region
keeps it in place; every other device gets a fresh copy.
"""

from __future__ import annotations

import copy as copylib
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from .errors import SnapshotUnavailableError
from .generation import Generation, Guard, LeafRecord, PieceRecord, reachable
from .image import Index, fresh_shards, meta_checksum, region, wrap_keys
from .plan import LeafPlan

__all__ = ["StagedLeaf", "StagedRequest", "restore_staged"]


@dataclass(kw_only=True)
class StagedRequest:
    """A snapshot requested and staged, its copy not yet complete."""

    number: int
    step: int
    treedef: Any
    plans: list[LeafPlan | None]
    staged: list[list[list[Any]]]  # leaf -> piece -> copy
    sources: list[list[list[tuple[Any, np.ndarray, jax.Array]]]]  # host engine: per copy, (device, view, shard) read
    values: list[Any]
    key_impls: list[str | None]
    meta: dict[str, Any]
    abandoned: bool = False  # restored from its staged shards: its copy is no longer needed

    def completed(self, records: dict[tuple[int, int], PieceRecord], slot: int) -> Generation:
        """The generation this request became, once every piece's copies (``records``) are written."""
        leaves = []
        for i, plan in enumerate(self.plans):
            if plan is None:
                leaves.append(LeafRecord(is_array=False, value=self.values[i]))
                continue
            leaves.append(
                LeafRecord(
                    shape=plan.shape,
                    dtype=plan.dtype.name,
                    key_impl=self.key_impls[i],
                    pieces=tuple(records[(i, j)] for j in range(len(plan.pieces))),
                )
            )
        held = sum(p.nbytes * len(p.copies) for plan in self.plans if plan for p in plan.pieces)
        fewest = min((len({c.slice for c in p.copies}) for leaf in leaves for p in leaf.pieces), default=0)
        return Generation(
            number=self.number,
            step=self.step,
            treedef=self.treedef,
            leaves=tuple(leaves),
            meta=self.meta,
            meta_checksum=meta_checksum(self.meta),
            slot=slot,
            state_bytes=sum(p.nbytes for p in self.plans if p),
            held_bytes=held,
            copies=fewest,
            created=time.time(),
        )


@dataclass(frozen=True, kw_only=True)
class StagedLeaf:
    """One leaf of a snapshot still being copied: per piece, the source shards its copies read, each as
    (device, zero-copy view, the shard itself); the staging keeps them from being donated."""

    shape: tuple[int, ...]
    dtype: np.dtype
    key_impl: str | None
    pieces: tuple[tuple[Index, tuple[tuple[Any, np.ndarray, jax.Array], ...]], ...]


def restore_staged(
    req: StagedRequest,
    sources: list[list[list[tuple[Any, np.ndarray, jax.Array]]]],
    targets: list[Sharding | None],
    available: set[Any],
    guard: Guard | None,
    *,
    borrow: bool = False,
) -> tuple[Any, tuple[frozenset[Any], ...]]:
    """The state of a snapshot still in flight, placed on ``targets`` from its source shards on
    ``available`` devices (live device memory: no checksum exists yet, none is needed). A device that
    holds its own shard of exactly its target region keeps it as it is (nothing moves); any other device
    receives a fresh copy (``borrow``: the source's bytes wrapped where the backend can, valid while the source
    shard lives). Returns the state and, per leaf (flattened), the devices whose shard was kept in place.

    Raises :class:`SnapshotUnavailableError` when a piece has no source shard left on those devices.
    """
    leaves = [
        req.values[i]
        if plan is None
        else StagedLeaf(
            shape=plan.shape,
            dtype=plan.dtype,
            key_impl=req.key_impls[i],
            pieces=tuple((p.index, tuple(sources[i][j])) for j, p in enumerate(plan.pieces)),
        )
        for i, plan in enumerate(req.plans)
    ]
    placed = []
    kept_on: list[frozenset[Any]] = []
    for i, (leaf, sharding) in enumerate(zip(leaves, targets, strict=True)):
        if not isinstance(leaf, StagedLeaf):
            placed.append(copylib.deepcopy(leaf))
            kept_on.append(frozenset())
            continue
        pieces: list[tuple[Index, np.ndarray]] = []
        own: dict[tuple[Any, Index], jax.Array] = {}
        assert sharding is not None  # an array leaf has a target
        for index, shard_sources in leaf.pieces:
            live = [(d, v, a) for d, v, a in shard_sources if d in available and reachable(guard, d)]
            if not live:
                raise SnapshotUnavailableError(req.step, i, ())
            pieces.append((index, live[0][1]))
            own.update({(d, index): a for d, _, a in live})
        where = {d: region(i, leaf.shape) for d, i in sharding.addressable_devices_indices_map(leaf.shape).items()}
        kept = {d: own[(d, want)] for d, want in where.items() if (d, want) in own}
        copied = [(want, d) for d, want in where.items() if d not in kept]
        fresh = dict(zip([d for _, d in copied], fresh_shards(copied, pieces, leaf.dtype, borrow=borrow), strict=True))
        kept_on.append(frozenset(kept))
        arrays = [kept[d] if d in kept else fresh[d] for d in where]
        arr = jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)
        placed.append(arr if leaf.key_impl is None else wrap_keys(arr, leaf.key_impl, sharding))
    return jax.tree_util.tree_unflatten(req.treedef, placed), tuple(kept_on)
