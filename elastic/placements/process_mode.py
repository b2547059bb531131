"""Multi-process mode for a whole job: the slices named (their devices live in the workers), the job's keepers
(the workers push to them), the worker processes as the slices' agents, and a
:class:`~elastic.placements.processes.ProcessPlacement` per run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from elastic import runtime
from elastic.control.accounting import Accounting
from elastic.control.cluster import ActorGroup
from elastic.control.placement import Placement
from elastic.errors import ConfigError, ElasticError
from elastic.loop.shardings import check_splits
from elastic.placements.plan import JobParts, WorkerSpec
from elastic.placements.processes import ProcessPlacement
from elastic.placements.worker_processes import WorkerProcesses
from elastic.supervision.credential import derive

__all__ = ["ProcessMode"]


class ProcessMode:
    multi = True

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts
        cfg = parts.config
        self.topology = runtime.Topology(  # the slices' devices live in the workers: this process only names them
            slices=tuple(
                runtime.Slice(index=i, devices=tuple(range(cfg.devices_per_slice))) for i in range(cfg.num_slices)
            )
        )
        self._keepers: Any = None  # the job's keeper actors (the workers push to them)
        self._factory: WorkerProcesses | None = None

    def check_meshes(self) -> None:
        """The check on the default mesh of each size, without its devices (a ``mesh_fn`` needs the devices: its
        meshes are checked by the workers as they form)."""
        parts = self._parts
        if parts.mesh_fn is not None:
            return
        for count in range(parts.config.policy.min_slices, parts.config.num_slices + 1):
            mesh = jax.sharding.AbstractMesh(
                (count, parts.config.devices_per_slice), (runtime.REPLICA_AXIS, runtime.LOCAL_AXIS)
            )
            try:
                check_splits(parts.abstract, parts.shardings_fn, mesh)  # type: ignore[arg-type]
            except ConfigError:
                raise
            except Exception:  # noqa: BLE001 - a shardings_fn that needs real devices: the workers check it
                pass

    def agents(self, token: str) -> WorkerProcesses:
        parts = self._parts
        faults = parts.faults
        hooks = faults.worker_hooks() if faults is not None and len(faults) else ()
        spec = WorkerSpec(
            config=parts.config,
            init_fn=parts.init_fn,
            shardings_fn=parts.shardings_fn,
            mesh_fn=parts.mesh_fn,
            init_from=None if parts.init_from is None else str(parts.init_from),
            init_step=parts.init_step,
            step_hooks=tuple(hooks),
            cache_dir=parts.cache_dir,
            keepers=bool(parts.config.tiers.keeper_every),
            keeper_credential=derive(token, "keeper"),
            identity_key=derive(token, "identity"),
        )
        self._factory = factory = WorkerProcesses(parts.config, spec)
        factory.check_fits()
        return factory

    def start_tiers(self, group: ActorGroup, accounting: Accounting) -> None:
        """The job's keepers: a taken-over job's attached, or created for the workers to push to."""
        cfg = self._parts.config
        if not cfg.tiers.keeper_every:
            return
        from elastic.snapshot.keeper import KeeperTier, keepers_for

        keeper, actors = derive(group.token, "keeper"), group.actors
        self._keepers = KeeperTier.attach(cfg.namespace, adopt=actors.find, credential=keeper) or KeeperTier(
            cfg.namespace,
            num_keepers=keepers_for(cfg.tiers.keepers),
            keep=1,
            credential=keeper,
            adopt=actors.find,
            created=actors.record,
        ).start(wait=False)

    def ready(self) -> None:
        if self._keepers is not None:
            self._keepers.ready()

    def snapshot_stats(self) -> dict[str, Any]:
        return {"blocking_seconds": 0.0, "snapshots_taken": 0, "held_bytes": 0}

    def last_completed(self) -> tuple[int, str] | None:
        return None

    def latest_snapshot(self) -> Any:
        raise ElasticError(
            "latest_snapshot() reads the single-process snapshotter; in multi-process mode each "
            "worker holds its own (see the report's snapshot figures)"
        )

    def snapshots(self) -> Any:
        return None

    def keepers(self) -> Any:
        return self._keepers

    def placement(self, *, group: Callable[[], ActorGroup], accounting: Accounting) -> Placement:
        assert self._factory is not None, "placement before agents"
        return ProcessPlacement(
            self._parts.config,
            spec=self._factory.spec,
            group=group,
            accounting=accounting,
            keepers=self.keepers,
            cache_dir=self._parts.cache_dir,
            factory=self._factory,
        )

    def close(self) -> None:
        if self._keepers is not None:
            self._keepers.close(kill=True)
            self._keepers = None

    def release(self, *, owned: bool) -> None:
        return None
