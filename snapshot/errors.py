"""Errors of the snapshot data plane."""

from __future__ import annotations

__all__ = [
    "KeeperAccessError",
    "NoSnapshotError",
    "SnapshotConfigError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotFailedError",
    "SnapshotStructureError",
    "SnapshotUnavailableError",
]


class SnapshotError(Exception):
    """Root of the snapshot package's errors."""


class SnapshotCorruptError(SnapshotError):
    """A leaf's bytes no longer match the checksum taken when it was saved."""

    def __init__(self, step: int, leaf: int) -> None:
        super().__init__(f"snapshot of step {step} is corrupt: leaf {leaf} fails its checksum")
        self.step = step
        self.leaf = leaf

    def __reduce__(self) -> tuple[object, ...]:  # survive crossing a process boundary
        return (type(self), (self.step, self.leaf))


class SnapshotStructureError(SnapshotError, ValueError):
    """The target shardings do not match the structure of the saved state."""


class NoSnapshotError(SnapshotError, LookupError):
    """No intact snapshot is held."""


class SnapshotConfigError(SnapshotError, ValueError):
    """A snapshot setting is out of range; the message says what to use."""


class SnapshotUnavailableError(SnapshotError, LookupError):
    """Some piece of the snapshot is held only on devices that cannot be read (lost slices)."""

    def __init__(self, step: int, leaf: int, slices: tuple[int, ...]) -> None:
        super().__init__(
            f"snapshot of step {step}: leaf {leaf} has copies only on slices {list(slices)}, none of which is "
            "available; more slices were lost than the snapshot's copies survive (raise `copies`, or restore from "
            "the keeper or persistent tier)"
        )
        self.step = step
        self.leaf = leaf
        self.slices = slices

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.step, self.leaf, self.slices))


class SnapshotFailedError(SnapshotError):
    """A requested snapshot did not complete; the previous generation is intact."""

    def __init__(self, step: int, cause: str) -> None:
        super().__init__(f"the snapshot of step {step} failed ({cause}); the previous snapshot is kept")
        self.step = step
        self.cause = cause

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.step, self.cause))


class KeeperAccessError(SnapshotError, PermissionError):
    """A call on a keeper without the credential of the job it belongs to."""
