"""A worker's side of giving a group up while it forms: the driver saw a member die after the rendezvous, and the
others would wait minutes for its part of the group's backend (jax's topology exchange), or 30 s at a collective's
rendezvous in their restore. :meth:`Forming.abandon` shuts this process's coordination client, which ends those
waits at once; whatever fails in the group's preparation after that is the lost peer's doing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from elastic import runtime
from elastic.runtime import distributed

__all__ = ["Forming"]


class Forming:
    """Which group this process is preparing (from its rendezvous to its restore's end), and which one the driver
    gave up. Thread-safe: :meth:`abandon` comes on another thread of the actor than the preparation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._abandoned: int | None = None

    @contextmanager
    def preparing(self, epoch: int) -> Iterator[None]:
        """While group ``epoch`` is prepared here."""
        with self._lock:
            self._epoch = epoch
        try:
            yield
        finally:
            with self._lock:
                self._epoch = None

    def abandon(self, epoch: int) -> bool:
        """Give group ``epoch`` up if it is being prepared here (its client shut); False if it is not."""
        with self._lock:
            if self._epoch != epoch:
                return False
            self._abandoned = epoch
            distributed.disconnect()
            return True

    def abandoned(self, epoch: int) -> bool:
        with self._lock:
            return self._abandoned == epoch

    def check(self, epoch: int) -> None:
        """``SliceLostError`` if group ``epoch`` was given up (a rendezvous that was still connecting when the
        client was shut goes on to the backend's start otherwise: called between the two)."""
        if self.abandoned(epoch):
            raise runtime.SliceLostError(f"group {epoch} was abandoned: a member died as it formed")
