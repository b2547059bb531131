"""How a shard gets into the host memory attached to a device: one seam, two backends.

``HostEngine`` serves backends whose device memory already is host memory (CPU): it takes a
zero-copy view of a computed shard on the training thread (which also keeps the buffer from being
donated while the copy runs), or, for a shard still being computed, dispatches a device-side copy behind the
computation (one compiled call per device, compiled on the copy thread after the first save of a layout, which takes a
``device_put`` into ``pinned_host`` instead: such a ``device_put`` often holds the calling thread for milliseconds to a
hundred on CPU, where a compiled copy returns at once); it copies that with numpy into a reused, aligned buffer on a
background thread, and hands the buffer to jax as a ``pinned_host`` array of the destination device (zero-copy on
CPU). Neither waits for compute on the training thread.
``DeviceEngine`` serves accelerators: the training thread dispatches an asynchronous
``device_put`` into the destination device's ``pinned_host`` memory (the runtime orders it before any
later donation) and a device-side checksum; nothing crosses into the client process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import SingleDeviceSharding

from .image import aligned_empty, checksum

__all__ = ["Copy", "DeviceEngine", "Engine", "HostEngine", "aligned_empty", "pick_engine"]

CHUNK = 1 << 21  # bytes copied then hashed while still in cache


@dataclass(frozen=True, kw_only=True)
class Copy:
    """One copy of one piece, in the host memory attached to ``device``."""

    device: Any
    slice: int
    array: jax.Array  # memory kind ``pinned_host`` on ``device``
    buffer: np.ndarray | None = None  # the bytes themselves where the engine owns them (HostEngine)


class Engine(Protocol):
    name: str

    def stage_pieces(self, pieces: list[tuple[list[jax.Array], list[Any]]]) -> list[list[Any]]:
        """On the training thread, for every copy of every piece (given as the shards its copies read and their
        destinations): what ``write`` will read. Cheap, safe against the state's later donation, and never waits
        for compute."""

    def write(self, staged: Any, dest: Any, slice_: int, buffer: np.ndarray | None) -> Copy:
        """On the background thread: the finished copy in ``dest``'s host memory."""

    def write_checksummed(self, staged: Any, dest: Any, slice_: int, buffer: np.ndarray | None) -> tuple[Copy, int]:
        """``write``, and the copy's checksum (the same value ``checksum(copy)`` gives)."""

    def checksum(self, copy: Copy) -> int:
        """The checksum of a finished copy, computed where the copy lives."""

    def warm(self) -> None:
        """On the copy thread, between generations: compile what makes later ``stage_pieces`` calls cheap."""

    def host_view(self, copy: Copy) -> np.ndarray:
        """The copy's bytes as a read-only numpy array (for a transfer to another tier)."""


def _computed(x: jax.Array) -> bool:
    """Whether ``x``'s value exists yet (``ArrayImpl.is_ready``, which the ``jax.Array`` stub does not name)."""
    return bool(x.is_ready())  # type: ignore[attr-defined]


