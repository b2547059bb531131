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

__all__ = ["Choice", "Found", "Source", "choose_source"]

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
