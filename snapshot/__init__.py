"""The data plane for training state: host snapshots of sharded pytrees kept next to their shards.

    from . import Snapshotter, SnapshotConfig

``Snapshotter`` is the in-memory tier (copies in the host memory of devices on distinct slices);
``snapshot.keeper.KeeperTier`` keeps copies in actors that outlive the client;
``snapshot.persistent.PersistentTier`` writes Orbax checkpoints; ``HostImage`` is a snapshot as plain
host data, the currency between tiers. Names load lazily, so a keeper actor does not import jax.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = (
    "HostImage",
    "NoSnapshotError",
    "Restored",
    "SnapshotConfig",
    "SnapshotConfigError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotFailedError",
    "SnapshotInfo",
    "SnapshotStructureError",
    "SnapshotUnavailableError",
    "Snapshotter",
    "restore_image",
)

_WHERE = {
    "HostImage": "image",
    "restore_image": "image",
    "Restored": "config",
    "SnapshotConfig": "config",
    "SnapshotInfo": "config",
    "Snapshotter": "snapshotter",
    **{
        name: "errors"
        for name in (
            "NoSnapshotError",
            "SnapshotConfigError",
            "SnapshotCorruptError",
            "SnapshotError",
            "SnapshotFailedError",
            "SnapshotStructureError",
            "SnapshotUnavailableError",
        )
    },
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'snapshot' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
