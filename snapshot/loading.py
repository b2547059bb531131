"""A load's two sources: the snapshot still being copied (from the shards it staged) and the complete generations,
newest first, a corrupt one skipped."""

from __future__ import annotations

import copy as copylib
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
from jax.sharding import Sharding

from .config import Restored
from .engine import Engine
from .errors import SnapshotCorruptError, SnapshotStructureError, SnapshotUnavailableError
from .generation import Generation, Guard, restore_generation
from .staged import StagedRequest, restore_staged

__all__ = ["from_generations", "from_staged", "targets_of"]

log = structlog.get_logger("snapshot")


def targets_of(treedef: Any, target: Any) -> list[Sharding | None]:
    """Each saved leaf's target sharding: ``target`` holds shardings, or leaves that carry ``.sharding``."""
    try:
        targets = treedef.flatten_up_to(target)
    except (ValueError, TypeError) as err:
        raise SnapshotStructureError(f"the target does not match the saved state's structure {treedef}: {err}") from err
    return [t if isinstance(t, Sharding) else getattr(t, "sharding", None) for t in targets]


def from_staged(
    req: StagedRequest,
    sources: list[list[list[tuple[Any, np.ndarray, Any]]]],
    targets: list[Sharding | None],
    available: set[Any],
    guard: Guard | None,
    *,
    borrow: bool,
) -> Restored | None:
    """``req``'s state, taken from the shards it staged; None when a piece's sources are all gone (then its copy
    is waited for)."""
    try:
        state, kept = restore_staged(req, sources, targets, available, guard, borrow=borrow)
    except SnapshotUnavailableError:
        log.info("snapshot_in_flight_unavailable", step=req.step)  # wait for its copies
        return None
    log.info("snapshot_restored_from_staged", step=req.step, shards_reused=sum(len(k) for k in kept))
    return Restored(
        step=req.step,
        generation=req.number,
        state=state,
        meta=copylib.deepcopy(req.meta),
        source="staged",
        kept=kept,
        borrowed=borrow,
    )


def from_generations(
    generations: list[Generation],
    targets: list[Sharding | None],
    available: set[Any],
    engine: Engine,
    guard: Guard | None,
    *,
    borrow: bool,
    drop: Callable[[Generation], None],
) -> Restored:
    """The first of ``generations`` (newest first) that restores; a corrupt one is logged and ``drop``-ped. Raises
    the last failure when none restores."""
    failure: Exception | None = None
    for gen in generations:
        try:
            state = restore_generation(gen, targets, available, engine, guard, borrow=borrow)
        except SnapshotCorruptError as err:
            log.warning("snapshot_corrupt", step=gen.step, generation=gen.number, leaf=err.leaf)
            drop(gen)
            failure = err
            continue
        except SnapshotUnavailableError as err:
            failure = err
            continue
        return Restored(
            step=gen.step, generation=gen.number, state=state, meta=copylib.deepcopy(gen.meta), borrowed=borrow
        )
    assert failure is not None
    raise failure
