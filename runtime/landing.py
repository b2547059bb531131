"""Landing a restored state in the buffers of the state it replaces.

After a slice loss the survivors still hold the state that was live when it came (dropped, since it is not the
snapshot's step). On the CPU backend a fresh buffer costs its page faults: a freshly allocated device buffer
fills several times slower than memory already mapped. So a restore there
wraps the snapshot's bytes without a copy (``Snapshotter.load(borrow=True)``) and copies them, in one compiled
program per mesh, into the dropped state's survivor buffers, which it donates: the restore runs at memory speed
and allocates nothing. A shard the restore kept in place (a survivor's own buffer of the snapshot's step,
``Restored.kept``) is not copied: on that device the program leaves the dropped buffer as it is, and the kept
shard takes its place in the result. :func:`landing` says whether the dropped state can take the restored one
(every leaf has a ready buffer of the right shard shape on every target device); the program is compiled ahead
with the standby executables (:func:`land_args` is what to record). On other backends, or when a buffer is
missing, the restore copies into fresh buffers as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["LAND", "Landed", "land", "land_args", "landing", "landing_pays", "owned", "refusal"]


def _into(mesh: Mesh, specs: tuple[P, ...], flags: jax.Array, dst: list[Any], src: list[Any]) -> list[Any]:
    """The landing program: on each device, leaf ``i``'s shard of ``src`` written into its buffer of ``dst``
    (donated) where ``flags[i, d]`` is set for that device's place ``d`` in the mesh; elsewhere ``dst``'s shard as
    it is (nothing copied)."""

    def per_device(f: jax.Array, old: list[Any], new: list[Any]) -> list[Any]:
        me = jax.lax.axis_index(tuple(mesh.axis_names))
        return [
            jax.lax.cond(f[i, me], lambda a, b: b, lambda a, b: a, a, b)
            for i, (a, b) in enumerate(zip(old, new, strict=True))
        ]

    return shard_map(
        per_device, mesh=mesh, in_specs=(P(), list(specs), list(specs)), out_specs=list(specs), check_vma=False
    )(flags, dst, src)


_PROGRAM = jax.jit(_into, static_argnums=(0, 1), donate_argnums=3, keep_unused=True)


class _Land:
    """The landing program, called (and recorded for the standby compiles) as ``(flags, dst, src)``: its mesh is
    the arguments' and the leaves' specs theirs."""

    def __call__(self, flags: Any, dst: list[Any], src: list[Any]) -> list[Any]:
        return _PROGRAM(flags.sharding.mesh, _specs(dst), flags, dst, src)

    def lower(self, flags: Any, dst: list[Any], src: list[Any]) -> Any:
        return _PROGRAM.lower(flags.sharding.mesh, _specs(dst), flags, dst, src)


LAND = _Land()


def _specs(leaves: list[Any]) -> tuple[P, ...]:
    return tuple(x.sharding.spec for x in leaves)


def _flags(mesh: Mesh, kept: list[frozenset[Any]]) -> jax.Array:
    """Per leaf and place in ``mesh`` (its devices in order): whether that device copies (its shard was not kept
    in place). Its shape does not depend on the mesh (as many places as the process has devices), so that the
    program recorded on one mesh is the one compiled for another."""
    where = {d: i for i, d in enumerate(mesh.devices.flat)}
    flags = np.ones((len(kept), jax.device_count()), dtype=bool)
    for i, devices in enumerate(kept):
        for d in devices:
            flags[i, where[d]] = False
    return jax.device_put(flags, NamedSharding(mesh, P()))


def _landable(x: Any) -> bool:
    """An array leaf the landing program copies: a plain-dtype array on a NamedSharding (typed PRNG keys and
    other leaves pass through as restored)."""
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        and isinstance(getattr(x, "sharding", None), NamedSharding)
    )


def landing_pays(devices: Iterable[Any]) -> bool:
    """Whether landing is worth it on ``devices``: on CPU, where device memory is host memory that a fresh
    buffer maps page by page, and a host copy can be wrapped without a copy."""
    return all(d.platform == "cpu" for d in devices)


def land_args(state: Any) -> tuple[Any, ...]:
    """The landing program's arguments for a state shaped and placed like ``state`` (to record for the
    standby compiles, so that a landing compiles nothing); () when it has nothing to land on one mesh."""
    leaves = [x for x in jax.tree_util.tree_leaves(state) if _landable(x)]
    mesh = _mesh(leaves)
    return () if mesh is None else (_flags(mesh, [frozenset()] * len(leaves)), leaves, leaves)


def _mesh(leaves: list[Any]) -> Mesh | None:
    """The mesh every one of ``leaves`` is placed on; None when there is none or more than one."""
    meshes = {x.sharding.mesh for x in leaves}
    return meshes.pop() if len(meshes) == 1 else None


def landing(old: Any, target: Any) -> list[jax.Array] | None:
    """``old``'s buffers, as arrays placed like ``target``'s landable leaves (``target``: an abstract state whose
    leaves carry their sharding), for :func:`land`; None unless every one of them has, on every device of its
    sharding, a shard of ``old``'s same leaf of the same shape and dtype, computed without error and not donated."""
    old_leaves, old_def = jax.tree_util.tree_flatten(old)
    new_leaves, new_def = jax.tree_util.tree_flatten(target)
    if old_def != new_def:  # type: ignore[operator]  # jaxlib's PyTreeDef compares
        return None
    out: list[jax.Array] = []
    taken: set[int] = set()
    for was, want in zip(old_leaves, new_leaves, strict=True):
        if not _landable(want):
            continue
        if not isinstance(was, jax.Array) or was.dtype != want.dtype or was.is_deleted():
            return None
        have = {s.device: s.data for s in was.addressable_shards}
        shard_shape = want.sharding.shard_shape(want.shape)
        buffers = []
        for device in want.sharding.addressable_devices_indices_map(want.shape):
            buf = have.get(device)
            if buf is None or buf.shape != shard_shape or not buf.is_ready() or id(buf) in taken:
                return None
            taken.add(id(buf))
            try:
                buf.block_until_ready()  # ready: returns at once, or raises what its computation failed with
            except Exception:  # noqa: BLE001 - a failed step's output cannot take anything
                return None
            buffers.append(buf)
        out.append(jax.make_array_from_single_device_arrays(want.shape, want.sharding, buffers))
    return out


