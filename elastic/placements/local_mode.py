"""Single-process mode for a whole job: the slices' devices seen by this process, the job's snapshot tiers
(:class:`~elastic.control.tiers.TierSet`) and a :class:`~elastic.placements.local.LocalPlacement` per run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from elastic import runtime
from elastic.control import orbax_io
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.control.placement import Placement
from elastic.control.tiers import TierSet
from elastic.errors import ConfigError
from elastic.loop.shardings import check_splits, state_shardings
from elastic.placements.local import LocalPlacement
from elastic.placements.plan import JobParts
from elastic.snapshot import SnapshotInfo

__all__ = ["LocalMode"]


class LocalMode:
    multi = False

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts
        cfg = parts.config
        try:
            if cfg.simulated:
                self.topology = runtime.simulated_topology(cfg.num_slices, cfg.devices_per_slice)
            else:
                self.topology = runtime.device_topology(cfg.num_slices, cfg.devices_per_slice)
        except runtime.TopologyError as err:
            raise ConfigError(str(err)) from err
        self.tiers = TierSet(cfg, self.topology, parts.abstract)

    def check_meshes(self) -> None:
        parts = self._parts
        for count in range(parts.config.policy.min_slices, parts.config.num_slices + 1):  # every size to shrink to
            try:
                mesh = runtime.build_mesh(self.topology.slices[:count], parts.mesh_fn)
            except ValueError as err:
                raise ConfigError(f"mesh_fn over {count} slice(s): {err}") from err
            check_splits(parts.abstract, parts.shardings_fn, mesh)  # bad specs fail at once

    def agents(self, token: str) -> Any:
        return None

    def start_tiers(self, group: ActorGroup, accounting: Accounting) -> None:
        self.tiers.on_event = accounting.timeline.add
        self.tiers.start(token=group.token, wait=False)

    def ready(self) -> None:
        self.tiers.ready()

    def snapshot_stats(self) -> dict[str, Any]:
        return self.tiers.snapshot_stats()

    def last_completed(self) -> tuple[int, str] | None:
        return self.tiers.last_completed

    def latest_snapshot(self) -> SnapshotInfo:
        return self.tiers.latest()

    def snapshots(self) -> Any:
        return self.tiers.snapshots

    def keepers(self) -> Any:
        return None  # the tiers keep them

    def placement(self, *, group: Callable[[], ActorGroup], accounting: Accounting) -> Placement:
        parts = self._parts
        return LocalPlacement(
            parts.config,
            topology=self.topology,
            mesh_fn=parts.mesh_fn,
            shardings=self._shardings,
            init_fn=parts.init_fn,
            tiers=self.tiers,
            initial_state=self._initial_state(),
            init_step=parts.init_step,
        )

    def _shardings(self, mesh: Mesh) -> Any:
        return state_shardings(self._parts.abstract, self._parts.shardings_fn, mesh)

    def _initial_state(self) -> Callable[[Any], Any] | None:
        """``init_from``'s reader: the checkpoint's state on the given shardings (None: ``init_fn``)."""
        path, abstract = self._parts.init_from, self._parts.abstract
        if path is None:
            return None
        return lambda shardings: orbax_io.restore_onto(path, abstract, shardings)

    def close(self) -> None:
        self.tiers.close()

    def release(self, *, owned: bool) -> None:
        if self._parts.config.simulated and owned:  # revive the simulated slices the job killed
            for s in self.topology.slices:
                runtime.simulated.revive_slice(s)
