"""A worker's restore in multi-process mode: each of its devices gets its region of every leaf.

Each region is cut from the pieces held in this process (its own snapshot, the buddy copies it holds) when
they cover it, and asked of the peers (or the keepers) only when they do not: what crosses between processes is
what this worker does not hold. Every device receives a buffer the runtime owns (never a view of a snapshot, so the
first step may donate it: adopting the host bytes without a copy makes the restore cheaper by about as much as it makes
the first step dearer, which then allocates its outputs; see docs/benchmarks.md). Typed PRNG keys travel as their key
data and are wrapped back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from elastic.snapshot.errors import SnapshotStructureError
from elastic.snapshot.image import Index, assemble, owned_copy, region, wrap_keys

__all__ = ["Layout", "layout_of", "own_pieces", "restore_state"]

Layout = list[tuple[tuple[int, ...], str, str | None]]  # per leaf: stored shape, stored dtype, key impl (or None)


def layout_of(leaves: Sequence[Any]) -> Layout:
    """How each leaf is stored in a snapshot: shape and dtype (a typed key's key data), and the key impl."""
    out: Layout = []
    for leaf in leaves:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = jax.eval_shape(jax.random.key_data, leaf)
            out.append((tuple(data.shape), np.dtype(data.dtype).name, str(jax.random.key_impl(leaf))))
        else:
            out.append((tuple(leaf.shape), np.dtype(leaf.dtype).name, None))
    return out


Pieces = list[tuple[Index, np.ndarray]]


def restore_state(
    abstract: Any,
    shardings: Any,
    layout: Layout,
    *,
    local: Callable[[int], Pieces],
    fetch: Callable[[int, Index, Pieces], Pieces],
    what: str,
) -> Any:
    """``abstract``'s state on ``shardings``, each device's region from ``local(leaf)`` pieces when they cover it,
    else with the pieces ``fetch(leaf, region, have)`` brings (what other processes hold of it; ``have``: the
    pieces at hand). Raises ``RuntimeError`` naming ``what`` when they do not cover a region."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    targets = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]  # a jaxlib PyTreeDef
    if len(layout) != len(leaves):
        raise SnapshotStructureError(f"{what}: the snapshot holds {len(layout)} leaves, the state has {len(leaves)}")
    placed = []
    for i, ((shape, dtype, key_impl), sharding) in enumerate(zip(layout, targets, strict=True)):
        pieces = local(i)
        arrays = []
        for device, idx in sharding.addressable_devices_indices_map(shape).items():
            want = region(idx, shape)
            data = _assemble(want, pieces, dtype)
            if data is None:
                pieces = pieces + fetch(i, want, pieces)
                data = _assemble(want, pieces, dtype)
            if data is None:
                raise RuntimeError(f"no process holds region {want} of leaf {i} for {what}")
            arrays.append(owned_copy(np.asarray(data), device))
        arr = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        placed.append(arr if key_impl is None else wrap_keys(arr, key_impl, sharding))
    return jax.tree_util.tree_unflatten(treedef, placed)


def _assemble(want: Index, pieces: Pieces, dtype: str) -> np.ndarray | None:
    if not pieces:
        return None
    try:
        return assemble(want, pieces, np.dtype(dtype))
    except SnapshotStructureError:
        return None


def covers(want: Index, pieces: Pieces, dtype: str) -> bool:
    """Whether ``pieces`` cover region ``want``."""
    return _assemble(want, pieces, dtype) is not None


def own_pieces(state: Any) -> dict[str, Any]:
    """This process's pieces of ``state`` (its own regions, host arrays) per leaf, and the state's layout (typed
    keys as their key data): ``{"layout": [], "pieces": []}`` for no state."""
    if state is None:
        return {"layout": [], "pieces": []}
    leaves = jax.tree_util.tree_leaves(state)
    out = []
    for leaf in leaves:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        seen: dict[Any, Any] = {}
        for shard in leaf.addressable_shards:
            index = region(shard.index, tuple(leaf.shape))
            if index not in seen:
                seen[index] = jax.device_get(shard.data)
        out.append(list(seen.items()))
    return {"layout": layout_of(leaves), "pieces": out}
