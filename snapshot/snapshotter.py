"""The Snapshotter: asynchronous, double-buffered host snapshots that stay next to their shards.

``save(step, state, meta)`` returns once its shards are staged, without waiting for the state to be
computed (zero-copy views of computed shards, or dispatched transfers to host memory that land behind the
computation); a background thread copies every distinct shard into
the host memory of ``copies`` devices on distinct slices, checksums each piece where it lives, and
publishes the generation only when it is complete. ``keep`` complete generations are held; buffers
are reused across generations (``keep + 1`` slots: the one being written never holds a complete
generation). A save requested while another waits behind the one in flight replaces the waiting one
(``on_busy="coalesce"``, counted in ``stats()["snapshots_coalesced"]``) or blocks until it starts
(``on_busy="wait"``). Nothing is dropped without being counted; a failed save leaves the previous
generations restorable and is raised by the next ``wait()``.
"""

from __future__ import annotations

import copy as copylib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import structlog
from jax.sharding import Sharding

from .config import Restored, SnapshotConfig, SnapshotInfo
from .copier import Abandoned, copy_pieces
from .counters import new_counters, summary
from .engine import Engine, pick_engine
from .errors import NoSnapshotError, SnapshotFailedError
from .generation import Generation, Guard, reachable, to_image
from .image import HostImage
from .loading import from_generations, from_staged, targets_of
from .plan import SliceOf, default_slice_of
from .requests import Requests
from .ring import Ring
from .staged import StagedRequest
from .staging import Layout, as_arrays, stage

__all__ = ["Restored", "SnapshotConfig", "SnapshotInfo", "Snapshotter"]

log = structlog.get_logger("snapshot")


