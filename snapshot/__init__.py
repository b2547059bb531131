"""The data plane for training state: host-memory snapshots of sharded pytrees and their restore."""
from snapshot.errors import NoSnapshotError, SnapshotCorruptError, SnapshotError, SnapshotStructureError
from snapshot.host import Snapshot, capture, restore, verify
from snapshot.store import SnapshotStore

__all__ = (
    "NoSnapshotError", "Snapshot", "SnapshotCorruptError", "SnapshotError", "SnapshotStore",
    "SnapshotStructureError", "capture", "restore", "verify",
)
