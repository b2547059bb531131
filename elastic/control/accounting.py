"""What a job keeps account of: the commit ledger, the timeline, the report, and the failure being
recovered from. The controller tells it what happened; it never decides anything."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from elastic.control.report import Ledger, Report, Timeline
from elastic.log import get_logger
from elastic.supervision.membership import View
from elastic.supervision.notices import Notice

__all__ = ["Accounting"]

_log = get_logger("elastic.control.accounting")


class Accounting:
    def __init__(self, *, num_slices: int, num_steps: int) -> None:
        self.num_steps = num_steps
        self.ledger = Ledger()
        self.timeline = Timeline()
        self.report = Report(slices_initial=num_slices, min_slices_seen=num_slices)
        self.pids: set[int] = set()
        self.last_loss: float | None = None
        self._failure_at: float | None = None  # when the failure being recovered from was seen
        self._failed_step = -1
        self.failures_in_a_row = 0  # slice-loss errors before a step past ``_failed_step`` commits
        # called after each commit with (step, view): per-step consumers (metrics, the progress events)
        self.commit_sinks: list[Callable[[int, View], None]] = []
        # notices acted on, until the first commit without their slices: (notice, epoch, recomputed then, planned)
        self._leaving: list[tuple[Notice, int, int, bool]] = []
        self._notice_epochs: set[int] = set()

    # -- the happy path ----------------------------------------------------------------------
    def committed(self, step: int, batch: int, metrics: dict[str, Any], view: View) -> None:
        self.ledger.commit(step, batch)
        self.pids.add(os.getpid())
        if "loss" in metrics:
            self.last_loss = float(metrics["loss"])
        if self._failure_at is not None:
            self.report.recovery_seconds.append(round(time.time() - self._failure_at, 3))
            self.timeline.add("first_step", step=step, slices=len(view.active), epoch=view.epoch)
            self._failure_at = None
        if step >= self._failed_step:
            self.failures_in_a_row = 0
        if self._leaving:
            self._running_without(step, view)
        for sink in self.commit_sinks:
            try:
                sink(step, view)
            except Exception as err:  # noqa: BLE001 - a sink never stops training
                _log.warning("commit_sink_failed", sink=getattr(sink, "__qualname__", repr(sink)), error=repr(err))

    def meta(self, extras: dict[str, Any], seed: int) -> dict[str, Any]:
        """Controller state for a snapshot: the ledger as runs, the user's extras, the client pids."""
        return {
            "ledger": self.ledger.to_meta(),
            "extras": extras,
            "pids": sorted(self.pids | {os.getpid()}),
            "seed": seed,
        }

    def on_view(self, view: View) -> None:
        self.report.min_slices_seen = min(self.report.min_slices_seen, len(view.active))
        if view.notices and view.epoch not in self._notice_epochs:  # a view that leaves slices on notice
            self._notice_epochs.add(view.epoch)
            self.report.notices += len(view.notices)
            self._leaving += [(n, view.epoch, self.ledger.recomputed, False) for n in view.notices]

    # -- notices ---------------------------------------------------------------------------------
    def left(self, view: View, step: int) -> None:
        """The live state moved off the slices ``view`` leaves on notice, at the boundary before ``step``."""
        self.report.planned_shrinks += 1
        self._leaving = [(n, e, r, planned or e == view.epoch) for n, e, r, planned in self._leaving]
        self.timeline.add("left", step=step, epoch=view.epoch, slices=len(view.active), leaving=sorted(view.leaving))

    def _running_without(self, step: int, view: View) -> None:
        """The first commit after a view that left slices on notice: one figure per notice."""
        now = time.time()
        for notice, epoch, recomputed, planned in self._leaving:
            detail = {
                "source": notice.source,
                "reason": notice.reason,
                "slices": sorted(notice.slices),
                "lead_s": round(notice.lead_s, 3),
                "running_on_rest_s": round(now - notice.at, 3),
                "steps_recomputed": self.ledger.recomputed - recomputed,
                "planned": planned,
                "epoch": epoch,
            }
            self.report.notice_details.append(detail)
            shown = {k: v for k, v in detail.items() if k != "slices"} | {"left": detail["slices"]}
            self.timeline.add("running_on_rest", step=step, slices=len(view.active), **shown)
        self._leaving = []

    # -- failures and recoveries ---------------------------------------------------------------
    def failure(self, cause: str) -> None:
        """A slice-loss error was caught (counted in ``failures_in_a_row``)."""
        self.failures_in_a_row += 1
        failed_step = self.ledger.steps[-1] + 1 if self.ledger.steps else 0
        self._failed_step = max(self._failed_step, failed_step)
        self._failure_at = self._failure_at or time.time()
        self.timeline.add("failure", error=cause.splitlines()[0][:160])

    def restored(
        self,
        meta: dict[str, Any],
        *,
        step: int,
        tier: str,
        generation: int,
        view: View,
        waited_s: float = 0.0,
        source: str = "copies",
        shards_kept: int = 0,
        detail: dict[str, Any] | None = None,
    ) -> None:
        self.ledger.rollback(meta["ledger"])
        self.pids = set(meta["pids"])
        self.report.restores.append({"step": step, "tier": tier, "generation": generation, "source": source})
        if self.report.resumed_from_tier is None and os.getpid() not in self.pids:
            self.report.resumed_from_tier = tier  # a new client picking up a crashed one's job
        self.timeline.add(
            "restored",
            step=step,
            tier=tier,
            generation=generation,
            slices=len(view.active),
            epoch=view.epoch,
            waited_for_snapshot_s=waited_s,
            source=source,
            shards_kept=shards_kept,
            **(detail or {}),
        )

    def fresh_start(self, step: int = 0) -> None:
        """Nothing saved anywhere: commits so far (if any) will be redone from ``step`` (0, or the step of the
        checkpoint the job continues: its steps 0..step-1 count as done, each with its own batch)."""
        self.ledger.rollback({"runs": [[0, 0, step]] if step else []})
        if step:
            self.report.extra["continued_from_step"] = step

    def regrouped(self, old: View, new: View) -> None:
        grew = len(new.active) > len(old.active)
        leave = bool(new.leaving & old.active)
        self.report.grows += grew and not leave
        what = "leave" if leave else "grow" if grew else "shrink"
        self.timeline.add(what, epoch=new.epoch, slices=len(new.active), reason=new.reason)

    # -- the end -------------------------------------------------------------------------------
    def stopped(self, *, at_step: int, persisted: int | None, reason: str) -> None:
        """The job stopped at the step boundary before ``at_step``, its state saved to the persistent tier there
        (``persisted``: that step; None: the job has no persistent tier)."""
        self.report.stopped = {"at_step": at_step, "persisted_step": persisted, "reason": reason}
        self.timeline.add("stopped", step=at_step, persisted_step=persisted, reason=reason)
        _log.warning("job_stopped", at_step=at_step, persisted_step=persisted, reason=reason)

    def finish(self, view: View) -> Report:
        r = self.report
        r.slices_final = len(view.active)
        r.client_restarts = max(len(self.pids) - 1, 0)
        r.steps_committed = len(self.ledger.steps)
        r.steps_recomputed = self.ledger.recomputed
        r.duplicate_steps = self.ledger.duplicates()
        stopped = r.stopped["at_step"] if r.stopped else None
        r.skipped_steps = self.ledger.skipped(self.num_steps if stopped is None else stopped)
        r.final_loss = self.last_loss
        r.wall_seconds = round(time.time() - self.timeline.start, 3)
        self.timeline.add("finished", steps=r.steps_committed, slices=r.slices_final)
        r.timeline = self.timeline.events
        return r
