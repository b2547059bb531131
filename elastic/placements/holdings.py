"""A worker's host snapshots in multi-process mode: its own shards, and the buddy copies its peers sent it.

During a group, the worker's own shards are snapshotted by a :class:`snapshot.Snapshotter` over this process's
devices (one copy: the second lives in another process), off the training thread; each generation it completes
is sent, as a :class:`snapshot.HostImage` of the regions this worker holds, to its buddy (the next member of the
group), and every ``keeper_every``-th to the job's keepers as this worker's part of the step. When the group
ends, the snapshotter is closed and its generations are kept as host images (its own buffers, no copy), so they
outlive the group's devices. What a worker holds is told by step (:meth:`Holdings.held`): for each leaf, the
regions held here and every region the leaf had on its mesh, so the driver can tell whether the survivors hold a
whole step between them (:func:`elastic.control.sources.common_step`), and any region of it is cut from the
pieces here (:meth:`find`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from elastic.snapshot import HostImage, SnapshotConfig, SnapshotInfo, Snapshotter
from elastic.snapshot.errors import SnapshotStructureError
from elastic.snapshot.image import Index, assemble, meta_checksum

__all__ = ["Holdings", "holders_of", "regions_of", "select"]

Send = Callable[[HostImage], None]


def regions_of(state_leaves: Sequence[Any]) -> list[list[Index]]:
    """Every region each leaf has on its sharding (the pieces that make it whole), as plain bounds; a typed key's
    regions are its key data's (the trailing key dimensions whole)."""
    return [sorted(held) for held in holders_of(state_leaves)]


def holders_of(state_leaves: Sequence[Any]) -> list[dict[Index, tuple[int, ...]]]:
    """For each leaf: each region (as stored: a typed key's key data), and the processes whose devices hold it."""
    import jax

    from elastic.snapshot.image import region

    out = []
    for leaf in state_leaves:
        shape = tuple(leaf.shape)
        trailing: tuple[tuple[int, int], ...] = ()
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data_shape = jax.eval_shape(jax.random.key_data, leaf).shape
            trailing = tuple((0, n) for n in data_shape[len(shape) :])
        held: dict[Index, set[int]] = {}
        for device, idx in leaf.sharding.devices_indices_map(shape).items():
            held.setdefault(region(idx, shape) + trailing, set()).add(device.process_index)
        out.append({r: tuple(sorted(p)) for r, p in held.items()})
    return out


def select(image: HostImage, keep: Callable[[int, Index], bool]) -> HostImage | None:
    """``image`` with only the pieces ``keep(leaf, index)`` chooses (None when it chooses none)."""
    leaves = tuple(
        dataclasses.replace(leaf, pieces=tuple(p for p in leaf.pieces if keep(i, p.index)))
        for i, leaf in enumerate(image.leaves)
    )
    if not any(leaf.pieces for leaf in leaves):
        return None
    return dataclasses.replace(image, leaves=leaves)


