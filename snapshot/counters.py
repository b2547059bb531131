"""The Snapshotter's counters and timings, and the figures ``Snapshotter.stats()`` derives from them."""

from __future__ import annotations

from typing import Any

from .generation import Generation

__all__ = ["new_counters", "summary"]


def new_counters() -> dict[str, Any]:
    """Every counter and timing at zero."""
    return {
        "snapshots_requested": 0,
        "snapshots_taken": 0,
        "snapshots_coalesced": 0,
        "snapshots_failed": 0,
        "snapshots_abandoned": 0,
        "snapshots_waited": 0,
        "blocking_seconds": 0.0,
        "last_blocking_seconds": 0.0,
        "last_load_wait_seconds": 0.0,
        "copy_seconds": 0.0,
        "copy_bytes": 0,
    }


def summary(
    counters: dict[str, Any],
    *,
    busy: int,
    held: int,
    newest: Generation | None,
    generations: int,
    keep: int,
    engine: str | None,
) -> dict[str, Any]:
    """``counters`` plus ``snapshots_dropped`` (requested and neither taken, coalesced, failed, abandoned nor
    ``busy``: pending or in flight), the bytes ``held``, the newest generation's size and copies, and the ring."""
    s = dict(counters)
    s["snapshots_dropped"] = (
        s["snapshots_requested"]
        - s["snapshots_taken"]
        - s["snapshots_coalesced"]
        - s["snapshots_failed"]
        - s["snapshots_abandoned"]
        - busy
    )
    s["held_bytes"] = held
    s["state_bytes"] = newest.state_bytes if newest else 0
    s["copies"] = newest.copies if newest else 0
    s["generations"] = generations
    s["keep"] = keep
    s["engine"] = engine
    return s
