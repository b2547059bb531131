"""A restarted pool's state, from its own log: a pure function, no actor, no Ray.

Each decision the pool carries out is written first as a ``decision`` record holding the whole state after it
(:func:`~elastic.pool.model.state_to_dict`), so the newest record that verifies under the pool's stream key is where
a restarted pool resumes, however many older records the stream has dropped; each record's ``epoch`` is the pool's
version it was decided at, so versions go on from there. Records that do not verify are
returned apart (forged); an unreadable state in a verified record is skipped, as a record of another writer would be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic.errors import ConfigError
from elastic.pool.model import PoolState, new_state, state_from_dict
from elastic.supervision.events import verify

__all__ = ["Replayed", "replay"]


@dataclass(frozen=True, kw_only=True)
class Replayed:
    state: PoolState
    decisions: int  # verified decisions in the log (the stream keeps the newest only)
    version: int  # the pool's version after the newest: its decisions counted from the first, dropped ones too
    records: list[dict[str, Any]]
    forged: list[dict[str, Any]]


def replay(
    records: Iterable[dict[str, Any]], *, size: int, quotas: Mapping[str, int], key: str | None = None
) -> Replayed:
    """The state the pool's records end in (a new pool of ``size`` slices and ``quotas`` when there is none)."""
    ordered = sorted(records, key=lambda r: (r["wall"], r["writer"], r["seq"]))
    good, forged = verify(ordered, key) if key is not None else (ordered, [])
    state, decisions, version = new_state(size, quotas), 0, 0
    for r in good:
        if r["kind"] != "decision":
            continue
        try:
            state = state_from_dict(r["state"])
        except (ConfigError, KeyError, TypeError):
            continue
        decisions += 1
        epoch = r.get("epoch")
        version = epoch + 1 if isinstance(epoch, int) and not isinstance(epoch, bool) else version + 1
    return Replayed(state=state, decisions=decisions, version=version, records=good, forged=forged)