class Holdings:
    """The newest ``keep`` generations of this worker's own shards, and of each buddy's. Thread-safe: peers'
    buddy copies and the driver's questions arrive on other threads than the loop's."""

    def __init__(self, *, keep: int = 2, on_busy: str = "coalesce") -> None:
        self.keep = keep
        self._on_busy = on_busy
        self._lock = threading.Lock()
        self._own: dict[int, HostImage] = {}  # from earlier groups
        self._buddies: dict[int, dict[int, HostImage]] = {}  # slice -> step -> image
        self._snap: Snapshotter | None = None
        self._send: list[Send] = []
        self._static: dict[str, Any] = {}  # the group's meta added to every image (see save)
        self._stats = {
            "snapshots_requested": 0,
            "snapshots_taken": 0,
            "snapshots_coalesced": 0,
            "snapshots_failed": 0,
            "blocking_seconds": 0.0,
        }

    # -- a group's snapshots -------------------------------------------------------------------------------------
    def begin(self, slice_of: Callable[[Any], int], send: Sequence[Send], state: Any = None) -> None:
        """A new group: snapshots go to a new snapshotter over this process's devices (``slice_of`` names each
        device's slice); each completed generation is handed to every ``send`` (the buddy, the keepers). ``state``:
        the group's state, planned for now (its first snapshot then costs the training thread no planning)."""
        self._send = list(send)
        self._static = {}
        self._snap = Snapshotter(
            SnapshotConfig(keep=self.keep, copies=1, on_busy=self._on_busy),
            slice_of=slice_of,
            on_complete=self._completed,
        )
        if state is not None:
            self._snap.prepare(state)

    def save(self, step: int, state: Any, meta: dict[str, Any], static: dict[str, Any] | None = None) -> None:
        """Request a snapshot of this worker's shards of ``state`` (resuming at ``step``); returns at once.
        ``static``: meta that is the same for every snapshot of the group (the regions and layout of the state on
        its mesh), added to the images without being copied with each snapshot."""
        assert self._snap is not None, "save outside a group"
        if static is not None:
            self._static = static
        self._snap.save(step, state, meta)

    def _with_static(self, image: HostImage) -> HostImage:
        static = self._static
        if not static:
            return image
        meta = {**image.meta, **static}
        return dataclasses.replace(image, meta=meta, meta_checksum=meta_checksum(meta))  # the image stays verifiable

    def _completed(self, info: SnapshotInfo) -> None:
        """On the snapshot thread: hand the new generation to the buddy and the keepers (views of its buffers:
        they are not reused until two more generations complete, and Ray copies them when sending)."""
        if not self._send or self._snap is None:
            return
        image = self._with_static(self._snap.image(copy=False))
        for send in self._send:
            send(image)

    def end(self, timeout_s: float = 60.0, *, keep_in_flight: bool = True) -> None:
        """The group ends: wait (bounded) for the snapshot in flight (or, ``keep_in_flight=False``, abandon it: a
        restore of an older step follows), keep every generation as a host image (the snapshotter's own buffers,
        no copy), and close the snapshotter (its device handles go with the group)."""
        snap, self._snap = self._snap, None
        self._send = []
        if snap is None:
            return
        if not keep_in_flight:
            snap.cancel()
        try:
            snap.wait(timeout_s)
        except Exception:  # noqa: BLE001 - a failed or unfinished save: the complete generations still count
            pass
        images = [self._with_static(i) for i in snap.images(copy=False)]
        stats = snap.stats()
        snap.close(timeout=timeout_s)
        for key in self._stats:
            self._stats[key] += stats.get(key, 0)
        with self._lock:
            for image in images:
                self._own[image.step] = image
            _trim(self._own, self.keep)

    def stats(self, wait_s: float = 0.0) -> dict[str, Any]:
        """The snapshot counters, bytes held, and ``latest_step`` (this worker's newest complete generation);
        ``wait_s``: wait that long at most for the snapshot in flight first (the run's final one)."""
        if self._snap is not None and wait_s > 0:
            try:
                self._snap.wait(wait_s)
            except Exception:  # noqa: BLE001 - a failed or unfinished save: the complete generations still count
                pass
        s = dict(self._stats)
        if self._snap is not None:
            live = self._snap.stats()
            for key in s:
                s[key] += live.get(key, 0)
        with self._lock:
            own = self._own_images()
            s["held_bytes"] = sum(i.nbytes for i in own.values()) + sum(
                i.nbytes for g in self._buddies.values() for i in g.values()
            )
        s["state_bytes"] = max((i.nbytes for i in own.values()), default=0)
        s["latest_step"] = max(own, default=None)  # type: ignore[assignment]  # stats hold ints and floats
        return s

    # -- buddy copies --------------------------------------------------------------------------------------------
    def hold(self, slice_index: int, image: HostImage) -> None:
        """Keep a copy of ``slice_index``'s generation (private memory: the sender's may go)."""
        own = image.private()
        with self._lock:
            held = self._buddies.setdefault(slice_index, {})
            for step in [s for s in held if s > own.step]:  # a rollback: those belong to a discarded future
                del held[step]
            held[own.step] = own
            _trim(held, self.keep)

    # -- what is held ----------------------------------------------------------------------------------------------
    def _own_images(self) -> dict[int, HostImage]:
        images = dict(self._own)
        if self._snap is not None:
            try:
                for image in self._snap.images(copy=False):
                    images[image.step] = self._with_static(image)
            except Exception:  # noqa: BLE001 - nothing complete in this group yet
                pass
        return images

    def _images(self, step: int) -> tuple[HostImage | None, list[HostImage]]:
        with self._lock:
            own = self._own_images().get(step)
            buddies = [g[step] for g in self._buddies.values() if step in g]
        return own, buddies

    def held(self, wait_s: float = 60.0) -> dict[int, dict[str, Any]]:
        """Per step held (own or buddy): whether this worker's own generation of it is here, the regions held per
        leaf, and every region per leaf on the mesh it was taken on. A snapshot still being copied is waited for
        (up to ``wait_s``, 0: not at all): at a boundary, its snapshot is the one asked about."""
        snap = self._snap
        if snap is not None and wait_s > 0:
            try:
                snap.wait(wait_s)
            except Exception:  # noqa: BLE001 - a failed or unfinished save: the complete generations still count
                pass
        with self._lock:
            own = self._own_images()
            steps = set(own) | {s for g in self._buddies.values() for s in g}
            out: dict[int, dict[str, Any]] = {}
            for step in steps:
                images = ([own[step]] if step in own else []) + [g[step] for g in self._buddies.values() if step in g]
                leaves = len(images[0].leaves)
                out[step] = {
                    "own": step in own,
                    "held": [sorted({p.index for i in images for p in i.leaves[k].pieces}) for k in range(leaves)],
                    "regions": images[0].meta.get("_regions"),
                }
        return out

    def meta(self, step: int) -> dict[str, Any] | None:
        own, buddies = self._images(step)
        image = own or (buddies[0] if buddies else None)
        return None if image is None else copy.deepcopy(image.meta)

    def pieces(self, step: int, leaf: int) -> list[tuple[Index, np.ndarray]]:
        own, buddies = self._images(step)
        return [(p.index, p.data) for image in ([own] if own else []) + buddies for p in image.leaves[leaf].pieces]

    def find(self, step: int, leaf: int, index: Index) -> np.ndarray | None:
        """Region ``index`` of leaf ``leaf`` at ``step``, cut from the pieces held here (a fresh array), or None."""
        pieces = self.pieces(step, leaf)
        if not pieces:
            return None
        own, buddies = self._images(step)
        dtype = (own or buddies[0]).leaves[leaf].dtype
        try:
            return np.array(assemble(index, pieces, dtype), copy=True)
        except SnapshotStructureError:
            return None

    def overlapping(self, step: int, leaf: int, index: Index) -> list[tuple[Index, np.ndarray]]:
        """The parts of the pieces held here of leaf ``leaf`` at ``step`` that overlap region ``index``, each cut to
        the overlap (fresh arrays): what this worker can give towards that region."""
        out = []
        for held, data in self.pieces(step, leaf):
            bounds = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(held, index, strict=True))
            if any(lo >= hi for lo, hi in bounds):
                continue
            cut = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(bounds, held, strict=True))
            out.append((bounds, np.array(data[cut], copy=True)))
        return out

    def forget_after(self, step: int) -> None:
        """Drop every generation past ``step`` (they belong to a future the job rolled back from)."""
        with self._lock:
            for held in [self._own, *self._buddies.values()]:
                for s in [s for s in held if s > step]:
                    del held[s]


def _trim(generations: dict[int, HostImage], keep: int) -> None:
    for step in sorted(generations)[:-keep]:
        del generations[step]
