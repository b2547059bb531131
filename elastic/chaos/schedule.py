"""A chaos schedule as data: its faults (:class:`ChaosFault`), the shape of the job it is drawn for
(:class:`JobShape`), the scenario it draws (:class:`Scenario`), and which of its faults ``elastic.Faults``, the
runner's seams or its notices carry out (:class:`Schedule`). Phases and kinds: see :mod:`elastic.chaos.catalogue`."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from elastic.chaos.faults import Faults
from elastic.config import ElasticConfig

__all__ = [
    "HANG_STEP_TIMEOUT_S",
    "NOTICE_PHASES",
    "PLAN_KINDS",
    "WORKER_PHASES",
    "Build",
    "ChaosFault",
    "ChaosKind",
    "Expect",
    "JobShape",
    "Phase",
    "Scenario",
    "Schedule",
]

Phase = Literal[
    "step",
    "mid_step",
    "snapshot",
    "after_restore",
    "after_reshard",
    "after_grow",
    "restore",
    "reshard",
    "grow",
    "forming",
    "notice",
    "deadline",
]
ChaosKind = Literal[
    "kill",
    "revive",
    "silence",
    "transient",
    "hang",
    "straggler",
    "corrupt",
    "supervisor_restart",
    "supervisor_lost",
    "notice",
]
Expect = Literal["finish", "give_up", "supervisor_lost"]
PLAN_KINDS = ("kill", "revive", "silence", "transient", "hang")  # what elastic.Faults injects at phase "step"
WORKER_PHASES = {"mid_step": "collective", "forming": "forming", "restore": "restore"}  # multi-process kills placed
NOTICE_PHASES: tuple[Phase, ...] = ("notice", "deadline")  # a kill that follows a notice for its slice
HANG_STEP_TIMEOUT_S = 5.0  # the step watchdog of a schedule with a hang: at most this (also when the target's is off)


@dataclass(frozen=True, kw_only=True)
class ChaosFault:
    """One fault: ``kind`` strikes slice ``slice`` (if any) at ``phase`` of step ``at_step`` (for the
    ``after_*`` phases: the first such pass once the loop has reached ``at_step``). ``seconds``: a
    straggler's delay, a notice's deadline (from when it is given). A ``hang`` with a ``slice`` leaves that slice
    wedged (down until revived); without one every slice stays healthy."""

    kind: ChaosKind
    at_step: int
    phase: Phase = "step"
    slice: int | None = None
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """What a schedule needs to know of the job: its size, its floor and whether its snapshots survive two
    slices lost at once (three in-memory copies, or every snapshot in the keepers)."""

    num_slices: int
    min_slices: int
    num_steps: int
    snapshot_every: int
    survives_two: bool
    multi: bool = False  # multi-process mode: faults are carried out by the worker processes, at step starts
    replaces: bool = False  # multi-process mode with Processes.replace_lost: a killed process gets a successor

    @classmethod
    def of(cls, config: ElasticConfig) -> JobShape:
        tiers = config.tiers
        multi = config.processes is not None
        return cls(
            num_slices=config.num_slices,
            min_slices=config.policy.min_slices,
            num_steps=config.num_steps,
            snapshot_every=config.snapshot_every,
            multi=multi,
            replaces=multi and config.processes is not None and config.processes.replace_lost,
            survives_two=tiers.copies >= 3
            or tiers.keeper_every == 1
            or tiers.persistent_dir is not None
            or (multi and tiers.keeper_every > 0),
        )

    @property
    def spare(self) -> int:
        """Slices the job may lose and still run."""
        return self.num_slices - self.min_slices


Build = Callable[[random.Random, JobShape], tuple[list[ChaosFault], Expect]]


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    summary: str
    phases: tuple[Phase, ...]
    build: Build
    applies: Callable[[JobShape], bool] = lambda shape: shape.spare >= 1
    since: int = 1  # the catalogue generation that added it (see the module's docstring)
    multi: bool = False  # it applies in multi-process mode too (its faults at phase "step", or notices and their kills)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    seed: int
    index: int
    scenario: str
    faults: tuple[ChaosFault, ...]
    expect: Expect
    multi: bool = False  # a multi-process job's: its workers carry out kills placed in a step or a re-formation

    def _planned(self, f: ChaosFault) -> bool:
        return (
            (f.phase == "step" and f.kind in PLAN_KINDS)
            or (self.multi and f.kind == "kill" and f.phase in WORKER_PHASES)
            or (self.multi and f.kind == "supervisor_restart" and f.phase == "step")
        )

    def plan(self) -> Faults:
        """The faults ``elastic.Faults`` carries out itself (phase ``step``, its kinds; in multi-process mode also
        the kills its workers place inside a step's collectives, a group's forming or its restore, and the
        supervisor's restart, which the driver carries out)."""
        faults = Faults()
        for f in self.faults:
            if self.multi and f.kind == "supervisor_restart" and f.phase == "step":
                faults.restart_supervisor(at_step=f.at_step)
            elif self.multi and f.kind == "kill" and f.phase in WORKER_PHASES:
                assert f.slice is not None
                faults.kill_slice(f.slice, at_step=f.at_step, during=WORKER_PHASES[f.phase])  # type: ignore[arg-type]
            elif f.phase == "step" and f.kind in PLAN_KINDS:
                if f.kind == "transient":
                    faults.transient_error(at_step=f.at_step)
                elif f.kind == "hang":
                    faults.hang_step(at_step=f.at_step, slice=f.slice)
                else:
                    assert f.slice is not None  # kill, revive and silence name a slice
                    if f.kind == "kill":
                        faults.kill_slice(f.slice, at_step=f.at_step)
                    elif f.kind == "revive":
                        faults.revive_slice(f.slice, at_step=f.at_step)
                    else:
                        faults.silence_agent(f.slice, at_step=f.at_step)
        return faults

    def notices(self) -> tuple[ChaosFault, ...]:
        """The notices and the kills that follow them (:mod:`elastic.chaos.notices` carries them out, both modes)."""
        return tuple(f for f in self.faults if f.kind == "notice" or f.phase in NOTICE_PHASES)

    @property
    def hangs(self) -> bool:
        """Whether a step of this schedule hangs (the step watchdog must be on, and short)."""
        return any(f.kind == "hang" for f in self.faults)

    def seams(self) -> tuple[ChaosFault, ...]:
        """The faults the chaos runner's seams carry out (other phases and kinds, but notices: :meth:`notices`)."""
        notices = self.notices()
        return tuple(f for f in self.faults if not self._planned(f) and f not in notices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "index": self.index,
            "scenario": self.scenario,
            "expect": self.expect,
            "faults": [f.to_dict() for f in self.faults],
        }