def _spans(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """The memory each shard occupies, as (start, end) addresses."""
    out = []
    for x in arrays:
        for s in x.addressable_shards:
            start = s.data.unsafe_buffer_pointer()
            out.append((start, start + s.data.nbytes))
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether a span of ``a`` and one of ``b`` share an address (a sweep in address order)."""
    reach = [0, 0]  # the furthest end seen so far, of a's spans and of b's
    for lo, hi, side in sorted([(lo, hi, 0) for lo, hi in a] + [(lo, hi, 1) for lo, hi in b]):
        if lo < reach[1 - side]:
            return True
        reach[side] = max(reach[side], hi)
    return False


class Landed(NamedTuple):
    """What :func:`land` made: the ``state``, and the ``spare`` buffers of the dropped state it did not need (those
    under the shards kept in place), to free off the recovery's path (freeing them beside the first step on the new
    mesh slows it)."""

    state: Any
    spare: list[jax.Array]


def land(dst: list[jax.Array], state: Any, kept: tuple[frozenset[Any], ...] = ()) -> Landed | None:
    """``state`` with its landable leaves copied into ``dst``'s buffers (:func:`landing`), which are donated:
    nothing is allocated. ``kept``: per leaf of ``state`` (``tree_leaves`` order), the devices whose shard the
    restore kept in place (the runtime's own buffer); those stay as they are and nothing is copied there (``dst``'s
    buffers on them come back as ``spare``). Every other shard of the result aliases nothing ``state`` held. Returns
    at once; the copies run on the devices. None (nothing done) when ``state`` reads memory of one of ``dst``'s
    buffers (its own shard, or a view of one): a buffer cannot be both donated and read by one call (use
    :func:`owned`), or when the leaves are not all on one mesh."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    where = [i for i, x in enumerate(leaves) if _landable(x)]
    src = [leaves[i] for i in where]
    mesh = _mesh(dst + src)
    if mesh is None or _refusal(dst, src):
        return None
    keep = [kept[i] if i < len(kept) else frozenset() for i in where]
    with warnings.catch_warnings():  # a buffer something else still reads is copied instead of donated: fine
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        copied = LAND(_flags(mesh, keep), dst, src)
    spare: list[jax.Array] = []
    for i, devices, x in zip(where, keep, copied, strict=True):
        if devices:  # the kept shards take the place of the buffers left as they were there
            mine = {s.device: s.data for s in leaves[i].addressable_shards}
            out = {s.device: s.data for s in x.addressable_shards}
            spare.extend(out[d] for d in devices)
            order = x.sharding.addressable_devices_indices_map(x.shape)
            x = jax.make_array_from_single_device_arrays(
                x.shape, x.sharding, [mine[d] if d in devices else out[d] for d in order]
            )
        leaves[i] = x
    return Landed(jax.tree_util.tree_unflatten(treedef, leaves), spare)


def refusal(dst: list[jax.Array], state: Any) -> str:
    """Why :func:`land` would do nothing with ``dst`` and ``state`` ("" when it would land)."""
    return _refusal(dst, [x for x in jax.tree_util.tree_leaves(state) if _landable(x)])


def _refusal(dst: list[jax.Array], src: list[jax.Array]) -> str:
    if not src:
        return "no leaf to land"
    if _mesh(dst + src) is None:
        return "the leaves are not on one mesh"
    theirs = {(s.device, s.data.unsafe_buffer_pointer()) for x in dst for s in x.addressable_shards}
    if any((s.device, s.data.unsafe_buffer_pointer()) in theirs for x in src for s in x.addressable_shards):
        # the dropped state is the snapshot's own step (the loss came while its snapshot was still in flight): the
        # restore keeps its buffers in place, so they cannot also be donated
        return "the restore keeps the dropped state's own buffers (a loss at the step of a snapshot in flight)"
    if _overlap(_spans(dst), _spans(src)):
        return "the state reads a buffer it would donate"
    return ""


def owned(state: Any, kept: tuple[frozenset[Any], ...] = ()) -> Any:
    """``state`` with every landable leaf's shards copied into fresh buffers the runtime owns (what a restore
    that could not land does with a borrowed state), but for the shards ``kept`` in place (as in :func:`land`)."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    for i, x in enumerate(leaves):
        if _landable(x):
            devices = kept[i] if i < len(kept) else frozenset()
            shards = [
                s.data if s.device in devices else jax.device_put(s.data, s.device, may_alias=False)
                for s in x.addressable_shards
            ]
            leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    return jax.tree_util.tree_unflatten(treedef, leaves)
