"""The training thread's half of a save: a state's leaves as arrays, where each byte's copies go (planned once per
layout), and the shards each copy reads, staged without waiting for the state to be computed."""

from __future__ import annotations

import copy as copylib
from typing import Any

import jax
import numpy as np
import structlog

from .engine import Engine
from .plan import LeafPlan, SliceOf, devices_by_slice, plan_leaf

__all__ = ["Layout", "Staged", "as_arrays", "is_key", "stage"]

log = structlog.get_logger("snapshot")

Staged = tuple[list[list[list[Any]]], list[list[list[tuple[Any, np.ndarray, jax.Array]]]], list[Any]]


def is_key(x: Any) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (snapshotted as its key data)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def as_arrays(leaves: list[Any]) -> tuple[list[Any], list[str | None]]:
    """``leaves`` with typed keys replaced by their key data, and each leaf's key implementation (None: not a key)."""
    key_impls = [str(jax.random.key_impl(x)) if is_key(x) else None for x in leaves]
    return [jax.random.key_data(x) if k else x for x, k in zip(leaves, key_impls, strict=True)], key_impls


class Layout:
    """Where each byte of a state's snapshots goes: ``copies`` copies of every piece on distinct slices
    (``slice_of(device) -> int``), planned once per layout (a new mesh replaces the old plan)."""

    def __init__(self, copies: int, slice_of: SliceOf) -> None:
        self._copies = copies
        self._slice_of = slice_of
        self._plans: dict[Any, list[LeafPlan | None]] = {}

    def plans(self, arrays: list[Any]) -> list[LeafPlan | None]:
        """Each leaf's plan (None: not a jax array, copied as a value)."""
        key = tuple((x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else None for x in arrays)
        plans = self._plans.get(key)
        if plans is None:
            jax_arrays = [x for x in arrays if isinstance(x, jax.Array)]
            by_slice = devices_by_slice(jax_arrays, self._slice_of)
            load: dict[Any, int] = {d: 0 for ds in by_slice.values() for d in ds}
            plans = [
                plan_leaf(x, self._copies, self._slice_of, load, by_slice) if isinstance(x, jax.Array) else None
                for x in arrays
            ]
            if len(by_slice) < self._copies:
                log.warning("snapshot_copies_capped", copies=self._copies, slices=len(by_slice))
            self._plans = {key: plans}  # one layout at a time: a new mesh replaces the old plan
        return plans


def stage(arrays: list[Any], plans: list[LeafPlan | None], engine: Engine) -> Staged:
    """Stage every copy's read of ``arrays`` (zero-copy views of computed shards, or transfers dispatched behind
    their computation): ``(staged, sources, values)``, leaf -> piece -> copy; ``values``: the non-array leaves.

    ``sources``: the shards the copies read, as (device, view, shard), when every one is a host view (the host
    engine); empty otherwise. Until the copy is done, a survivor that holds one of them restores its own shard of
    this state in place. (Holding every replica would also keep the others from being donated: each step after a
    save would allocate them anew.) A shard still being computed has no view yet: then a restore waits for the copy.
    """
    reads: list[list[list[jax.Array]]] = []  # leaf -> piece -> the shard each copy reads
    values: list[Any] = []
    for x, plan in zip(arrays, plans, strict=True):
        if plan is None:
            reads.append([])
            values.append(copylib.deepcopy(x))
            continue
        shards = x.addressable_shards
        reads.append([[shards[c.shard].data for c in p.copies] for p in plan.pieces])
        values.append(None)
    flat = [
        (read, [c.dest for c in p.copies])
        for plan, leaf in zip(plans, reads, strict=True)
        if plan
        for p, read in zip(plan.pieces, leaf, strict=True)
    ]
    landed = iter(engine.stage_pieces(flat))
    staged: list[list[list[Any]]] = [[next(landed) for _ in leaf] for leaf in reads]
    sources: list[list[list[tuple[Any, np.ndarray, jax.Array]]]] = []
    views_only = engine.name == "host" and all(
        isinstance(v, np.ndarray) for leaf in staged for piece in leaf for v in piece
    )
    if views_only:
        sources = [
            [
                [(a.device, v, a) for a, v in zip(read, views, strict=True)]
                for read, views in zip(leaf, staged_leaf, strict=True)
            ]
            for leaf, staged_leaf in zip(reads, staged, strict=True)
        ]
    return staged, sources, values
