"""Errors of the snapshot data plane."""
from __future__ import annotations

__all__ = ["SnapshotError", "SnapshotCorruptError", "SnapshotStructureError", "NoSnapshotError"]


class SnapshotError(Exception):
    """Root of the snapshot package's errors."""


class SnapshotCorruptError(SnapshotError):
    """A leaf's bytes no longer match the checksum taken when it was saved."""

    def __init__(self, step: int, leaf: int) -> None:
        super().__init__(f"snapshot of step {step} is corrupt: leaf {leaf} fails its checksum")
        self.step = step
        self.leaf = leaf

    def __reduce__(self):  # survive crossing a process boundary
        return (type(self), (self.step, self.leaf))


class SnapshotStructureError(SnapshotError, ValueError):
    """The target shardings do not match the structure of the saved state."""


class NoSnapshotError(SnapshotError, LookupError):
    """No intact snapshot is held."""
