"""The keeper actor: one job's newest host images, in a detached Ray actor that outlives the training client.

Each :class:`Keeper` holds the newest ``keep`` images of one job in its own memory (private copies, so the images
survive the process that sent them), whole or as parts (one per worker process in multi-process mode), and answers
only calls signed with its job's keeper credential, each once (it keeps the credential's call key given at
creation, :mod:`snapshot.calls`; ``None``: an open keeper, for tests and tools).
:class:`~snapshot.keeper.KeeperTier` creates, feeds and reads them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import ray
import structlog

from .calls import CallCheck
from .errors import KeeperAccessError, SnapshotCorruptError, SnapshotStructureError
from .gated import gated_actor
from .image import HostImage, Index, assemble

__all__ = ["Keeper"]

log = structlog.get_logger("snapshot.keeper")


@ray.remote(max_concurrency=4)  # type: ignore[call-overload]  # ray's stubs lack actor options
@gated_actor  # its private methods unreachable through Ray; each public one takes token=
class Keeper:
    """Holds the newest ``keep`` images of one job, ordered by step.

    ``put`` copies first and swaps under a lock, so a failed put leaves what was held intact. A put of a
    step at or below a held one is a rollback: the held generations at or after that step are dropped.
    """

    def __init__(self, keep: int = 1, access: str | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._keep = keep
        self._access = CallCheck(access)  # the call key of the job's keeper credential (None: open)
        self._images: list[HostImage] = []  # ascending step
        self._parts: dict[int, dict[int, HostImage]] = {}  # step -> part -> image (multi-process mode)
        self._lock = threading.Lock()

    def put(self, image: HostImage, token: str | None = None) -> int:
        """Store a private copy of ``image``; return the bytes held afterwards."""
        self._allow(token, "put")
        own = image.private()
        with self._lock:
            dropped = [g.step for g in self._images if g.step >= own.step]
            self._images = [g for g in self._images if g.step < own.step] + [own]
            self._images = self._images[-self._keep :]
            if dropped:
                log.info("keeper_rollback", step=own.step, dropped=dropped)
            return sum(g.nbytes for g in self._images)

    def put_part(self, image: HostImage, part: int, token: str | None = None) -> int:
        """Store a private copy of ``image`` as part ``part`` of its step (multi-process mode: each worker sends
        the pieces it holds, and a step is whole once its parts cover every leaf). A part of a step below one the
        same part holds is a rollback: that part's later steps are dropped (other parts arrive in their own order).
        Steps older than the ``keep`` newest whole ones go.
        Returns the bytes held afterwards."""
        self._allow(token, "put_part")
        own = image.private()
        with self._lock:
            for step in [s for s in self._parts if s > own.step]:  # this part rolled back: its future is void
                self._parts[step].pop(part, None)
                if not self._parts[step]:
                    del self._parts[step]
            self._parts.setdefault(own.step, {})[part] = own
            whole = [s for s in sorted(self._parts) if _covers(self._parts[s].values())]
            if len(whole) > self._keep:
                floor = whole[-self._keep]
                self._parts = {s: parts for s, parts in self._parts.items() if s >= floor}
            return self._held()

    def whole_steps(self, token: str | None = None) -> list[int]:
        """The steps whose parts cover every leaf of the state, ascending (intact parts only: a part that fails
        ``verify()`` is dropped and logged)."""
        self._allow(token, "whole_steps")
        with self._lock:
            held = {s: dict(parts) for s, parts in self._parts.items()}
        whole = []
        for step, parts in sorted(held.items()):
            for part, image in parts.items():
                try:
                    image.verify()
                except SnapshotCorruptError as err:
                    log.warning("keeper_part_corrupt", step=step, part=part, leaf=err.leaf)
                    with self._lock:
                        self._parts.get(step, {}).pop(part, None)
            with self._lock:
                if _covers(self._parts.get(step, {}).values()):
                    whole.append(step)
        return whole

    def region(self, step: int, leaf: int, index: Index, token: str | None = None) -> np.ndarray | None:
        """Region ``index`` of leaf ``leaf`` at ``step``, cut from the parts (None when they do not cover it)."""
        self._allow(token, "region")
        with self._lock:
            parts = list(self._parts.get(step, {}).values())
        pieces = [(p.index, p.data) for image in parts for p in image.leaves[leaf].pieces]
        if not pieces:
            return None
        try:
            return np.array(assemble(index, pieces, parts[0].leaves[leaf].dtype), copy=True)
        except SnapshotStructureError:
            return None

    def part_meta(self, step: int, token: str | None = None) -> dict[str, Any] | None:
        """The controller state of ``step`` (from any of its parts), or None."""
        self._allow(token, "part_meta")
        with self._lock:
            parts = list(self._parts.get(step, {}).values())
        return copy.deepcopy(parts[0].meta) if parts else None

    def _allow(self, token: str | None, call: str) -> None:
        why = self._access.refusal(token, call)
        if why is None:
            return
        log.warning("keeper_call_refused", call=call, reason=why)
        raise KeeperAccessError(
            f"keeper {call} refused ({why}): it needs a call signed with this job's keeper credential"
        )

    def _held(self) -> int:
        return sum(g.nbytes for g in self._images) + sum(
            i.nbytes for parts in self._parts.values() for i in parts.values()
        )

    def latest(self, token: str | None = None) -> HostImage | None:
        """The newest held image that passes ``verify()``; corrupt ones are dropped and logged."""
        self._allow(token, "latest")
        with self._lock:
            candidates = list(reversed(self._images))
        for image in candidates:
            try:
                image.verify()
                return image
            except SnapshotCorruptError as err:
                log.warning("keeper_image_corrupt", step=image.step, leaf=err.leaf)
                with self._lock:
                    self._images = [g for g in self._images if g is not image]
        return None

    def steps(self, token: str | None = None) -> list[int]:
        self._allow(token, "steps")
        with self._lock:
            return [g.step for g in self._images]

    def held_bytes(self, token: str | None = None) -> int:
        self._allow(token, "held_bytes")
        with self._lock:
            return self._held()

    def drop(self, token: str | None = None) -> None:
        self._allow(token, "drop")
        with self._lock:
            self._images = []
            self._parts = {}

    def node_id(self, token: str | None = None) -> str:
        """The Ray node this keeper lives on."""
        self._allow(token, "node_id")
        return ray.get_runtime_context().get_node_id()


def _covers(images: Any) -> bool:
    """Whether the pieces of ``images`` (parts of one step) cover every leaf: their distinct regions tile it."""
    images = list(images)
    if not images:
        return False
    for i, leaf in enumerate(images[0].leaves):
        regions = {p.index for image in images for p in image.leaves[i].pieces}
        volume = sum(int(np.prod([hi - lo for lo, hi in r], dtype=np.int64)) for r in regions)
        if volume != int(np.prod(leaf.shape, dtype=np.int64)):
            return False
    return True
