"""Generations of host snapshots: the newest intact one wins, older ones stand behind it."""
from __future__ import annotations

import threading
from collections import deque
from typing import Any

import structlog

from snapshot.errors import NoSnapshotError, SnapshotCorruptError
from snapshot.host import Snapshot, capture, restore, verify

__all__ = ["SnapshotStore"]

log = structlog.get_logger("snapshot")


class SnapshotStore:
    """Keeps the last ``keep`` snapshots in host memory.

    ``save`` replaces nothing until the new snapshot is complete, so a failure while saving leaves
    the previous generation intact. ``latest`` skips (and drops) generations that fail their checksum.
    """

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._keep = keep
        self._generations: deque[Snapshot] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> Snapshot:
        snap = capture(step, state, meta)
        with self._lock:
            if self._generations and self._generations[-1].step > step:
                # A rollback: generations newer than this step belong to a discarded future.
                self._generations = deque((g for g in self._generations if g.step < step), maxlen=self._keep)
            if self._generations and self._generations[-1].step == step:
                self._generations.pop()
            self._generations.append(snap)
        return snap

    @property
    def steps(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(g.step for g in self._generations)

    def latest(self) -> Snapshot:
        """The newest intact snapshot; corrupt ones are dropped with a warning."""
        with self._lock:
            while self._generations:
                snap = self._generations[-1]
                try:
                    verify(snap)
                    return snap
                except SnapshotCorruptError as err:
                    log.warning("snapshot_corrupt", step=snap.step, leaf=err.leaf)
                    self._generations.pop()
        raise NoSnapshotError("no intact snapshot is held")

    def load(self, shardings: Any) -> tuple[Snapshot, Any]:
        """The newest intact snapshot and its state placed on ``shardings``."""
        snap = self.latest()
        return snap, restore(snap, shardings)

    def __len__(self) -> int:
        return len(self._generations)
