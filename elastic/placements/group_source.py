"""Where a multi-process group's state comes from (:func:`group_source`): the members' host snapshots (their
own shards and the buddy copies of the lost ones), else the keepers' newest whole step, else the newest Orbax
checkpoint, else a fresh start, decided by :func:`elastic.control.sources.choose_source` as in single-process
mode."""

from __future__ import annotations

from typing import Any

from elastic.control.sources import Choice, Found, choose_source
from elastic.placements.holdings import common_step

__all__ = ["group_source", "persistent_step"]


def group_source(
    helds: dict[int, dict[int, Any]],
    holders: list[int],
    *,
    live: bool,
    keepers: Any,
    persistent_dir: str | None,
    committed: bool,
) -> Choice:
    """The source of the next group's state. ``helds``: what each worker holds (``Holdings.held``), of which
    ``holders`` hold something of their own; ``keepers``: the job's keeper tier (None: none); ``committed``: the
    job committed a step (a fresh start would lose it). A keeper choice's ``found`` is the keeper to read."""
    step = common_step([helds[s] for s in holders]) if holders else None

    def keeper() -> Found | None:
        whole = keepers.whole_steps(timeout=30.0) if keepers is not None else None
        return next(iter(whole.items())) if whole else None

    def orbax() -> Found | None:
        found = persistent_step(persistent_dir)
        return None if found is None else (found, None)

    return choose_source(
        None if step is None else (step, None),
        keeper,
        orbax,
        bool(holders) or committed,
        live=live,
        survivors=holders,
    )


def persistent_step(directory: str | None) -> int | None:
    """The newest step of the Orbax checkpoints in ``directory`` (None: none, or no directory)."""
    if directory is None:
        return None
    import orbax.checkpoint as ocp
    from etils import epath

    path = epath.Path(directory)
    if not path.exists():
        return None
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        return manager.latest_step()
    finally:
        manager.close()
