"""Where a restore reads the state from, decided once for both modes (:func:`choose_source`).

The order: the survivors' host snapshots (memory), else the keepers' newest whole step, else the newest Orbax
checkpoint, else a fresh start, never silently from the beginning once something was committed. A live move (the
group re-formed at a step boundary) reads the boundary's snapshot from memory or nowhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elastic.errors import ElasticError

__all__ = ["Choice", "Found", "Source", "choose_source", "common_step", "group_source", "persistent_step"]

Found = tuple[int, Any]  # a tier's newest step, and what to read it from (a restored state, an image, a keeper)
Lookup = Callable[[], Found | None]  # a tier's lookup, asked only when the tiers before it hold nothing


class Source(enum.Enum):
    MEMORY = "memory"
    KEEPER = "keeper"
    PERSISTENT = "persistent"
    FRESH = "fresh"


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The source chosen, the step it holds (None: fresh) and what its lookup found there."""

    source: Source
    step: int | None = None
    found: Any = None


def choose_source(
    held: Found | None,
    keepers: Lookup,
    orbax: Lookup,
    committed: bool,
    *,
    live: bool = False,
    survivors: Sequence[int] = (),
) -> Choice:
    """Where the state comes from: ``held`` (the newest step the survivors hold between them, None: no whole
    one), else ``keepers()``, else ``orbax()``, else fresh. ``committed``: something was saved or committed, so a
    fresh start would lose it: ``ElasticError`` instead. ``live``: a move at a step boundary, whose snapshot only
    the survivors (``survivors``, named in the errors) can hold. Each lookup is called at most once, in order."""
    if held is not None:
        return Choice(source=Source.MEMORY, step=held[0], found=held[1])
    if live:
        raise ElasticError(f"the members {sorted(survivors)} do not hold the boundary snapshot between them")
    for source, lookup in ((Source.KEEPER, keepers), (Source.PERSISTENT, orbax)):
        found = lookup()
        if found is not None:
            return Choice(source=source, step=found[0], found=found[1])
    if committed:
        raise ElasticError(
            f"no tier can restore the state: the survivors {sorted(survivors)} do not hold a whole step between "
            "them (a slice was lost with the copies of its shards), and no keeper or persistent copy exists. Nothing "
            "was restarted from step 0; raise tiers.copies or tiers.keeper_every's frequency, or set "
            "tiers.persistent_dir"
        )
    return Choice(source=Source.FRESH)


# -- multi-process mode: a group's sources, asked of its members' holdings, the keepers and the disk ----------
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


def common_step(helds: Sequence[dict[int, dict[str, Any]]], *, own_required: bool = True) -> int | None:
    """The newest step whose whole state the given workers hold between them (each ``held()``), with every one of
    them holding its own generation of it (``own_required``: each knows the ledger there); None if none."""
    if not helds:
        return None
    steps = set.intersection(*({s for s, h in held.items() if h["own"] or not own_required} for held in helds))
    for step in sorted(steps, reverse=True):
        regions = next((h[step]["regions"] for h in helds if step in h and h[step]["regions"]), None)
        if regions is None:
            continue
        have = [
            set().union(*(map(tuple, held[step]["held"][i]) for held in helds if step in held))
            for i in range(len(regions))
        ]
        if all({tuple(r) for r in regions[i]} <= have[i] for i in range(len(regions))):
            return step
    return None


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
