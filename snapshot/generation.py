"""One complete snapshot held next to its shards, and its restore from surviving copies only.

The client holds this record: tree structure, step, controller state, and per piece its region, its
checksum and handles to its copies. The bytes stay in the host memory of the copies' devices.
Restore reads only copies on available devices (the survivors), verifies each piece once, tries
another copy when one fails its checksum, and places every target shard on its device.
"""

from __future__ import annotations

import copy as copylib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import structlog
from jax.sharding import Sharding, SingleDeviceSharding

from .engine import Copy, Engine
from .errors import SnapshotCorruptError, SnapshotUnavailableError
from .image import HostImage, Index, LeafImage, Piece, checksum, host_copy, meta_checksum, place, region, wrap_keys

__all__ = ["Generation", "LeafRecord", "PieceRecord", "Guard", "reachable", "restore_generation", "to_image"]

log = structlog.get_logger("snapshot")

Guard = Callable[[Iterable[Any]], None]  # raises when a device (and its host memory) is unreachable


@dataclass(frozen=True, kw_only=True)
class PieceRecord:
    index: Index
    checksum: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, kw_only=True)
class LeafRecord:
    shape: tuple[int, ...] = ()
    dtype: str = ""
    key_impl: str | None = None
    pieces: tuple[PieceRecord, ...] = ()
    value: Any = None  # a leaf that is not a jax.Array (a Python scalar, a numpy array): kept as is
    is_array: bool = True


@dataclass(frozen=True, kw_only=True)
class Generation:
    number: int
    step: int
    treedef: Any
    leaves: tuple[LeafRecord, ...]
    meta: dict[str, Any]
    meta_checksum: int
    slot: int
    state_bytes: int  # one logical copy of the array leaves
    held_bytes: int  # every copy
    copies: int  # the fewest distinct slices holding any piece
    created: float = field(default=0.0)


def _readable(piece: PieceRecord, available: set[Any]) -> list[Copy]:
    return [c for c in piece.copies if c.device in available]


def _verified(
    gen: Generation, leaf: int, piece: PieceRecord, available: set[Any], engine: Engine, guard: Guard | None
) -> Copy:
    """An intact copy of ``piece`` on an available device (checksummed where it lives)."""
    candidates = _readable(piece, available)
    if not candidates:
        raise SnapshotUnavailableError(gen.step, leaf, tuple(sorted({c.slice for c in piece.copies})))
    readable = 0
    for c in candidates:
        if guard is not None:
            try:
                guard([c.device])
            except Exception:  # noqa: BLE001 - a device lost since ``available`` was computed: try another copy
                log.warning("snapshot_copy_unreachable", step=gen.step, leaf=leaf, slice=c.slice, device=c.device.id)
                continue
        readable += 1
        if engine.checksum(c) == piece.checksum:
            return c
        log.warning(
            "snapshot_copy_corrupt", step=gen.step, generation=gen.number, leaf=leaf, slice=c.slice, device=c.device.id
        )
    if not readable:
        raise SnapshotUnavailableError(gen.step, leaf, tuple(sorted({c.slice for c in piece.copies})))
    raise SnapshotCorruptError(gen.step, leaf)


def _place_leaf(
    rec: LeafRecord, chosen: dict[Index, Copy], sharding: Sharding, engine: Engine, *, borrow: bool
) -> jax.Array:
    if engine.name == "device":
        arrays: list[jax.Array] = []
        exact = True
        for device, idx in sharding.addressable_devices_indices_map(rec.shape).items():
            src = chosen.get(region(idx, rec.shape))
            if src is None:
                exact = False
                break
            local = jax.device_put(src.array, SingleDeviceSharding(src.device, memory_kind="device"))
            arrays.append(jax.device_put(local, SingleDeviceSharding(device)))  # device to device
        if exact:
            arr: jax.Array = jax.make_array_from_single_device_arrays(rec.shape, sharding, arrays)
            return arr if rec.key_impl is None else wrap_keys(arr, rec.key_impl, sharding)
    pieces = [(index, engine.host_view(c)) for index, c in chosen.items()]
    arr = place(rec.shape, np.dtype(rec.dtype), sharding, pieces, borrow=borrow)
    return arr if rec.key_impl is None else wrap_keys(arr, rec.key_impl, sharding)


def restore_generation(
    gen: Generation,
    targets: list[Sharding | None],
    available: set[Any],
    engine: Engine,
    guard: Guard | None,
    *,
    borrow: bool = False,
) -> Any:
    """``gen``'s state on ``targets`` (one sharding per leaf), read from copies on ``available`` devices only.

    Raises :class:`SnapshotUnavailableError` when a piece has no copy there, and
    :class:`SnapshotCorruptError` when the controller state or every readable copy of a piece fails its
    checksum. Each device receives a fresh buffer the runtime owns: the restored state never aliases the
    snapshot, and the generation stays restorable. ``borrow``: a host copy's bytes are wrapped instead of copied
    where the backend can (:func:`~.image.borrowed`); the state is then valid only until the caller copies it.
    """
    if meta_checksum(gen.meta) != gen.meta_checksum:
        raise SnapshotCorruptError(gen.step, -1)
    chosen_by_leaf = []
    for i, rec in enumerate(gen.leaves):
        chosen_by_leaf.append(
            {p.index: _verified(gen, i, p, available, engine, guard) for p in rec.pieces} if rec.is_array else {}
        )
    placed = []
    for rec, chosen, sharding in zip(gen.leaves, chosen_by_leaf, targets, strict=True):
        if not rec.is_array:
            placed.append(copylib.deepcopy(rec.value))
            continue
        assert sharding is not None  # an array leaf has a target
        placed.append(_place_leaf(rec, chosen, sharding, engine, borrow=borrow))
    return jax.tree_util.tree_unflatten(gen.treedef, placed)


def reachable(guard: Guard | None, device: Any) -> bool:
    if guard is None:
        return True
    try:
        guard([device])
    except Exception:  # noqa: BLE001 - the guard's error is the backend's slice-loss error
        return False
    return True


def to_image(gen: Generation, engine: Engine, available: set[Any], *, copy: bool = True) -> HostImage:
    """A host copy of ``gen`` (one copy per piece, from ``available`` devices), to send to another tier.
    A non-array leaf travels in ``meta["_values"]``. Raises :class:`SnapshotUnavailableError` when a
    piece has no copy on an available device. ``copy=False``: each piece is a read-only view of the copy's
    host bytes (the host engine's own buffers), not a copy."""
    leaves = []
    values = {}
    for i, rec in enumerate(gen.leaves):
        if not rec.is_array:
            values[i] = rec.value
            leaves.append(LeafImage(shape=(), dtype="", pieces=()))
            continue
        pieces = []
        for p in rec.pieces:
            c = next((c for c in p.copies if c.device in available), None)
            if c is None:
                raise SnapshotUnavailableError(gen.step, i, tuple(sorted({c.slice for c in p.copies})))
            data = engine.host_view(c)
            if copy:
                data = host_copy(data)
            else:
                data = data.view()
                data.flags.writeable = False
            pieces.append(
                Piece(
                    index=p.index,
                    data=data,
                    checksum=p.checksum if engine.name == "host" else checksum(engine.host_view(c)),
                )
            )
        leaves.append(LeafImage(shape=rec.shape, dtype=rec.dtype, key_impl=rec.key_impl, pieces=tuple(pieces)))
    meta = dict(gen.meta, _values=values)
    return HostImage(
        step=gen.step, generation=gen.number, leaves=tuple(leaves), meta=meta, meta_checksum=meta_checksum(meta)
    )
