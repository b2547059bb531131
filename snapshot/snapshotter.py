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
from concurrent.futures import wait as wait_all
from typing import Any

import jax
import numpy as np
import structlog
from jax.sharding import Sharding

from .config import Restored, SnapshotConfig, SnapshotInfo
from .engine import Copy, Engine, pick_engine
from .errors import (
    NoSnapshotError,
    SnapshotConfigError,
    SnapshotCorruptError,
    SnapshotFailedError,
    SnapshotStructureError,
    SnapshotUnavailableError,
)
from .generation import Generation, Guard, PieceRecord, reachable, restore_generation, to_image
from .image import HostImage
from .plan import LeafPlan, SliceOf, default_slice_of, devices_by_slice, plan_leaf
from .staged import StagedRequest, restore_staged

__all__ = ["Restored", "SnapshotConfig", "SnapshotInfo", "Snapshotter"]

log = structlog.get_logger("snapshot")
PAUSE_S = 5.0  # the longest a paused copy holds at one piece (see ``Snapshotter.pause``)


class _Abandoned(Exception):
    pass


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
        self._plans: dict[Any, list[LeafPlan | None]] = {}
        self._generations: list[Generation] = []
        self._slots: dict[int, dict[tuple[int, int, int], np.ndarray]] = {}
        self._retired: list[jax.Array] = []  # the shards the newest generation's views held (see ``_copy``)
        self._cv = threading.Condition()
        self._skips_said: set[tuple[int, int | None, str]] = set()  # (request, slice, cause) logged: once each
        self._pending: StagedRequest | None = None
        self._in_flight: StagedRequest | None = None
        self._error: SnapshotFailedError | None = None
        self._numbers = 0
        self._closed = False
        self._running = threading.Event()  # cleared by ``pause``: the copy in flight holds between pieces
        self._running.set()
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="snapshot-copy")
        self._stats = {
            "snapshots_requested": 0,
            "snapshots_taken": 0,
            "snapshots_coalesced": 0,
            "snapshots_failed": 0,
            "snapshots_abandoned": 0,
            "snapshots_waited": 0,
            "blocking_seconds": 0.0,
            "last_blocking_seconds": 0.0,
            "last_load_wait_seconds": 0.0,
            "copy_seconds": 0.0,
            "copy_bytes": 0,
        }
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
        key_impls = [str(jax.random.key_impl(x)) if _is_key(x) else None for x in leaves]
        arrays = [jax.random.key_data(x) if k else x for x, k in zip(leaves, key_impls, strict=True)]
        plans = self._plan(arrays)
        engine = self._engine_for(arrays)
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
        # The shards the copies read, as (device, view, shard): until the copy is done, a survivor that holds one
        # of them restores its own shard of this state in place. (Holding every replica would also keep the others
        # from being donated: each step after a save would allocate them anew.) A shard still being computed has
        # no view yet: then a restore waits for the copy.
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
        with self._cv:
            if self._closed:
                raise SnapshotConfigError("the snapshotter is closed")
            self._numbers += 1
            req = StagedRequest(
                number=self._numbers,
                step=step,
                treedef=treedef,
                plans=plans,
                staged=staged,
                sources=sources,
                values=values,
                key_impls=key_impls,
                meta=copylib.deepcopy(dict(meta or {})),
            )
            self._stats["snapshots_requested"] += 1
            if self._pending is not None and self.config.on_busy == "wait":
                self._stats["snapshots_waited"] += 1
                self._cv.wait_for(lambda: self._pending is None or self._closed)
            if self._pending is not None:
                self._stats["snapshots_coalesced"] += 1
                # Said once at info (saves come faster than copies), then at debug: a line per save costs the loop.
                say = log.info if self._stats["snapshots_coalesced"] == 1 else log.debug
                say("snapshot_coalesced", step=self._pending.step, replaced_by=step)
            self._pending = req
            self._cv.notify_all()
        blocked = time.perf_counter() - t0
        self._stats["blocking_seconds"] += blocked
        self._stats["last_blocking_seconds"] = blocked
        return req.number

    def prepare(self, state: Any) -> None:
        """Plan where each byte of ``state``'s snapshots goes now (it is planned once per layout), so that the first
        ``save`` of a new mesh does not pay for it on the training thread."""
        leaves = jax.tree_util.tree_leaves(state)
        arrays = [jax.random.key_data(x) if _is_key(x) else x for x in leaves]
        self._plan(arrays)
        self._engine_for(arrays)

    def _engine_for(self, arrays: list[Any]) -> Engine:
        if self._engine is None:
            devices = [d for x in arrays if isinstance(x, jax.Array) for d in x.sharding.device_set]
            self._engine = pick_engine(self.config.engine, devices)
        return self._engine

    def _plan(self, arrays: list[Any]) -> list[LeafPlan | None]:
        key = tuple((x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else None for x in arrays)
        plans = self._plans.get(key)
        if plans is None:
            jax_arrays = [x for x in arrays if isinstance(x, jax.Array)]
            by_slice = devices_by_slice(jax_arrays, self._slice_of)
            load: dict[Any, int] = {d: 0 for ds in by_slice.values() for d in ds}
            plans = [
                plan_leaf(x, self.config.copies, self._slice_of, load, by_slice) if isinstance(x, jax.Array) else None
                for x in arrays
            ]
            if len(by_slice) < self.config.copies:
                log.warning("snapshot_copies_capped", copies=self.config.copies, slices=len(by_slice))
            self._plans = {key: plans}  # one layout at a time: a new mesh replaces the old plan
        return plans

    # -- the background thread -------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                req, self._pending = self._pending, None
                self._in_flight = req
                self._cv.notify_all()
            try:
                gen = self._copy(req)
            except _Abandoned:
                with self._cv:
                    self._stats["snapshots_abandoned"] += 1
                    self._in_flight = None
                    self._cv.notify_all()
                continue
            except Exception as err:  # noqa: BLE001 - any failure leaves the previous generation intact
                with self._cv:
                    self._stats["snapshots_failed"] += 1
                    self._error = SnapshotFailedError(req.step, f"{type(err).__name__}: {err}"[:300])
                    self._in_flight = None
                    self._cv.notify_all()
                log.warning("snapshot_failed", step=req.step, error=str(err)[:200])
                continue
            with self._cv:
                self._publish(gen)
            if self._on_complete is not None:
                try:
                    self._on_complete(
                        SnapshotInfo(
                            step=gen.step, generation=gen.number, state_bytes=gen.state_bytes, copies=gen.copies
                        )
                    )
                except Exception as err:  # noqa: BLE001 - a tier's trouble must not stop snapshots
                    log.warning("snapshot_on_complete_failed", step=gen.step, error=str(err)[:200])
            with self._cv:
                self._in_flight = None
                self._cv.notify_all()
            try:
                if self._engine is not None:
                    self._engine.warm()  # the copies the next saves stage: compiled here, not on the training thread
            except Exception as err:  # noqa: BLE001 - then staging keeps its uncompiled path
                log.warning("snapshot_warm_failed", error=str(err)[:200])

    def _free_slot(self) -> int:
        used = {g.slot for g in self._generations}
        return next(s for s in range(self.config.keep + 1) if s not in used)

    def _copy(self, req: StagedRequest) -> Generation:
        t0 = time.perf_counter()
        engine = self._engine
        assert engine is not None
        with self._cv:
            slot = self._free_slot()
        reuse = self._slots.get(slot, {})
        buffers: dict[tuple[int, int, int], np.ndarray] = {}  # only this layout's buffers stay held

        def one_piece(i: int, j: int) -> PieceRecord:
            plan = req.plans[i]
            assert plan is not None
            piece = plan.pieces[j]
            copies: list[Copy] = []
            digest = 0
            lost: BaseException | None = None
            for k, (cp, staged) in enumerate(zip(piece.copies, req.staged[i][j], strict=True)):
                self._running.wait(PAUSE_S)  # paused while a failure is recovered from (bounded: it goes on)
                if req.abandoned:
                    raise _Abandoned
                if self._guard is not None:
                    try:
                        self._guard([cp.dest])
                    except Exception as err:  # noqa: BLE001 - that slice is gone: the piece keeps its other copies
                        lost = err
                        said = (req.number, cp.slice, type(err).__name__)
                        with self._cv:
                            first = said not in self._skips_said
                            self._skips_said.add(said)
                        if first:  # one line per lost slice and cause, not one per leaf
                            log.warning("snapshot_copy_skipped", step=req.step, slice=cp.slice, error=str(err)[:120])
                        continue
                if not copies:  # one checksum per piece, taken from its first copy as it is written
                    made, digest = engine.write_checksummed(staged, cp.dest, cp.slice, reuse.get((i, j, k)))
                else:
                    made = engine.write(staged, cp.dest, cp.slice, reuse.get((i, j, k)))
                if made.buffer is not None:
                    buffers[(i, j, k)] = made.buffer
                copies.append(made)
            if not copies:
                assert lost is not None
                raise lost
            return PieceRecord(index=piece.index, checksum=digest, copies=tuple(copies))

        futures = {
            (i, j): self._pool.submit(one_piece, i, j)
            for i, plan in enumerate(req.plans)
            if plan
            for j in range(len(plan.pieces))
        }
        # Every piece settles before a failure is raised: a piece still writing would otherwise land in the
        # reused buffers of the next save (this slot stays free) after that save checksummed them.
        wait_all(futures.values())
        records = {ij: f.result() for ij, f in futures.items()}
        self._slots[slot] = buffers
        # Release the views (the state's buffers can be donated again), but keep the shards they viewed until the
        # next generation is copied: the views kept the next step from donating them, and the loop drops its state
        # a step or two later; whoever drops the last reference frees them, and here that is this thread, as this
        # assignment drops the previous generation's (freeing 420 MB of them had held the loop's thread 87-199 ms).
        self._retired = [a for leaf in req.sources for piece in leaf for _, _, a in piece]
        req.staged, req.sources = [], []
        gen = req.completed(records, slot)
        self._stats["copy_seconds"] += time.perf_counter() - t0
        self._stats["copy_bytes"] += gen.held_bytes
        return gen

    def _publish(self, gen: Generation) -> None:
        if self._generations and self._generations[-1].step >= gen.step:
            # A rollback or a repeat: generations at or past this step belong to a discarded future.
            self._generations = [g for g in self._generations if g.step < gen.step]
        self._generations.append(gen)
        del self._generations[: -self.config.keep]
        self._stats["snapshots_taken"] += 1

    # -- reading ---------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Until nothing is pending or in flight; raises :class:`SnapshotFailedError` for a failed save
        (once), ``TimeoutError`` past ``timeout`` seconds. A paused copy goes on."""
        self.resume()
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending is None and self._in_flight is None, timeout):
                raise TimeoutError(f"snapshot still in flight after {timeout} s")
            error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def latest(self) -> SnapshotInfo | None:
        """The newest complete generation (not yet verified), or None."""
        with self._cv:
            if not self._generations:
                return None
            g = self._generations[-1]
            return SnapshotInfo(step=g.step, generation=g.number, state_bytes=g.state_bytes, copies=g.copies)

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
            req = self._pending or self._in_flight
            staged = (req, req.sources) if req is not None and req.sources else None
            newest = self._generations[-1].step if self._generations else None
        treedef = staged[0].treedef if staged else self._generations[-1].treedef if self._generations else None
        if treedef is None:
            self.wait_quietly()
            with self._cv:
                treedef = self._generations[-1].treedef if self._generations else None
            if treedef is None:
                raise NoSnapshotError("no snapshot has completed yet")
        try:
            targets = treedef.flatten_up_to(target)
        except (ValueError, TypeError) as err:
            raise SnapshotStructureError(
                f"the target does not match the saved state's structure {treedef}: {err}"
            ) from err
        targets = [t if isinstance(t, Sharding) else getattr(t, "sharding", None) for t in targets]
        if available is None:
            available = {d for t in targets if isinstance(t, Sharding) for d in t.device_set}
        available = set(available)
        engine = self._engine
        assert engine is not None
        if staged is not None and engine.name == "host" and (newest is None or staged[0].step >= newest):
            req, sources = staged
            try:
                state, kept = restore_staged(req, sources, targets, available, self._guard, borrow=borrow)
            except SnapshotUnavailableError:
                log.info("snapshot_in_flight_unavailable", step=req.step)  # wait for its copies below
            else:
                log.info("snapshot_restored_from_staged", step=req.step, shards_reused=sum(len(k) for k in kept))
                self._abandon(req)
                self._stats["last_load_wait_seconds"] = 0.0
                return Restored(
                    step=req.step,
                    generation=req.number,
                    state=state,
                    meta=copylib.deepcopy(req.meta),
                    source="staged",
                    kept=kept,
                    borrowed=borrow,
                )
        t0 = time.perf_counter()
        self.wait_quietly()  # a copy in flight is newer than every complete generation: let it finish
        self._stats["last_load_wait_seconds"] = time.perf_counter() - t0
        with self._cv:
            generations = list(reversed(self._generations))
        if not generations:
            raise NoSnapshotError("no snapshot has completed yet")
        failure: Exception | None = None
        for gen in generations:
            try:
                state = restore_generation(gen, targets, available, engine, self._guard, borrow=borrow)
            except SnapshotCorruptError as err:
                log.warning("snapshot_corrupt", step=gen.step, generation=gen.number, leaf=err.leaf)
                with self._cv:
                    self._generations = [g for g in self._generations if g is not gen]
                failure = err
                continue
            except SnapshotUnavailableError as err:
                failure = err
                continue
            return Restored(
                step=gen.step, generation=gen.number, state=state, meta=copylib.deepcopy(gen.meta), borrowed=borrow
            )
        assert failure is not None
        raise failure

    def _abandon(self, req: StagedRequest) -> None:
        """Stop copying ``req`` (and drop a waiting request no newer than it): its state was restored, and
        the copy would only slow the steps that follow. The next save snapshots the restored state."""
        with self._cv:
            if self._pending is not None and self._pending.number <= req.number:
                self._pending.abandoned = True
                self._pending = None
                self._stats["snapshots_abandoned"] += 1
            if self._in_flight is not None and self._in_flight.number <= req.number:
                self._in_flight.abandoned = True
            # Release the views: the first step may then donate the shards the restore kept in place (a
            # piece being copied right now holds its view until it stops; that buffer is not donated).
            req.staged, req.sources = [], []
            self._cv.notify_all()

    def wait_quietly(self) -> None:
        """Until nothing is pending or in flight; a failed save stays to be raised by :meth:`wait`. A paused copy
        goes on."""
        self.resume()
        with self._cv:
            self._cv.wait_for(lambda: self._pending is None and self._in_flight is None)

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
            s: dict[str, Any] = dict(self._stats)
            newest = self._generations[-1] if self._generations else None
            busy = (self._pending is not None) + (self._in_flight is not None)
            held = sum(b.nbytes for slot in self._slots.values() for b in slot.values())
            if not held:  # engines whose copies are jax arrays (device engine)
                held = sum(g.held_bytes for g in self._generations)
        s["snapshots_dropped"] = (
            s["snapshots_requested"]
            - s["snapshots_taken"]
            - s["snapshots_coalesced"]
            - s["snapshots_failed"]
            - s["snapshots_abandoned"]
            - busy
        )
        s["held_bytes"] = held
        s["state_bytes"] = newest.state_bytes if newest else 0
        s["copies"] = newest.copies if newest else 0
        s["generations"] = len(self._generations)
        s["keep"] = self.config.keep
        s["engine"] = self._engine.name if self._engine else None
        return s

    def cancel(self) -> int:
        """Abandon the snapshot waiting and the one being copied (counted as ``snapshots_abandoned``): the state
        they hold is not wanted any more (a restore from an older generation follows). Returns at once; the copy
        stops before its next piece. How many were abandoned."""
        with self._cv:
            count = 0
            if self._pending is not None:
                self._pending.abandoned = True
                self._pending = None
                self._stats["snapshots_abandoned"] += 1
                count += 1
            if self._in_flight is not None:
                self._in_flight.abandoned = True
                count += 1
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
        with self._cv:
            self._cv.wait_for(lambda: self._pending is None and self._in_flight is None, timeout)
            self._closed = True
            if self._pending is not None:  # past the bound: counted, never silent
                self._stats["snapshots_coalesced"] += 1
                log.warning("snapshot_abandoned_at_close", step=self._pending.step)
                self._pending = None
            self._cv.notify_all()
        self._worker.join(timeout=timeout)
        self._pool.shutdown(wait=True)
        self._retired = []

    def __len__(self) -> int:
        return len(self._generations)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
