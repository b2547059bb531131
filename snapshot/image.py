"""A snapshot as plain host data (numpy pieces + metadata), and its placement onto any target shardings.

A :class:`HostImage` is what travels between processes (to a keeper actor, from a persistent tier):
no device handles, no pytree definition (the restoring side brings its own structure). Each leaf is a
set of :class:`Piece` s, rectangular regions of the stored array that together cover it; typed PRNG
keys are stored as their ``jax.random.key_data`` (``key_impl`` names the implementation).
"""

from __future__ import annotations

import copy as copylib
import ctypes
import dataclasses
import mmap
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from .errors import SnapshotCorruptError, SnapshotStructureError

if TYPE_CHECKING:  # jax is imported where arrays are placed, so keeper actors holding images stay light
    import jax
    from jax.sharding import Sharding

__all__ = [
    "Index",
    "aligned_empty",
    "host_copy",
    "fresh_shards",
    "owned_copy",
    "place",
    "LeafImage",
    "Piece",
    "HostImage",
    "checksum",
    "meta_checksum",
    "region",
    "restore_image",
    "wrap_keys",
]

Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the stored array


def checksum(data: np.ndarray) -> int:
    """A 64-bit content hash of ``data``'s bytes (xxh3, several GB/s a core; releases the GIL)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data)


def meta_checksum(meta: dict[str, Any]) -> int:
    """The checksum of controller state (step, ledger, extras, ...), over its pickled bytes."""
    # Protocol 4: protocol 5 pickles a read-only numpy array (as one arrives through Ray) differently.
    return xxhash.xxh3_64_intdigest(pickle.dumps(meta, protocol=4))


def region(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Index:
    """A jax shard index (tuple of slices; None: the whole array) as explicit (start, stop) bounds."""
    index = () if index is None else index
    out = []
    for dim, s in zip(shape, tuple(index) + (slice(None),) * (len(shape) - len(index)), strict=True):
        start, stop, _ = s.indices(dim)
        out.append((start, stop))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Piece:
    index: Index
    data: np.ndarray
    checksum: int


@dataclass(frozen=True, kw_only=True)
class LeafImage:
    shape: tuple[int, ...]  # of the stored array (typed keys: the key data's shape)
    dtype: str  # numpy dtype name of the stored array
    key_impl: str | None = None  # set for typed PRNG keys
    pieces: tuple[Piece, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.pieces)


@dataclass(frozen=True, kw_only=True)
class HostImage:
    """One generation of the whole state on the host: resumes training at ``step``."""

    step: int
    generation: int
    leaves: tuple[LeafImage, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    meta_checksum: int = 0
    mac: str | None = None  # set by snapshot.seal under the job's image key (keeper tier)

    @property
    def nbytes(self) -> int:
        """Host bytes of every piece of every leaf."""
        return sum(leaf.nbytes for leaf in self.leaves)

    def private(self) -> HostImage:
        """This image with every piece copied into memory this process owns (a view into Ray's object store dies
        with the process that put it; a view of a snapshot's buffers changes with its next generation). ``meta``
        is deep-copied too: numpy arrays in it arrive as read-only views, and ``meta_checksum`` (pickle protocol 5)
        hashes a read-only array differently from a writable one."""
        leaves = tuple(
            dataclasses.replace(leaf, pieces=tuple(dataclasses.replace(p, data=host_copy(p.data)) for p in leaf.pieces))
            for leaf in self.leaves
        )
        return dataclasses.replace(self, leaves=leaves, meta=copylib.deepcopy(self.meta))

    def verify(self) -> None:
        """Raise :class:`SnapshotCorruptError` if any piece or the controller state changed."""
        if meta_checksum(self.meta) != self.meta_checksum:
            raise SnapshotCorruptError(self.step, -1)
        for i, leaf in enumerate(self.leaves):
            for piece in leaf.pieces:
                if checksum(piece.data) != piece.checksum:
                    raise SnapshotCorruptError(self.step, i)


POPULATE_FROM = 1 << 20  # buffers this large are mapped with their pages already in place (Linux)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault in a range's pages writable, in one call


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data is ``align``-byte aligned (jax on CPU then adopts it without a copy).

    One of ``POPULATE_FROM`` bytes or more is mapped on its own, its pages put in place in one call instead of one
    fault per 4 KiB page at the first write. On a virtual machine, where each first touch of a
    page exits to the host, a first copy into fresh pages runs several times slower than into a populated mapping
    (the mapping included): a snapshot's first generations write into fresh buffers. The pages are put
    in place by ``madvise(MADV_POPULATE_WRITE)`` through ``ctypes``, which releases the GIL (milliseconds per
    buffer, during which the training loop's thread would otherwise wait); ``MAP_POPULATE``, under the GIL, where
    that is not available."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes >= POPULATE_FROM and populate:
        size = nbytes + align
        off_gil = _madvise is not False
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if off_gil else populate))
        raw = np.frombuffer(region, dtype=np.uint8)  # the array holds the mapping open
        if off_gil and not _populate(raw.ctypes.data, size):
            raw[:: mmap.PAGESIZE] = 0  # the kernel refused it (before Linux 5.14): touched page by page, this once
    else:
        raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


_madvise: Any = None  # libc's madvise once loaded (None: not yet); False once it could not populate


def _populate(address: int, size: int) -> bool:
    """Put the pages of ``[address, address + size)`` in place, the GIL released; False where unsupported."""
    global _madvise
    madvise = _madvise  # read once: another copy thread may learn meanwhile that it is unsupported
    if madvise is None:
        try:
            madvise = _madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            madvise = _madvise = False
    if madvise is not False and madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) == 0:
        return True
    _madvise = False
    return False


def host_copy(data: np.ndarray) -> np.ndarray:
    """A writable copy of ``data`` in a buffer of this process's own (see :func:`aligned_empty`)."""
    out = aligned_empty(data.shape, data.dtype)
    np.copyto(out, data)
    return out


def _overlap(a: Index, b: Index) -> Index | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def assemble(want: Index, pieces: list[tuple[Index, np.ndarray]], dtype: Any) -> np.ndarray:
    """Region ``want`` as one array: the piece itself where one matches it exactly, else a fresh array
    copied from the pieces that overlap it.

    Raises :class:`SnapshotStructureError` if the pieces do not cover ``want``.
    """
    for index, data in pieces:
        if index == want:
            return data
    out = aligned_empty(tuple(hi - lo for lo, hi in want), np.dtype(dtype))
    covered = np.zeros(out.shape, dtype=bool)
    for index, data in pieces:
        ov = _overlap(index, want)
        if ov is None:
            continue
        dst = tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(ov, want, strict=True))
        src = tuple(slice(lo - i0, hi - i0) for (lo, hi), (i0, _) in zip(ov, index, strict=True))
        out[dst] = data[src]
        covered[dst] = True
    if not covered.all():
        raise SnapshotStructureError(f"the saved pieces do not cover region {want}")
    return out


