"""What a job did: the commit ledger (exactly-once accounting), recovery figures and a timeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.log import get_logger

__all__ = ["Ledger", "PlacementFigures", "Report", "Timeline", "fill_report"]

_log = get_logger("elastic.control.report")


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
        """The lineage as runs ``[first_step, first_batch, length]`` (steps and batches both counting up):
        a job with data addressed by step stores one run however long it is."""
        runs: list[list[int]] = []
        for step, batch in zip(self.steps, self.batches, strict=True):
            if runs and step == runs[-1][0] + runs[-1][2] and batch == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([step, batch, 1])
        return {"runs": runs}

    @staticmethod
    def expand(meta: dict[str, Any]) -> tuple[list[int], list[int]]:
        steps: list[int] = []
        batches: list[int] = []
        for first_step, first_batch, length in meta["runs"]:
            steps.extend(range(first_step, first_step + length))
            batches.extend(range(first_batch, first_batch + length))
        return steps, batches

    def rollback(self, meta: dict[str, Any]) -> int:
        """Return to the lineage saved in a snapshot's ``meta``; the number of commits dropped."""
        steps, batches = self.expand(meta)
        dropped = len(self.steps) - len(steps)
        self.recomputed += max(dropped, 0)
        self.steps, self.batches = steps, batches
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
        self.sinks: list[Callable[[dict[str, Any]], None]] = []  # each event is passed on (event stream, metrics)

    def add(self, event: str, **detail: Any) -> None:
        record = {"t": round(time.time() - self.start, 3), "event": event, **detail}
        self.events.append(record)
        for sink in self.sinks:
            try:
                sink(record)
            except Exception as err:  # noqa: BLE001 - a sink (metrics, the event stream) never stops training
                _log.warning("timeline_sink_failed", sink=getattr(sink, "__qualname__", repr(sink)), error=repr(err))


@dataclass(kw_only=True)
class Report:
    """A run's figures: slices seen, failures and recoveries, notices and the slices left on them, steps committed
    and recomputed, snapshots, restores and their tiers, recovery seconds; ``to_dict()`` is what ``--json`` prints."""

    slices_initial: int
    slices_final: int = 0
    min_slices_seen: int = 0
    failures_injected: int = 0
    recoveries: int = 0
    grows: int = 0
    notices: int = 0  # notices that slices would go, taken by the supervisor (every source)
    planned_shrinks: int = 0  # slices left at a step boundary on a notice, the live state moved: nothing recomputed
    client_restarts: int = 0
    steps_committed: int = 0
    steps_recomputed: int = 0
    duplicate_steps: int = 0
    skipped_steps: int = 0
    snapshots_taken: int = 0
    snapshots_requested: int = 0
    snapshots_coalesced: int = 0
    snapshots_failed: int = 0
    snapshot_blocking_seconds: float = 0.0
    snapshot_held_bytes: int = 0
    snapshot_copies: int = 0
    keeper_bytes: int = 0
    keeper_pushes: int = 0
    persistent_saves: int = 0
    resumed_from_tier: str | None = None  # the tier the first restore of a new client read (None: fresh start)
    restores: list[dict[str, Any]] = field(default_factory=list)  # each restore: step, tier, generation
    standby_compiles: int = 0  # executables compiled ahead for meshes the job may move to
    standby_skipped: int = 0  # calls that do not fit some candidate mesh as made (they compile on recovery)
    standby_compile_seconds: float = 0.0
    recovery_seconds: list[float] = field(default_factory=list)
    # per notice acted on: source, reason, slices, lead_s (its warning), running_on_rest_s (from the notice to the
    # first step committed without its slices), steps_recomputed, planned (left at a boundary, not by the failure path)
    notice_details: list[dict[str, Any]] = field(default_factory=list)
    # the job was asked to stop (ElasticJob.stop): the step it stopped before, the step saved to the persistent tier
    # there (None: no such tier), and why; None for a run that went to its last step
    stopped: dict[str, Any] | None = None
    final_loss: float | None = None
    wall_seconds: float = 0.0
    timeline: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "single-process"
    extra: dict[str, Any] = field(default_factory=dict)  # mode-specific figures (multi-process: worker processes)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (``extra`` merged in), as ``--json`` prints it."""
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


@dataclass(frozen=True, kw_only=True)
class PlacementFigures:
    """What a placement adds to the report: its snapshot tiers' counters (``keeper_*``, ``persistent_saves``:
    None where the mode has no such tier or does not count it), its standby compiles, and mode-specific ``extra``
    figures."""

    snapshots_requested: int = 0
    snapshots_taken: int = 0
    snapshots_coalesced: int = 0
    snapshots_failed: int = 0
    snapshot_blocking_seconds: float = 0.0
    snapshot_held_bytes: int = 0
    snapshot_copies: int = 0
    keeper_bytes: int | None = None
    keeper_pushes: int | None = None
    persistent_saves: int | None = None
    standby_compiles: int = 0
    standby_skipped: int = 0
    standby_compile_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def fill_report(report: Report, figures: PlacementFigures) -> None:
    """Put a placement's ``figures`` in ``report`` (the one place both modes' figures land)."""
    report.snapshots_requested = figures.snapshots_requested
    report.snapshots_taken = figures.snapshots_taken
    report.snapshots_coalesced = figures.snapshots_coalesced
    report.snapshots_failed = figures.snapshots_failed
    report.snapshot_blocking_seconds = round(figures.snapshot_blocking_seconds, 4)
    report.snapshot_held_bytes = figures.snapshot_held_bytes
    report.snapshot_copies = figures.snapshot_copies
    if figures.keeper_bytes is not None:
        report.keeper_bytes = figures.keeper_bytes
    if figures.keeper_pushes is not None:
        report.keeper_pushes = figures.keeper_pushes
    if figures.persistent_saves is not None:
        report.persistent_saves = figures.persistent_saves
    report.standby_compiles = figures.standby_compiles
    report.standby_skipped = figures.standby_skipped
    report.standby_compile_seconds = round(figures.standby_compile_seconds, 3)
    report.extra.update(figures.extra)
