"""The job's snapshot tiers and the order a restore reads them in.

1. In memory (``snapshot.Snapshotter``): copies in the host memory of devices on ``tiers.copies``
   distinct slices; read from the survivors only.
2. Keepers (``snapshot.keeper.KeeperTier``): every ``tiers.keeper_every``-th complete snapshot,
   pushed from the snapshot's background thread to keeper actors that outlive this process.
3. Persistent (``snapshot.persistent.PersistentTier``): an asynchronous Orbax checkpoint every
   ``tiers.persistent_every`` steps.

A restore tries them in that order (:func:`elastic.control.sources.choose_source`) and says which one it used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from elastic import runtime
from elastic.config import ElasticConfig
from elastic.control.report import PlacementFigures
from elastic.control.sources import Found, Source, choose_source
from elastic.log import get_logger
from elastic.snapshot import (
    NoSnapshotError,
    Restored,
    SnapshotConfig,
    SnapshotCorruptError,
    SnapshotFailedError,
    SnapshotInfo,
    Snapshotter,
    SnapshotUnavailableError,
    restore_image,
)

__all__ = ["TierSet"]


WAIT_S = 120.0  # bound on waiting for an in-flight snapshot or a keeper answer


class TierSet:
    def __init__(self, config: ElasticConfig, topology: runtime.Topology, abstract_state: Any) -> None:
        self._config = config
        tiers = config.tiers
        self._slice_by_id = slice_by_id = {d.id: s.index for s in topology.slices for d in s.devices}
        self._snapshots = Snapshotter(
            SnapshotConfig(
                keep=config.keep_snapshots, copies=min(tiers.copies, config.num_slices), on_busy=tiers.on_busy
            ),
            slice_of=lambda d: slice_by_id[d.id],
            guard=runtime.simulated.check_devices if config.simulated else None,
            on_complete=self._completed,
        )
        self._abstract = abstract_state
        self._treedef = jax.tree_util.tree_structure(abstract_state)
        self._keepers: Any = None
        self._persistent: Any = None
        self._completed_count = 0
        self.last_completed: tuple[int, str] | None = None  # (step, deepest tier) of the newest complete snapshot
        self.last_wait_seconds = 0.0  # how long the last restore waited for a snapshot in flight
        self._log = get_logger("elastic.control.tiers", job=config.job_name)
        self.on_event: Any = None  # timeline.add, once the job has one: refusals become events of its stream
        self._memory_gone = False  # the job released its slices (suspended): the next restore skips the memory tier

    def start(self, *, token: str | None = None, wait: bool = True) -> None:
        """Attach (or create) the keepers and the persistent tier; needs a Ray connection. ``token``: the job's
        credential; its keepers then answer only calls carrying the keeper credential derived from it, and the
        images pushed to them are sealed under the image key (a refused image is a ``keeper_image_refused``
        timeline event, and restore goes on to the next keeper or tier). ``wait=False``: the keepers' processes
        start while the caller goes on; :meth:`ready` waits for them."""
        tiers = self._config.tiers
        if tiers.keeper_every and self._keepers is None:
            from elastic.snapshot.keeper import KeeperTier, keepers_for
            from elastic.supervision.credential import derive
            from elastic.supervision.identity import JobActors

            actors = JobActors(self._config.job_name, self._config.namespace, token)
            self._keepers = KeeperTier(
                self._config.namespace,
                num_keepers=keepers_for(tiers.keepers),
                keep=1,
                credential=None if token is None else derive(token, "keeper"),
                image_key=None if token is None else derive(token, "image"),
                on_refused=self._refused,
                adopt=actors.find,  # a crashed client's keepers, checked by ID; a squatter's name is refused
                created=actors.record,
            )
            self._keepers.start(wait=wait)
        if tiers.persistent_dir is not None and self._persistent is None:
            from elastic.snapshot.persistent import PersistentTier

            self._persistent = PersistentTier(
                tiers.persistent_dir, every=tiers.persistent_every, job=self._config.job_name
            )

    def target(self, shardings: Any) -> Any:
        """The state as every restore produces it, abstract, each leaf carrying its sharding from ``shardings``."""
        return jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self._abstract, shardings
        )

    def ready(self) -> None:
        """Until the keepers that ``start`` asked for answer (raises if none does)."""
        if self._keepers is not None:
            self._keepers.ready()

    def _refused(self, keeper: str, step: int, why: str) -> None:
        self._log.warning("keeper_image_refused", keeper=keeper, step=step, why=why)
        if self.on_event is not None:
            self.on_event("keeper_image_refused", keeper=keeper, snapshot_step=step, why=why)

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Request an in-memory snapshot (returns without waiting for the copy), and a persistent
        checkpoint when one is due."""
        self._snapshots.save(step, state, meta)
        if self._persistent is not None and self._persistent.due(step):
            self._persistent.save(step, state, meta)

    def persist(self, step: int, state: Any, meta: dict[str, Any]) -> int | None:
        """The job stops before ``step``: save there to the persistent tier whatever ``persistent_every`` says
        (unless saved already) and wait until it is durable. The step saved; None without a persistent tier."""
        if self._persistent is None:
            return None
        if self._persistent.latest_step() != step:
            self._persistent.save(step, state, meta)
        self._persistent.wait()
        return step

    def suspend(self, step: int, state: Any, meta: dict[str, Any]) -> int | None:
        """The job is suspended before ``step`` (it releases every slice): snapshot it there, push that to the keepers
        whatever ``keeper_every`` says and wait until they hold it; the in-memory copies count as gone with the
        slices, so the next restore reads the keepers. The step the keepers hold; None when they could not take it
        (or the job has none)."""
        if self._keepers is None:
            return None
        self._snapshots.save(step, state, meta)
        self._wait()
        info = self._snapshots.latest
        if info is None or info.step != step or not self._keepers.wait(WAIT_S):
            return None
        if not self._keepers.push(self._snapshots.image()) or not self._keepers.wait(WAIT_S):
            return None
        if not self._keepers.holds(step, WAIT_S):  # every keeper failed to take it: the job keeps its slices
            return None
        self._memory_gone = True
        return step

    def _completed(self, info: SnapshotInfo) -> None:
        """On the snapshot thread, after each complete generation: feed the keepers every R-th one.

        The image views the generation's own host buffers (no copy): they are not reused before this returns (the
        next generation is copied on this thread, afterwards), and ``push`` has copied them into the object store
        by then."""
        self._completed_count += 1
        tier = "memory"
        if self._keepers is not None and self._completed_count % self._config.tiers.keeper_every == 0:
            if self._keepers.push(self._snapshots.image(copy=False)):
                tier = "keeper"
        self.last_completed = (info.step, tier)

    @property
    def snapshots(self) -> Snapshotter:
        """The in-memory tier itself (a drill's handle: corrupt a copy, read its stats)."""
        return self._snapshots

    def snapshot_stats(self) -> dict[str, Any]:
        """The in-memory tier's counters (snapshots taken, seconds blocked, bytes held), without waiting."""
        return self._snapshots.stats()

    def latest(self) -> SnapshotInfo:
        self._wait()
        info = self._snapshots.latest
        if info is None:
            raise NoSnapshotError("no snapshot has completed yet")
        return info

    def _wait(self) -> None:
        try:
            self._snapshots.wait(WAIT_S)
        except SnapshotFailedError as err:  # the previous generation stays; say so once
            self._log.warning("snapshot_failed", step=err.step, cause=err.cause)

    # -- restoring -------------------------------------------------------------------------
    def pause(self) -> None:
        """A failure was caught: hold the snapshot copy in flight until the restore (``Snapshotter.pause``)."""
        self._snapshots.pause()

    def restore(self, shardings: Any, devices: Iterable[Any], *, epoch: int, borrow: bool = False) -> Restored | None:
        """The newest state any tier holds, placed on ``shardings``; None when no tier holds anything.

        In memory first (survivors' copies only), then the keepers, then the persistent tier. ``borrow``: the
        memory tier may hand back its own bytes (``Restored.borrowed``; see ``Snapshotter.load``).
        """
        restored: Restored | None = None
        gone, self._memory_gone = self._memory_gone, False
        try:
            # A snapshot still in flight is the newest: restored from its staged shards, or waited for.
            restored = None if gone else self._snapshots.load(shardings, available=set(devices), borrow=borrow)
        except NoSnapshotError:
            pass
        except (SnapshotUnavailableError, SnapshotCorruptError) as err:
            self._log.warning("memory_tier_unusable", epoch=epoch, error=str(err)[:300])
        finally:
            self.last_wait_seconds = self._snapshots.stats()["last_load_wait_seconds"]
        choice = choose_source(
            None if restored is None else (restored.step, restored),
            keepers=self._keeper_image,
            orbax=self._persistent_step,
            committed=self._snapshots.latest is not None,
            survivors=sorted({self._slice_by_id[d.id] for d in devices if d.id in self._slice_by_id}),
        )
        if choice.source is Source.MEMORY:
            return restored
        if choice.source is Source.KEEPER:
            image = choice.found
            state = restore_image(image, self._treedef, shardings)
            meta = {k: v for k, v in image.meta.items() if k != "_values"}
            return Restored(step=image.step, generation=image.generation, state=state, meta=meta, tier="keeper")
        if choice.source is Source.PERSISTENT:
            step, state, meta = self._persistent.load(self.target(shardings))
            return Restored(step=step, generation=step, state=state, meta=meta, tier="persistent")
        return None

    def _keeper_image(self) -> Found | None:
        image = None if self._keepers is None else self._keepers.latest(timeout=WAIT_S)
        return None if image is None else (image.step, image)

    def _persistent_step(self) -> Found | None:
        step = None if self._persistent is None else self._persistent.latest_step()
        return None if step is None else (step, None)

    # -- accounting and shutdown ------------------------------------------------------------
    def figures(self, **standby: Any) -> PlacementFigures:
        """The tiers' counters for the report, once the snapshot, keeper pushes and Orbax saves in flight are done;
        ``standby``: the placement's standby figures (``PlacementFigures`` fields)."""
        self._wait()
        s = self._snapshots.stats()
        keeper: dict[str, Any] = {}
        if self._keepers is not None:
            self._keepers.wait(WAIT_S)
            keeper = self._keepers.stats()
        saves = None
        if self._persistent is not None:
            self._persistent.wait()
            saves = self._persistent.stats()["persistent_saves"]
        return PlacementFigures(
            snapshots_requested=s["snapshots_requested"],
            snapshots_taken=s["snapshots_taken"],
            snapshots_coalesced=s["snapshots_coalesced"],
            snapshots_failed=s["snapshots_failed"],
            snapshot_blocking_seconds=s["blocking_seconds"],
            snapshot_held_bytes=s["held_bytes"],
            snapshot_copies=s["copies"],
            keeper_bytes=keeper.get("keeper_bytes"),
            keeper_pushes=keeper.get("keeper_pushes"),
            persistent_saves=saves,
            **standby,
        )

    def close(self) -> None:
        """Stop the snapshot thread, kill the keepers (a clean end needs them no more), finish Orbax writes."""
        self._snapshots.close()
        if self._keepers is not None:
            self._keepers.close(kill=True)
            self._keepers = None
        if self._persistent is not None:
            self._persistent.wait()
            self._persistent.close()
            self._persistent = None
