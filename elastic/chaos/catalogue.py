"""The fault catalogue and seeded chaos schedules: ``schedule(seed, index, shape)`` is the same list of
faults every time it is called with the same arguments, so any schedule replays from ``(seed, index)``.

Each schedule draws one scenario from :data:`CATALOGUE` (a seeded round robin: any ``len(CATALOGUE)``
consecutive indices cover every scenario that applies to the job) and places its faults at seeded
steps and slices. A fault has a *phase*, the moment in the job it strikes:

- ``step``: as the step starts, before its body (``elastic.Faults``: the controller's before-step hook);
- ``mid_step``: the step's computation is dispatched, its commit has not waited for it yet;
- ``snapshot``: right after a commit that asked for a snapshot, while the snapshot is copied;
- ``after_restore`` / ``after_reshard`` / ``after_grow``: the first pass of the loop after a restore from a
  snapshot, a move of the live state onto fewer slices, or onto more, before its first step;
- ``restore`` / ``reshard`` / ``grow``: inside that restore or move itself, its transfers dispatched and not yet
  landed (the controller's ``during_prepare`` seam).

A ``notice`` warns the job that a slice will go within ``seconds`` (``ElasticJob.notice``, given from a thread of
its own as a scheduler gives it: :mod:`elastic.chaos.notices`, both modes). A kill may follow it on the same slice
(``at_step`` the notice's): at phase ``notice`` as soon as the notice is taken (before the job can reach the step
boundary where it would leave), at phase ``deadline`` when its deadline passes (the scheduler takes the slice).

Besides slices, a fault may strike the supervisor: ``supervisor_restart`` kills its actor so that Ray restarts it
(it rebuilds its view from its event log), ``supervisor_lost`` kills it for good (the job must end with
``SupervisorLostError`` within its bound, not train on unsupervised).

Faults at phase ``step`` of the kinds ``elastic.Faults`` knows go through ``elastic.Faults`` (see
:meth:`Schedule.plan`); the rest are carried out by :mod:`elastic.chaos.runner`. A ``hang`` (a step whose
computation never completes) needs the step watchdog: the runner caps ``step_timeout_s`` for a schedule
that holds one (:data:`HANG_STEP_TIMEOUT_S`). Pure: no jax, no Ray.

Scenarios added to the catalogue later (a higher ``since``) are drawn after the earlier ones in each round
of the round robin, so a schedule ``(seed, index)`` with ``index`` below the earlier catalogue's size draws
the scenario it drew before the extension.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from elastic.chaos.faults import Faults
from elastic.config import ElasticConfig
from elastic.errors import ConfigError

__all__ = [
    "CATALOGUE",
    "HANG_STEP_TIMEOUT_S",
    "NOTICE_PHASES",
    "ChaosFault",
    "JobShape",
    "Scenario",
    "Schedule",
    "applicable",
    "schedule",
    "schedules",
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


# -- scenario builders: each returns its faults and what the job should do ------------------------------
def _early(rng: random.Random, shape: JobShape) -> int:
    """A step in the first half of the run (room left to recover, grow and finish)."""
    return rng.randint(1, max(1, shape.num_steps // 2 - 1))


def _later(rng: random.Random, shape: JobShape, after: int, *, gap: int = 3) -> int:
    return min(after + rng.randint(gap, gap + 4), shape.num_steps - 2)


def _kill(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    phase: Phase = "step" if shape.multi else rng.choice(["step", "mid_step", "snapshot"])
    step = _early(rng, shape)
    if phase == "snapshot":  # the commit of this step asks for the snapshot of the next
        step = max(shape.snapshot_every - 1, step - step % shape.snapshot_every - 1)
    return [ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=step, phase=phase)], "finish"


def _kill_revive(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return [
        ChaosFault(kind="kill", slice=s, at_step=step),
        ChaosFault(kind="revive", slice=s, at_step=_later(rng, shape, step)),
    ], "finish"


def _two_at_once(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    pair, step = rng.sample(range(shape.num_slices), 2), _early(rng, shape)
    return [ChaosFault(kind="kill", slice=s, at_step=step) for s in pair], "finish"


def _every_slice(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Every slice dies: the job gives up within its bound; unless new processes replace the killed ones
    (multi-process mode, ``replace_lost``): then it waits for them and finishes from the keepers."""
    step = _early(rng, shape)
    expect: Expect = "finish" if shape.replaces else "give_up"
    return [ChaosFault(kind="kill", slice=s, at_step=step) for s in range(shape.num_slices)], expect


