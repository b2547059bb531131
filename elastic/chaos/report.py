"""What a chaos run found: one :class:`ScheduleResult` per schedule, summed up in a :class:`ChaosResult`
(``.ok``, ``.violations``, ``to_dict()`` for ``elastic chaos --json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.chaos.catalogue import Schedule
from elastic.chaos.invariants import RunRecord, Verdict

__all__ = ["ChaosResult", "ScheduleResult", "Violation"]


@dataclass(frozen=True, kw_only=True)
class Violation:
    """A broken promise, with what replays it: ``elastic chaos --seed S --index I`` (``replay``)."""

    seed: int | None
    index: int | None
    scenario: str
    promise: str
    detail: str
    evidence: dict[str, Any] = field(default_factory=dict)
    faults: tuple[dict[str, Any], ...] = ()
    replay: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "index": self.index,
            "scenario": self.scenario,
            "promise": self.promise,
            "detail": self.detail,
            "evidence": self.evidence,
            "faults": list(self.faults),
            "replay": self.replay,
        }

    def __str__(self) -> str:
        return f"{self.promise} broken by {self.scenario} (seed {self.seed}, index {self.index}): {self.detail}"


@dataclass(frozen=True, kw_only=True)
class ScheduleResult:
    schedule: Schedule
    record: RunRecord
    injected: int  # faults that struck (a fault whose moment never came is not counted)
    verdict: Verdict
    replay: str

    @property
    def recovered(self) -> bool:
        """The run met faults, finished, and kept every promise."""
        return self.record.outcome == "finished" and self.injected > 0 and self.verdict.ok

    @property
    def gave_up_as_expected(self) -> bool:
        return self.schedule.expect != "finish" and self.record.outcome != "finished" and self.verdict.ok

    @property
    def violations(self) -> list[Violation]:
        s = self.schedule
        return [
            Violation(
                seed=s.seed,
                index=s.index,
                scenario=s.scenario,
                promise=p.promise,
                detail=p.detail,
                evidence=p.evidence,
                faults=tuple(f.to_dict() for f in s.faults),
                replay=self.replay,
            )
            for p in self.verdict.failed
        ]

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            **self.schedule.to_dict(),
            "outcome": r.outcome,
            "injected": self.injected,
            "seconds": r.seconds,
            "recomputed": r.recomputed,
            "restores": [dict(x) for x in r.restores],
            "min_slices_seen": r.min_slices_seen,
            "notices": [dict(n) for n in r.notices],  # each given: reason, slices, deadline, refused, killed_at
            "notice_details": [dict(d) for d in r.notice_details],  # the report's, per notice acted on
            "error": r.error,
            "promises": {p.promise: p.status for p in self.verdict.promises},
            "replay": self.replay,
            "equivalence": {
                k: v for k, v in self.verdict["equivalence"].evidence.items() if k in ("mode", "atol", "max_abs_diff")
            },
        }


@dataclass(frozen=True, kw_only=True)
class ChaosResult:
    seed: int
    target: str
    results: tuple[ScheduleResult, ...]
    reference: RunRecord
    reference_verdict: Verdict
    not_run: int = 0  # schedules left out after a run that hung and would not unwind
    config_overrides: dict[str, Any] = field(default_factory=dict)
    replay: str = ""

    @property
    def schedules(self) -> int:
        return len(self.results)

    @property
    def faults_injected(self) -> int:
        return sum(r.injected for r in self.results)

    @property
    def recovered(self) -> int:
        return sum(r.recovered for r in self.results)

    @property
    def gave_up_as_expected(self) -> int:
        return sum(r.gave_up_as_expected for r in self.results)

    @property
    def hangs(self) -> int:
        return sum(r.record.outcome == "hang" for r in self.results)

    @property
    def violations(self) -> list[Violation]:
        found = [
            Violation(
                seed=self.seed,
                index=None,
                scenario="reference",
                promise=p.promise,
                detail=p.detail,
                evidence=p.evidence,
                replay=self.replay,
            )
            for p in self.reference_verdict.failed
        ]
        return found + [v for r in self.results for v in r.violations]

    @property
    def ok(self) -> bool:
        return not self.violations and self.hangs == 0 and self.not_run == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "target": self.target,
            "schedules": self.schedules,
            "faults_injected": self.faults_injected,
            "recovered": self.recovered,
            "gave_up_as_expected": self.gave_up_as_expected,
            "violations": [v.to_dict() for v in self.violations],
            "hangs": self.hangs,
            "not_run": self.not_run,
            "ok": self.ok,
            "reference_seconds": self.reference.seconds,
            "config_overrides": self.config_overrides,
            "runs": [r.to_dict() for r in self.results],
        }