_POOL: ThreadPoolExecutor | None = None


def owned_copy(data: np.ndarray, device: Any) -> jax.Array:
    """``data`` copied into a buffer the runtime owns on ``device``.

    Never aliases ``data``, and, unlike an array adopted from numpy, the buffer can be donated: the first
    step after a restore then updates it in place instead of copying the whole state again. The numpy
    bytes are wrapped without a copy first (aligned data on CPU), so the one copy is the runtime's.
    """
    import jax

    return jax.device_put(jax.device_put(data, device), device, may_alias=False)


def borrowed(data: np.ndarray, device: Any) -> jax.Array:
    """``data`` on ``device``, aliasing its bytes where the backend can (aligned host bytes on CPU), else a copy.

    Valid only while ``data`` is unchanged: the caller copies it into buffers of its own before the snapshot
    that owns ``data`` moves on (see ``Snapshotter.load(borrow=True)``)."""
    import jax

    return jax.device_put(data, device)


def fresh_shards(
    wants: list[tuple[Index, Any]], pieces: list[tuple[Index, np.ndarray]], dtype: np.dtype, *, borrow: bool = False
) -> list[jax.Array]:
    """For each (region, device) in ``wants``: a fresh, runtime-owned buffer on that device holding that
    region of ``pieces`` (assembled where needed), made on 2 threads (the copies release the GIL).
    ``borrow``: the region's host bytes wrapped instead (:func:`borrowed`), not copied."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(2, thread_name_prefix="snapshot-restore")
    make = borrowed if borrow else owned_copy
    return list(_POOL.map(lambda want: make(assemble(want[0], pieces, dtype), want[1]), wants))


def place(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: Sharding,
    pieces: list[tuple[Index, np.ndarray]],
    *,
    borrow: bool = False,
) -> jax.Array:
    """An array of ``shape`` on ``sharding`` whose every device shard is a fresh, runtime-owned buffer
    holding its region of ``pieces`` (``borrow``: the pieces' bytes, wrapped where they can be)."""
    import jax

    where = sharding.addressable_devices_indices_map(shape)
    arrays = fresh_shards([(region(idx, shape), d) for d, idx in where.items()], pieces, dtype, borrow=borrow)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def wrap_keys(data: jax.Array, key_impl: str, sharding: Sharding) -> jax.Array:
    """Typed PRNG keys from their key data, placed on ``sharding``."""
    import jax

    return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=key_impl), out_shardings=sharding)(data)


def restore_image(image: HostImage, treedef: Any, shardings: Any) -> Any:
    """The image's state as a pytree of ``treedef`` placed on ``shardings`` (one sharding per leaf).

    Verifies every checksum first; each device receives a fresh copy of its region.
    """
    import jax
    from jax.sharding import Sharding

    if treedef.num_leaves != len(image.leaves):
        raise SnapshotStructureError(
            f"the snapshot of step {image.step} holds {len(image.leaves)} leaves but the target state has "
            f"{treedef.num_leaves}: restore with the state structure that was saved"
        )
    try:
        targets = treedef.flatten_up_to(shardings)
    except (ValueError, TypeError) as err:
        raise SnapshotStructureError(f"the target shardings do not match the state structure {treedef}: {err}") from err
    targets = [t if isinstance(t, Sharding) else getattr(t, "sharding", None) for t in targets]
    image.verify()
    values = image.meta.get("_values", {})
    placed = []
    for i, (leaf, sharding) in enumerate(zip(image.leaves, targets, strict=True)):
        if i in values:  # a leaf that was not a jax.Array travels as a value
            placed.append(values[i])
            continue
        pieces = [(p.index, p.data) for p in leaf.pieces]
        # a key leaf's data takes the key's own sharding, its trailing key dimension whole
        arr = place(leaf.shape, np.dtype(leaf.dtype), sharding, pieces)
        placed.append(arr if leaf.key_impl is None else wrap_keys(arr, leaf.key_impl, sharding))
    return jax.tree_util.tree_unflatten(treedef, placed)