class Snapshotter:
    """Host snapshots of one job's sharded state. ``slice_of(device) -> int`` groups devices into slices;
    ``guard(devices)`` raises when a device's memory is unreachable (simulated slice loss)."""

    def __init__(
        self,
        config: SnapshotConfig | None = None,
        *,
        slice_of: SliceOf | None = None,
        guard: Guard | None = None,
        on_complete: Callable[[SnapshotInfo], None] | None = None,
    ) -> None:
        self.config = config or SnapshotConfig()
        self._on_complete = on_complete  # called on the background thread after each generation completes
        self._slice_of = slice_of or default_slice_of
        self._guard = guard
        self._engine: Engine | None = None
        self._layout = Layout(self.config.copies, self._slice_of)
        self._ring = Ring(self.config.keep)
        self._retired: list[jax.Array] = []  # the shards the newest generation's views held (see ``_copy``)
        self._skips_said: set[tuple[int, int | None, str]] = set()  # (request, slice, cause) logged: once each
        self._running = threading.Event()  # cleared by ``pause``: the copy in flight holds between pieces
        self._running.set()
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="snapshot-copy")
        self._stats = new_counters()
        self._requests = Requests(self.config.on_busy, self._stats)
        self._cv = self._requests.cv  # guards the requests, the ring and the counters
        self._worker = threading.Thread(target=self._work, name="snapshot-worker", daemon=True)
        self._worker.start()

    # -- the training thread ---------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> int:
        """Request a snapshot of ``state`` (resuming at ``step``); returns its generation number.

        Waits for nothing: computed shards are staged as zero-copy views, a shard still being computed gets a
        transfer dispatched behind its computation, and the copy thread completes the generation once they land.
        """
        t0 = time.perf_counter()
        leaves, treedef = jax.tree_util.tree_flatten(state)
        arrays, key_impls = as_arrays(leaves)
        plans = self._layout.plans(arrays)
        staged, sources, values = stage(arrays, plans, self._engine_for(arrays))
        req = self._requests.submit(
            step,
            lambda number: StagedRequest(
                number=number,
                step=step,
                treedef=treedef,
                plans=plans,
                staged=staged,
                sources=sources,
                values=values,
                key_impls=key_impls,
                meta=copylib.deepcopy(dict(meta or {})),
            ),
        )
        blocked = time.perf_counter() - t0
        self._stats["blocking_seconds"] += blocked
        self._stats["last_blocking_seconds"] = blocked
        return req.number

    def prepare(self, state: Any) -> None:
        """Plan where each byte of ``state``'s snapshots goes now (it is planned once per layout), so that the first
        ``save`` of a new mesh does not pay for it on the training thread."""
        arrays, _ = as_arrays(jax.tree_util.tree_leaves(state))
        self._layout.plans(arrays)
        self._engine_for(arrays)

    def _engine_for(self, arrays: list[Any]) -> Engine:
        if self._engine is None:
            devices = [d for x in arrays if isinstance(x, jax.Array) for d in x.sharding.device_set]
            self._engine = pick_engine(self.config.engine, devices)
        return self._engine

    # -- the background thread -------------------------------------------------------------
    def _work(self) -> None:
        while (req := self._requests.take()) is not None:
            try:
                gen = self._copy(req)
            except Abandoned:
                self._requests.settle("snapshots_abandoned")
                continue
            except Exception as err:  # noqa: BLE001 - any failure leaves the previous generation intact
                self._requests.settle(
                    "snapshots_failed", SnapshotFailedError(req.step, f"{type(err).__name__}: {err}"[:300])
                )
                log.warning("snapshot_failed", step=req.step, error=str(err)[:200])
                continue
            with self._cv:
                self._publish(gen)
            if self._on_complete is not None:
                try:
                    self._on_complete(_info(gen))
                except Exception as err:  # noqa: BLE001 - a tier's trouble must not stop snapshots
                    log.warning("snapshot_on_complete_failed", step=gen.step, error=str(err)[:200])
            self._requests.settle()
            try:
                if self._engine is not None:
                    self._engine.warm()  # the copies the next saves stage: compiled here, not on the training thread
            except Exception as err:  # noqa: BLE001 - then staging keeps its uncompiled path
                log.warning("snapshot_warm_failed", error=str(err)[:200])

    def _first_skip(self, said: tuple[int, int | None, str]) -> bool:
        with self._cv:
            first = said not in self._skips_said
            self._skips_said.add(said)
        return first

    def _copy(self, req: StagedRequest) -> Generation:
        t0 = time.perf_counter()
        engine = self._engine
        assert engine is not None
        with self._cv:
            slot = self._ring.free_slot()
        records, buffers = copy_pieces(
            req,
            engine=engine,
            pool=self._pool,
            reuse=self._ring.slots.get(slot, {}),
            guard=self._guard,
            running=self._running,
            first_skip=self._first_skip,
        )
        self._ring.slots[slot] = buffers
        # Release the views (the state's buffers can be donated again), but keep the shards they viewed until the
        # next generation is copied: the views kept the next step from donating them, and the loop drops its state
        # a step or two later; whoever drops the last reference frees them, and here that is this thread, as this
        # assignment drops the previous generation's (freeing hundreds of MB of them on the loop's thread held it
        # for about a step).
        self._retired = [a for leaf in req.sources for piece in leaf for _, _, a in piece]
        req.staged, req.sources = [], []
        gen = req.completed(records, slot)
        self._stats["copy_seconds"] += time.perf_counter() - t0
        self._stats["copy_bytes"] += gen.held_bytes
        return gen

    def _publish(self, gen: Generation) -> None:
        self._ring.publish(gen)
        self._stats["snapshots_taken"] += 1

    @property
    def _generations(self) -> list[Generation]:
        """The complete generations held, oldest first (a testing seam)."""
        return self._ring.held

    # -- reading ---------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Until nothing is pending or in flight; raises :class:`SnapshotFailedError` for a failed save
        (once), ``TimeoutError`` past ``timeout`` seconds. A paused copy goes on."""
        self.resume()
        with self._cv:
            if not self._requests.idle(timeout):
                raise TimeoutError(f"snapshot still in flight after {timeout} s")
            error = self._requests.failure()
        if error is not None:
            raise error

    @property
    def latest(self) -> SnapshotInfo | None:
        """The newest complete generation (not yet verified), or None."""
        with self._cv:
            if not self._generations:
                return None
            return _info(self._generations[-1])

    @property
    def steps(self) -> tuple[int, ...]:
        """Steps of the complete generations held, oldest first."""
        with self._cv:
            return tuple(g.step for g in self._generations)

    def generation(self, index: int = -1) -> Generation:
        """One complete generation held (default: the newest), as it is: a testing seam (see ``snapshot.testing``)."""
        with self._cv:
            return self._generations[index]

    def load(self, target: Any, *, available: Any = None, borrow: bool = False) -> Restored:
        """The newest state held, placed on ``target`` (shardings, or an abstract state whose leaves carry
        ``.sharding``), read only from devices in ``available`` (default: the target's).

        A snapshot still being copied is the newest: with the host engine it is taken at once from the
        shards it staged (see ``snapshot.staged``) and its copy stopped; when a piece's sources are all gone,
        or with the device engine, the copy is waited for. A corrupt generation is skipped (logged, dropped)
        and an older one used. Every device receives a buffer it owns; generations stay restorable.

        ``borrow=True``: a device may instead receive the snapshot's own bytes, wrapped without a copy where the
        backend can (aligned host memory on CPU); ``Restored.borrowed`` says so. The caller then copies the state
        into buffers of its own (``runtime.land``) before it saves again: until then it aliases this snapshot.

        A copy paused for the restore (:meth:`pause`) goes on once it returns (or stops, if it was restored from).
        """
        try:
            return self._load(target, available, borrow)
        finally:
            self.resume()

    def _load(self, target: Any, available: Any, borrow: bool) -> Restored:
        with self._cv:
            req = self._requests.pending or self._requests.in_flight
            staged = (req, req.sources) if req is not None and req.sources else None
            newest = self._generations[-1].step if self._generations else None
        treedef = staged[0].treedef if staged else self._generations[-1].treedef if self._generations else None
        if treedef is None:
            self.wait_quietly()
            with self._cv:
                treedef = self._generations[-1].treedef if self._generations else None
            if treedef is None:
                raise NoSnapshotError("no snapshot has completed yet")
        targets = targets_of(treedef, target)
        if available is None:
            available = {d for t in targets if isinstance(t, Sharding) for d in t.device_set}
        available = set(available)
        engine = self._engine
        assert engine is not None
        if staged is not None and engine.name == "host" and (newest is None or staged[0].step >= newest):
            restored = from_staged(*staged, targets, available, self._guard, borrow=borrow)
            if restored is not None:
                self._abandon(staged[0])
                self._stats["last_load_wait_seconds"] = 0.0
                return restored
        t0 = time.perf_counter()
        self.wait_quietly()  # a copy in flight is newer than every complete generation: let it finish
        self._stats["last_load_wait_seconds"] = time.perf_counter() - t0
        with self._cv:
            generations = list(reversed(self._generations))
        if not generations:
            raise NoSnapshotError("no snapshot has completed yet")
        return from_generations(generations, targets, available, engine, self._guard, borrow=borrow, drop=self._drop)

    def _drop(self, gen: Generation) -> None:
        with self._cv:
            self._ring.drop(gen)

    def _abandon(self, req: StagedRequest) -> None:
        """Stop copying ``req`` (and drop a waiting request no newer than it): its state was restored, and
        the copy would only slow the steps that follow. The next save snapshots the restored state."""
        with self._cv:
            self._requests.abandon_through(req.number)
            # Release the views: the first step may then donate the shards the restore kept in place (a
            # piece being copied right now holds its view until it stops; that buffer is not donated).
            req.staged, req.sources = [], []
            self._cv.notify_all()

    def wait_quietly(self) -> None:
        """Until nothing is pending or in flight; a failed save stays to be raised by :meth:`wait`. A paused copy
        goes on."""
        self.resume()
        with self._cv:
            self._requests.idle()

    def image(self, *, copy: bool = True) -> HostImage:
        """A host copy of the newest generation, read from reachable copies (for a tier that outlives
        this process). ``copy=False``: the pieces are read-only views of the snapshot's own host buffers (no
        copy; valid until two more generations complete, or for good once the snapshotter is closed)."""
        with self._cv:
            if not self._generations:
                raise NoSnapshotError("no snapshot has completed yet")
            gen = self._generations[-1]
        return self._image(gen, copy=copy)

    def images(self, *, copy: bool = True) -> list[HostImage]:
        """Every complete generation as a host image, oldest first (see :meth:`image` for ``copy``)."""
        with self._cv:
            generations = list(self._generations)
        return [self._image(g, copy=copy) for g in generations]

    def _image(self, gen: Generation, *, copy: bool) -> HostImage:
        assert self._engine is not None
        devices = {c.device for leaf in gen.leaves for p in leaf.pieces for c in p.copies}
        return to_image(gen, self._engine, {d for d in devices if reachable(self._guard, d)}, copy=copy)

    def stats(self) -> dict[str, Any]:
        """Counters and timings: snapshots requested, taken, coalesced, failed; blocking and copy seconds."""
        with self._cv:
            counters = dict(self._stats)
            newest = self._generations[-1] if self._generations else None
            busy = self._requests.busy
            held = self._ring.held_bytes()
        return summary(
            counters,
            busy=busy,
            held=held,
            newest=newest,
            generations=len(self._generations),
            keep=self.config.keep,
            engine=self._engine.name if self._engine else None,
        )

    def cancel(self) -> int:
        """Abandon the snapshot waiting and the one being copied (counted as ``snapshots_abandoned``): the state
        they hold is not wanted any more (a restore from an older generation follows). Returns at once; the copy
        stops before its next piece. How many were abandoned."""
        with self._cv:
            count = self._requests.abandon_through(None)
            self._cv.notify_all()
        return count

    def pause(self) -> None:
        """Hold the copy in flight between pieces, for ``PAUSE_S`` at most: a failure was caught, and its
        recovery (which may take this snapshot from its staged shards and stop it) gets the CPU. ``load``,
        ``resume`` and ``close`` let it go on."""
        self._running.clear()

    def resume(self) -> None:
        """Let a paused copy go on."""
        self._running.set()

    def close(self, timeout: float = 120.0) -> None:
        """Finish what was requested (the waiting and the in-flight copy, bounded by ``timeout``), then
        stop the background threads. Complete generations stay readable until the snapshotter is dropped."""
        self.resume()
        self._requests.close(timeout)
        self._worker.join(timeout=timeout)
        self._pool.shutdown(wait=True)
        self._retired = []

    def __len__(self) -> int:
        return len(self._generations)


def _info(gen: Generation) -> SnapshotInfo:
    return SnapshotInfo(step=gen.step, generation=gen.number, state_bytes=gen.state_bytes, copies=gen.copies)
