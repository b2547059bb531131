"""What a job did: the commit ledger (exactly-once accounting), recovery figures and a timeline."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ledger", "Report", "Timeline"]


class Ledger:
    """Steps committed in the lineage of the current state, and the batches they consumed.

    A step is committed by ``Run.commit``; a rollback to a snapshot drops the commits the snapshot
    does not hold (they will be recomputed) and counts them.
    """

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.batches: list[int] = []
        self.executed = 0
        self.recomputed = 0

    def commit(self, step: int, batch: int) -> None:
        self.steps.append(step)
        self.batches.append(batch)
        self.executed += 1

    def to_meta(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "batches": list(self.batches)}

    def rollback(self, meta: dict[str, Any]) -> int:
        """Return to the lineage saved in a snapshot's ``meta``; the number of commits dropped."""
        dropped = len(self.steps) - len(meta["steps"])
        self.recomputed += max(dropped, 0)
        self.steps = list(meta["steps"])
        self.batches = list(meta["batches"])
        return dropped

    def duplicates(self) -> int:
        return len(self.steps) - len(set(self.steps))

    def skipped(self, num_steps: int) -> int:
        return len(set(range(num_steps)) - set(self.steps))


class Timeline:
    """Wall-clock events relative to the job's start."""

    def __init__(self) -> None:
        self.start = time.time()
        self.events: list[dict[str, Any]] = []

    def add(self, event: str, **detail: Any) -> None:
        self.events.append({"t": round(time.time() - self.start, 3), "event": event, **detail})


@dataclass(kw_only=True)
class Report:
    slices_initial: int
    slices_final: int = 0
    min_slices_seen: int = 0
    failures_injected: int = 0
    recoveries: int = 0
    grows: int = 0
    client_restarts: int = 0
    steps_committed: int = 0
    steps_recomputed: int = 0
    duplicate_steps: int = 0
    skipped_steps: int = 0
    snapshots_taken: int = 0
    recovery_seconds: list[float] = field(default_factory=list)
    final_loss: float | None = None
    wall_seconds: float = 0.0
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