def _flapping(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    s, step, faults = rng.randrange(shape.num_slices), rng.randint(1, 3), []
    for kind in ("kill", "revive", "kill", "revive"):
        faults.append(ChaosFault(kind=kind, slice=s, at_step=step))
        step = _later(rng, shape, step, gap=2)
    return faults, "finish"


def _silence(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    faults = [ChaosFault(kind="silence", slice=s, at_step=step)]
    if rng.random() < 0.5:
        faults.append(ChaosFault(kind="revive", slice=s, at_step=_later(rng, shape, step)))
    return faults, "finish"


def _transient(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    phase: Phase = "step" if shape.multi else rng.choice(["step", "mid_step"])
    return [ChaosFault(kind="transient", at_step=_early(rng, shape), phase=phase)], "finish"


def _hang(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A step hangs until the watchdog aborts it: every slice healthy (retried on the same slices), or one
    slice wedged (dropped, and perhaps revived later) where the job can spare one."""
    step = _early(rng, shape)
    if shape.spare < 1 or rng.random() < 0.5:
        return [ChaosFault(kind="hang", at_step=step)], "finish"
    s = rng.randrange(shape.num_slices)
    faults = [ChaosFault(kind="hang", slice=s, at_step=step)]
    if rng.random() < 0.5:
        faults.append(ChaosFault(kind="revive", slice=s, at_step=_later(rng, shape, step)))
    return faults, "finish"


def _straggler(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    return [
        ChaosFault(
            kind="straggler", at_step=_early(rng, shape), phase="mid_step", seconds=round(rng.uniform(0.2, 1.0), 2)
        )
    ], "finish"


def _corrupt(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    return [ChaosFault(kind="corrupt", at_step=_early(rng, shape))], "finish"


def _after(phase: Phase) -> Build:
    def build(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
        first, second = rng.sample(range(shape.num_slices), 2)
        step = _early(rng, shape)
        lead = {
            "after_restore": [ChaosFault(kind="kill", slice=first, at_step=step)],
            "after_reshard": [ChaosFault(kind="silence", slice=first, at_step=step)],
            "after_grow": [
                ChaosFault(kind="kill", slice=first, at_step=step),
                ChaosFault(kind="revive", slice=first, at_step=_later(rng, shape, step)),
            ],
        }[phase]
        return lead + [ChaosFault(kind="kill", slice=second, at_step=step, phase=phase)], "finish"

    return build


def _during(phase: Phase) -> Build:
    """The lead faults of ``after_<phase>``, then a second slice killed inside the restore or move itself."""
    lead = _after(f"after_{phase}")  # type: ignore[arg-type]

    def build(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
        faults, expect = lead(rng, shape)
        return faults[:-1] + [replace(faults[-1], phase=phase)], expect

    return build


def _supervisor_restart(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """The supervisor is killed and restarted by Ray; a slice dies a few steps later: the restarted supervisor
    must still see it."""
    step = _early(rng, shape)
    return [
        ChaosFault(kind="supervisor_restart", at_step=step),
        ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=_later(rng, shape, step, gap=2)),
    ], "finish"


def _supervisor_lost(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """The supervisor dies for good, then a slice: no recovery can be decided, so the job must end with
    ``SupervisorLostError`` within its bound (not wait out ``recovery_timeout_s``, not train on unsupervised)."""
    step = _early(rng, shape)
    return [
        ChaosFault(kind="supervisor_lost", at_step=step),
        ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=step + 1),
    ], "supervisor_lost"


def _kill_in_collective(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Multi-process: a worker SIGKILLed a moment into a step, its collectives in flight."""
    return [
        ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=_early(rng, shape), phase="mid_step")
    ], "finish"


def _kill_in_reformation(phase: Phase) -> Build:
    """Multi-process: one worker dies, then a second while the group re-forms without it (``forming``: before the
    rendezvous; ``restore``: the group formed, the state not yet placed)."""

    def build(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
        first, second = rng.sample(range(shape.num_slices), 2)
        step = _early(rng, shape)
        return [
            ChaosFault(kind="kill", slice=first, at_step=step),
            ChaosFault(kind="kill", slice=second, at_step=step, phase=phase),
        ], "finish"

    return build


def _kill_with_buddy(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Multi-process: a worker and the one holding its buddy copy (the next member) die in the same step, before
    any re-formation: only the keepers hold the lost shards."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return [
        ChaosFault(kind="kill", slice=s, at_step=step),
        ChaosFault(kind="kill", slice=(s + 1) % shape.num_slices, at_step=step),
    ], "finish"


def _noticed(
    s: int, step: int, seconds: float, *, then: Phase | None = None, phase: Phase = "step"
) -> list[ChaosFault]:
    """A notice for slice ``s`` at ``phase`` of step ``step``; ``then``: a kill of ``s`` at that moment after it."""
    faults = [ChaosFault(kind="notice", slice=s, at_step=step, phase=phase, seconds=seconds)]
    return faults + ([ChaosFault(kind="kill", slice=s, at_step=step, phase=then)] if then else [])


def _notice_then_kill(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A notice a few seconds ahead, then the slice killed at its deadline (the scheduler takes it): the job must
    have left it before, at a step boundary, nothing recomputed."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return _noticed(s, step, round(rng.uniform(4.0, 8.0), 1), then="deadline"), "finish"


def _notice_early_death(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A notice with a long deadline, then its slice dies as soon as the notice is taken, before the job reaches the
    step boundary where it would leave: the failure path, no step lost or repeated."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return _noticed(s, step, round(rng.uniform(30.0, 120.0), 1), then="notice"), "finish"


def _notice_during_restore(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A slice dies; while the job restores without it (inside the restore, or the first pass after it) a second
    slice is given notice: the job leaves that one too, live, once it runs again."""
    first, second = rng.sample(range(shape.num_slices), 2)
    step = _early(rng, shape)
    phase: Phase = rng.choice(["after_restore", "restore"])
    notice = _noticed(second, step, round(rng.uniform(10.0, 30.0), 1), phase=phase)
    return [ChaosFault(kind="kill", slice=first, at_step=step), *notice], "finish"


def _staggered_notices(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Two notices for two slices, one or two steps apart (one shrink or two; never below ``min_slices``: the
    supervisor keeps a slice whose leave would go below it until the slice goes)."""
    first, second = rng.sample(range(shape.num_slices), 2)
    step = _early(rng, shape)
    return [
        *_noticed(first, step, round(rng.uniform(5.0, 30.0), 1)),
        *_noticed(second, step + rng.randint(1, 2), round(rng.uniform(5.0, 30.0), 1)),
    ], "finish"


def _notice_short_deadline(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A notice whose deadline is shorter than a step, the slice killed at it: the failure path or a leave, whichever
    comes first; no hang, nothing lost or repeated."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return _noticed(s, step, rng.choice([0.02, 0.05, 0.1]), then="deadline"), "finish"


def _multi_two_down(shape: JobShape) -> bool:
    return shape.multi and _two_down(shape)


def _two_down(shape: JobShape) -> bool:
    return shape.spare >= 2 and shape.survives_two


CATALOGUE: tuple[Scenario, ...] = (
    Scenario(
        name="kill",
        summary="one slice dies (agent killed, devices fail)",
        phases=("step", "mid_step", "snapshot"),
        build=_kill,
        multi=True,
    ),
    Scenario(
        name="kill_revive",
        summary="one slice dies and comes back: shrink, then grow",
        phases=("step",),
        build=_kill_revive,
        multi=True,
    ),
    Scenario(
        name="two_at_once",
        summary="two slices die in the same step",
        phases=("step",),
        build=_two_at_once,
        applies=_two_down,
        multi=True,
    ),
    Scenario(
        name="every_slice",
        summary="every slice dies: the job must give up within its bound (multi-process "
        "mode with replace_lost: finish on the replacements, from the keepers)",
        phases=("step",),
        build=_every_slice,
        applies=lambda shape: True,
        multi=True,
    ),
    Scenario(
        name="flapping", summary="one slice dies, returns, dies, returns", phases=("step",), build=_flapping, multi=True
    ),
    Scenario(
        name="silence",
        summary="an agent stops heartbeating (hung host); the step waits until the supervisor drops it",
        phases=("step",),
        build=_silence,
        multi=True,
    ),
    Scenario(
        name="transient",
        summary="a slice-loss error with every slice healthy",
        phases=("step", "mid_step"),
        build=_transient,
        applies=lambda shape: True,
        multi=True,
    ),
    Scenario(
        name="straggler", summary="one step is slow", phases=("mid_step",), build=_straggler, applies=lambda shape: True
    ),
    Scenario(
        name="corrupt",
        summary="a byte of one copy of the newest snapshot flips, then a restore reads it",
        phases=("step",),
        build=_corrupt,
        applies=lambda shape: True,
    ),
    Scenario(
        name="kill_after_restore",
        summary="a second slice dies as the first pass after a restore starts",
        phases=("after_restore",),
        build=_after("after_restore"),
        applies=_two_down,
    ),
    Scenario(
        name="kill_after_reshard",
        summary="a slice dies as the first pass after a shrink of the live state starts",
        phases=("after_reshard",),
        build=_after("after_reshard"),
        applies=_two_down,
    ),
    Scenario(
        name="kill_after_grow",
        summary="a slice dies as the first pass after a grow starts",
        phases=("after_grow",),
        build=_after("after_grow"),
    ),
    Scenario(
        name="hang",
        summary="a step never completes (a hung collective) until the step watchdog aborts it; "
        "every slice healthy, or one wedged",
        phases=("step",),
        build=_hang,
        applies=lambda shape: True,
        since=2,
        multi=True,
    ),
    Scenario(
        name="kill_during_restore",
        summary="a second slice dies while a restore's transfers are in flight",
        phases=("restore",),
        build=_during("restore"),
        applies=_two_down,
        since=3,
    ),
    Scenario(
        name="kill_during_reshard",
        summary="a slice dies while the live state moves onto fewer slices",
        phases=("reshard",),
        build=_during("reshard"),
        applies=_two_down,
        since=3,
    ),
    Scenario(
        name="kill_during_grow",
        summary="a slice dies while the live state moves back onto more slices",
        phases=("grow",),
        build=_during("grow"),
        since=3,
    ),
    Scenario(
        name="supervisor_restart",
        summary="the supervisor is killed and restarted; then a slice dies",
        phases=("step",),
        build=_supervisor_restart,
        since=3,
        multi=True,
    ),
    Scenario(
        name="supervisor_lost",
        summary="the supervisor dies for good, then a slice: the job must end with "
        "SupervisorLostError within its bound",
        phases=("step",),
        build=_supervisor_lost,
        applies=lambda shape: True,
        since=3,
    ),
)
MULTI_ONLY: tuple[Scenario, ...] = (
    Scenario(
        name="kill_in_collective",
        summary="a worker process is SIGKILLed inside a step, its collectives in flight",
        phases=("mid_step",),
        build=_kill_in_collective,
        applies=lambda shape: shape.multi and shape.spare >= 1,
        since=4,
        multi=True,
    ),
    Scenario(
        name="kill_while_forming",
        summary="a worker dies, then a second while the group re-forms",
        phases=("forming",),
        build=_kill_in_reformation("forming"),
        applies=_multi_two_down,
        since=4,
        multi=True,
    ),
    Scenario(
        name="kill_while_restoring",
        summary="a worker dies, then a second while the re-formed group restores",
        phases=("restore",),
        build=_kill_in_reformation("restore"),
        applies=_multi_two_down,
        since=4,
        multi=True,
    ),
    Scenario(
        name="kill_with_buddy",
        summary="a worker and the holder of its buddy copy die in the same step",
        phases=("step",),
        build=_kill_with_buddy,
        applies=_multi_two_down,
        since=4,
        multi=True,
    ),
)
NOTICES: tuple[Scenario, ...] = (
    Scenario(
        name="notice_then_kill",
        summary="a slice is given notice a few seconds ahead and killed at its deadline: the job has left it",
        phases=("step", "deadline"),
        build=_notice_then_kill,
        since=5,
        multi=True,
    ),
    Scenario(
        name="notice_early_death",
        summary="a slice given notice with a long deadline dies before the job could leave it",
        phases=("step", "notice"),
        build=_notice_early_death,
        since=5,
        multi=True,
    ),
    Scenario(
        name="notice_during_restore",
        summary="a slice dies; while the job restores, a second slice is given notice",
        phases=("after_restore", "restore"),
        build=_notice_during_restore,
        applies=lambda shape: shape.spare >= 2,
        since=5,
    ),
    Scenario(
        name="staggered_notices",
        summary="two slices are given notice one or two steps apart",
        phases=("step",),
        build=_staggered_notices,
        applies=lambda shape: shape.spare >= 2,
        since=5,
        multi=True,
    ),
    Scenario(
        name="notice_short_deadline",
        summary="a notice whose deadline is shorter than a step, the slice killed at it",
        phases=("step", "deadline"),
        build=_notice_short_deadline,
        since=5,
        multi=True,
    ),
)
CATALOGUE = CATALOGUE + MULTI_ONLY + NOTICES
BY_NAME = {s.name: s for s in CATALOGUE}


def applicable(shape: JobShape, names: Sequence[str] | None = None) -> list[Scenario]:
    """The scenarios (of ``names``, default all) that fit a job of this shape."""
    unknown = sorted(set(names or ()) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"unknown chaos scenario(s) {unknown}; choose from {sorted(BY_NAME)}")
    if shape.num_steps < 8:
        raise ConfigError(f"chaos needs num_steps >= 8 to place its faults, got {shape.num_steps}")
    chosen = [
        s for s in CATALOGUE if (names is None or s.name in names) and s.applies(shape) and (s.multi or not shape.multi)
    ]
    if not chosen:
        raise ConfigError(
            f"no chaos scenario of {sorted(names or BY_NAME)} fits a job of {shape.num_slices} "
            f"slice(s) with min_slices={shape.min_slices}"
        )
    return chosen


def schedule(seed: int, index: int, shape: JobShape, scenarios: Sequence[str] | None = None) -> Schedule:
    """Schedule ``index`` of ``seed``: the same faults for the same arguments, in any process."""
    chosen = applicable(shape, scenarios)
    order: list[Scenario] = []
    for since in sorted({s.since for s in chosen}):  # each generation shuffled apart: earlier draws stay put
        group = [s for s in chosen if s.since == since]
        random.Random(f"elastic-chaos:{seed}" + (f":{since}" if since > 1 else "")).shuffle(group)
        order += group
    scenario = order[index % len(order)]
    faults, expect = scenario.build(random.Random(f"elastic-chaos:{seed}:{index}"), shape)
    return Schedule(
        seed=seed,
        index=index,
        scenario=scenario.name,
        expect=expect,
        multi=shape.multi,
        faults=tuple(sorted(faults, key=lambda f: f.at_step)),
    )


def schedules(seed: int, count: int, shape: JobShape, scenarios: Sequence[str] | None = None) -> list[Schedule]:
    return [schedule(seed, i, shape, scenarios) for i in range(count)]
