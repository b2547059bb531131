"""A worker process's tiers beyond its own host memory, for the group it is in (multi-process mode).

Contract. ``begin`` (once a group has formed, with its mesh and state) wires each snapshot this process takes to:
its **buddy**, the next member's process, which holds what no other member holds (a region replicated across
slices has its copies there already); the **keepers**, every ``keeper_every``-th snapshot, each region sent by the
first process that holds it; and the **Orbax tier** (``persistent_dir``), where every worker writes its own shards
of each due step. ``save`` takes a snapshot into the worker's :class:`~elastic.placements.holdings.Holdings` and
the Orbax tier when due; the state's regions and their holders are found once per layout. ``close`` ends the
group's Orbax tier, bounded (a broken group cannot finish a collective write).
"""

from __future__ import annotations

import threading
from typing import Any

import jax

from elastic.config import ElasticConfig
from elastic.placements.holdings import Holdings, holders_of, select
from elastic.placements.restore import layout_of

__all__ = ["GroupTiers"]


class GroupTiers:
    def __init__(
        self,
        config: ElasticConfig,
        holdings: Holdings,
        slice_index: int,
        *,
        keepers: bool,
        keeper_credential: str | None,
        log: Any,
        identity_key: str | None = None,
    ) -> None:
        self._config = config
        self._holdings = holdings
        self._slice = slice_index
        self._with_keepers = keepers
        self._keeper_credential = keeper_credential
        self._identity_key = identity_key
        self._log = log
        self._keepers: Any = None
        self.persistent: Any = None  # the group's Orbax tier, while it has one
        self._shape_key: Any = None
        self._holders: list[dict[Any, tuple[int, ...]]] = []  # per leaf: region -> the processes holding it
        self._shape_meta: dict[str, Any] = {}

    def keepers(self) -> Any:
        """The job's keepers (attached on first use), or None without them."""
        if not self._with_keepers:
            return None
        if self._keepers is None:
            from elastic.snapshot.keeper import KeeperTier
            from elastic.supervision.identity import SquatError, find

            cfg = self._config

            def adopt(name: str) -> Any:  # the job's own keeper only, by its recorded ID; another's is skipped
                try:
                    return find(cfg.job_name, name, cfg.namespace, self._identity_key)
                except SquatError as err:
                    self._log.warning("keeper_not_the_jobs", keeper=name, error=str(err))
                    return None

            self._keepers = KeeperTier.attach(cfg.namespace, adopt=adopt, credential=self._keeper_credential)
        return self._keepers

    def begin(self, members: tuple[int, ...], peers: dict[int, Any], mesh: Any, state: Any) -> None:
        """Wire the snapshots of the group of ``members`` (``peers``: their workers) to the buddy, the keepers and
        the Orbax tier."""
        me = members.index(self._slice)
        send = []
        if len(members) > 1:  # the buddy: the next member; its copy lives in its own process
            buddy = peers[members[(me + 1) % len(members)]]

            def to_buddy(image: Any) -> None:
                # only what no other member holds: a region replicated across slices has its copies there already
                mine = select(image, lambda leaf, index: self._holders[leaf].get(index) == (me,))
                if mine is not None:
                    buddy.hold.remote(self._slice, mine)

            send.append(to_buddy)
        every = self._config.tiers.keeper_every
        keepers = self.keepers() if every else None
        if keepers is not None:
            counter = {"n": 0}

            def to_keepers(image: Any) -> None:
                counter["n"] += 1
                if counter["n"] % every == 0:  # each region from the first process that holds it
                    part = select(image, lambda leaf, index: min(self._holders[leaf].get(index, (me,))) == me)
                    if part is not None:
                        keepers.push_part(part, self._slice)

            send.append(to_keepers)
        process_of = {d.id: d.process_index for d in mesh.devices.flat}
        self._holdings.begin(lambda d: process_of.get(d.id, d.process_index), send, state)
        if self._config.tiers.persistent_dir is not None:
            from elastic.snapshot.persistent import PersistentTier

            self.persistent = PersistentTier(
                self._config.tiers.persistent_dir, every=self._config.tiers.persistent_every, job=self._config.job_name
            )

    def save(self, next_step: int, state: Any, meta: dict[str, Any]) -> None:
        """Snapshot ``state`` (resuming at ``next_step``) into the holdings, and into the Orbax tier when due."""
        leaves = jax.tree_util.tree_leaves(state)
        key = tuple((x.shape, x.dtype, x.sharding) for x in leaves)
        if self._shape_key != key:  # the regions, their holders and the layout of a state: once per mesh
            self._holders = holders_of(leaves)  # once per layout: the regions are its keys
            self._shape_key = key
            self._shape_meta = {"_regions": [sorted(h) for h in self._holders], "_layout": layout_of(leaves)}
        self._holdings.save(next_step, state, meta, static=self._shape_meta)
        if self.persistent is not None and self.persistent.due(next_step):
            self.persistent.save(next_step, state, {**meta, **self._shape_meta})

    def persist(self, next_step: int, state: Any, meta: dict[str, Any]) -> int | None:
        """The job stops before ``next_step``: save ``state`` there to the Orbax tier whatever ``persistent_every``
        says (unless that step is saved already) and wait until it is durable. The step saved, or None without an
        Orbax tier. Every member calls it at the same boundary (the save is collective)."""
        tier = self.persistent
        if tier is None:
            return None
        if tier.latest_step() != next_step:
            tier.save(next_step, state, {**meta, **self._shape_meta})
        tier.wait()
        return next_step

    def close(self, *, timeout_s: float = 300.0) -> None:
        """Close the group's Orbax tier, waiting (up to ``timeout_s``) for a save in flight to end."""
        tier, self.persistent = self.persistent, None
        if tier is None:
            return

        def close() -> None:
            try:
                tier.close()
            except Exception as err:  # noqa: BLE001 - a broken group cannot finish a collective write
                self._log.warning("persistent_close_failed", error=repr(err)[:200])

        closing = threading.Thread(target=close, name="persistent-close", daemon=True)
        closing.start()
        closing.join(timeout_s)
        if closing.is_alive():
            self._log.warning("persistent_close_timed_out", seconds=timeout_s)
