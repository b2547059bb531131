"""The data plane for training state: host snapshots of sharded pytrees kept next to their shards.

``Snapshotter`` (in-memory tier: copies in the host memory of devices on distinct slices),
``KeeperTier`` (copies in keeper actors that outlive the client), ``PersistentTier`` (Orbax
checkpoints), and ``HostImage`` (a snapshot as plain host data, the currency between tiers).
"""
from snapshot.errors import (NoSnapshotError, SnapshotConfigError, SnapshotCorruptError, SnapshotError,
                             SnapshotFailedError, SnapshotStructureError, SnapshotUnavailableError)
from snapshot.image import HostImage, restore_image
from snapshot.snapshotter import Restored, SnapshotConfig, SnapshotInfo, Snapshotter

__all__ = (
    "HostImage", "NoSnapshotError", "Restored", "SnapshotConfig", "SnapshotConfigError", "SnapshotCorruptError",
    "SnapshotError", "SnapshotFailedError", "SnapshotInfo", "SnapshotStructureError", "SnapshotUnavailableError",
    "Snapshotter", "restore_image",
)