class HostEngine:
    name = "host"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # each device-side copy met (device, then each shape, dtype): its specs while not compiled yet, True once
        # compiled, False once its compile was tried (failed or under way: staged with ``device_put`` meanwhile)
        self._copies: dict[tuple[Any, ...], list[jax.ShapeDtypeStruct] | bool] = {}

    def stage_pieces(self, pieces: list[tuple[list[jax.Array], list[Any]]]) -> list[list[Any]]:
        """A piece whose shards are computed: zero-copy views. One still being computed: a device-side copy of its
        first shard, dispatched behind the computation (the runtime orders it before any later donation; one
        compiled call per device copies all of that device's pieces), which every copy of the piece reads once it
        has landed (on the copy thread). Until :meth:`warm` has compiled a device's copy for these shapes, a
        ``device_put`` into ``pinned_host`` does it instead (no compile on the training thread)."""
        staged: list[list[Any]] = []
        pending: dict[Any, list[int]] = {}  # device -> the pieces whose first shard it holds
        for shards, _ in pieces:
            if all(_computed(s) for s in shards):
                staged.append([np.asarray(s) for s in shards])
            else:
                pending.setdefault(shards[0].device, []).append(len(staged))
                staged.append([])
        for device, numbers in pending.items():
            firsts = [pieces[n][0][0] for n in numbers]
            key = (device, *((x.shape, x.dtype) for x in firsts))
            with self._lock:
                compiled = self._copies.setdefault(
                    key, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in firsts]
                )
            if compiled is True:
                landed = _copy_all(firsts)
            else:
                landed = jax.device_put(firsts, [SingleDeviceSharding(device, memory_kind="pinned_host")] * len(firsts))
            for n, landing in zip(numbers, landed, strict=True):
                staged[n] = [landing] * len(pieces[n][0])
        return staged

    def warm(self) -> None:
        """On the copy thread: compile the device-side copies ``stage_pieces`` has met without one (each is tried
        once: a compile that raises leaves its shapes on the ``device_put`` path)."""
        while True:
            with self._lock:
                key = next((k for k, v in self._copies.items() if isinstance(v, list)), None)
                if key is None:
                    return
                specs, self._copies[key] = self._copies[key], False
            _copy_all.lower(specs).compile()
            with self._lock:
                self._copies[key] = True

    def write(self, staged: np.ndarray | jax.Array, dest: Any, slice_: int, buffer: np.ndarray | None) -> Copy:
        return self._write(staged, dest, slice_, buffer, None)

    def write_checksummed(
        self, staged: np.ndarray | jax.Array, dest: Any, slice_: int, buffer: np.ndarray | None
    ) -> tuple[Copy, int]:
        hasher = xxhash.xxh3_64()
        return self._write(staged, dest, slice_, buffer, hasher), hasher.intdigest()

    def _write(
        self, staged: np.ndarray | jax.Array, dest: Any, slice_: int, buffer: np.ndarray | None, hasher: Any
    ) -> Copy:
        """Copy in cache-sized chunks, hashing each chunk while it is still in cache."""
        if isinstance(staged, jax.Array):  # a landing transfer (``stage_pieces``): wait for it here, off the loop
            staged = np.asarray(staged)
        if buffer is None or buffer.shape != staged.shape or buffer.dtype != staged.dtype:
            buffer = aligned_empty(staged.shape, staged.dtype)
        src = staged.reshape(-1).view(np.uint8) if staged.size else staged.reshape(-1)
        dst = buffer.reshape(-1).view(np.uint8) if buffer.size else buffer.reshape(-1)
        for start in range(0, max(dst.size, 1), CHUNK):
            np.copyto(dst[start : start + CHUNK], src[start : start + CHUNK])
            if hasher is not None:
                hasher.update(dst[start : start + CHUNK])
        array = jax.device_put(buffer, SingleDeviceSharding(dest, memory_kind="pinned_host"))
        return Copy(device=dest, slice=slice_, array=array, buffer=buffer)

    def checksum(self, copy: Copy) -> int:
        assert copy.buffer is not None
        return checksum(copy.buffer)

    def host_view(self, copy: Copy) -> np.ndarray:
        assert copy.buffer is not None
        return copy.buffer


def _device_hash(x: jax.Array) -> jax.Array:
    """A position-weighted 32-bit sum of the words of ``x``: any single changed word changes it."""
    if x.dtype.itemsize == 8:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    elif x.dtype.itemsize == 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    elif x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32).reshape(-1)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16}[x.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    weights = (jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


_hash = jax.jit(_device_hash)


@jax.jit
def _copy_all(xs: list[jax.Array]) -> list[jax.Array]:
    """New buffers holding ``xs``'s values, on their device (all of ``xs`` on one device)."""
    return [jnp.copy(x) for x in xs]


class DeviceEngine:
    name = "device"

    def warm(self) -> None:
        """Nothing to compile: each transfer is a ``device_put``."""

    def stage(self, shard: jax.Array, dest: Any) -> jax.Array:
        return jax.device_put(shard, SingleDeviceSharding(dest, memory_kind="pinned_host"))

    def stage_pieces(self, pieces: list[tuple[list[jax.Array], list[Any]]]) -> list[list[Any]]:
        return [[self.stage(s, d) for s, d in zip(shards, dests, strict=True)] for shards, dests in pieces]

    def write(self, staged: jax.Array, dest: Any, slice_: int, buffer: np.ndarray | None) -> Copy:
        staged.block_until_ready()
        return Copy(device=dest, slice=slice_, array=staged)

    def write_checksummed(
        self, staged: jax.Array, dest: Any, slice_: int, buffer: np.ndarray | None
    ) -> tuple[Copy, int]:
        copy = self.write(staged, dest, slice_, buffer)
        return copy, self.checksum(copy)

    def checksum(self, copy: Copy) -> int:
        on_device = jax.device_put(copy.array, SingleDeviceSharding(copy.device, memory_kind="device"))
        return int(_hash(on_device))

    def host_view(self, copy: Copy) -> np.ndarray:
        return np.asarray(copy.array)


def pick_engine(name: str, devices: Any) -> Engine:
    """``auto``: the host engine where devices are CPUs, the device engine elsewhere."""
    if name == "auto":
        name = "host" if all(d.platform == "cpu" for d in devices) else "device"
    return HostEngine() if name == "host" else DeviceEngine()
