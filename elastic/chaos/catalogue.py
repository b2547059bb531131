"""The fault catalogue and seeded chaos schedules: ``schedule(seed, index, shape)`` is the same list of
faults every time it is called with the same arguments, so any schedule replays from ``(seed, index)``.

This module is a declarative table (:data:`CATALOGUE`: one :class:`Scenario` record each) plus the seeded draw
from it; the scenarios' builders are in :mod:`elastic.chaos.builders`, the schedule's data types in
:mod:`elastic.chaos.schedule`.

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
from collections.abc import Sequence

from elastic.chaos import builders
from elastic.chaos.schedule import HANG_STEP_TIMEOUT_S, NOTICE_PHASES, ChaosFault, JobShape, Scenario, Schedule
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

CATALOGUE: tuple[Scenario, ...] = (
    Scenario(
        name="kill",
        summary="one slice dies (agent killed, devices fail)",
        phases=("step", "mid_step", "snapshot"),
        build=builders.kill,
        multi=True,
    ),
    Scenario(
        name="kill_revive",
        summary="one slice dies and comes back: shrink, then grow",
        phases=("step",),
        build=builders.kill_revive,
        multi=True,
    ),
    Scenario(
        name="two_at_once",
        summary="two slices die in the same step",
        phases=("step",),
        build=builders.two_at_once,
        applies=builders.two_down,
        multi=True,
    ),
    Scenario(
        name="every_slice",
        summary="every slice dies: the job must give up within its bound (multi-process "
        "mode with replace_lost: finish on the replacements, from the keepers)",
        phases=("step",),
        build=builders.every_slice,
        applies=lambda shape: True,
        multi=True,
    ),
    Scenario(
        name="flapping",
        summary="one slice dies, returns, dies, returns",
        phases=("step",),
        build=builders.flapping,
        multi=True,
    ),
    Scenario(
        name="silence",
        summary="an agent stops heartbeating (hung host); the step waits until the supervisor drops it",
        phases=("step",),
        build=builders.silence,
        multi=True,
    ),
    Scenario(
        name="transient",
        summary="a slice-loss error with every slice healthy",
        phases=("step", "mid_step"),
        build=builders.transient,
        applies=lambda shape: True,
        multi=True,
    ),
    Scenario(
        name="straggler",
        summary="one step is slow",
        phases=("mid_step",),
        build=builders.straggler,
        applies=lambda shape: True,
    ),
    Scenario(
        name="corrupt",
        summary="a byte of one copy of the newest snapshot flips, then a restore reads it",
        phases=("step",),
        build=builders.corrupt,
        applies=lambda shape: True,
    ),
    Scenario(
        name="kill_after_restore",
        summary="a second slice dies as the first pass after a restore starts",
        phases=("after_restore",),
        build=builders.after("after_restore"),
        applies=builders.two_down,
    ),
    Scenario(
        name="kill_after_reshard",
        summary="a slice dies as the first pass after a shrink of the live state starts",
        phases=("after_reshard",),
        build=builders.after("after_reshard"),
        applies=builders.two_down,
    ),
    Scenario(
        name="kill_after_grow",
        summary="a slice dies as the first pass after a grow starts",
        phases=("after_grow",),
        build=builders.after("after_grow"),
    ),
    Scenario(
        name="hang",
        summary="a step never completes (a hung collective) until the step watchdog aborts it; "
        "every slice healthy, or one wedged",
        phases=("step",),
        build=builders.hang,
        applies=lambda shape: True,
        since=2,
        multi=True,
    ),
    Scenario(
        name="kill_during_restore",
        summary="a second slice dies while a restore's transfers are in flight",
        phases=("restore",),
        build=builders.during("restore"),
        applies=builders.two_down,
        since=3,
    ),
    Scenario(
        name="kill_during_reshard",
        summary="a slice dies while the live state moves onto fewer slices",
        phases=("reshard",),
        build=builders.during("reshard"),
        applies=builders.two_down,
        since=3,
    ),
    Scenario(
        name="kill_during_grow",
        summary="a slice dies while the live state moves back onto more slices",
        phases=("grow",),
        build=builders.during("grow"),
        since=3,
    ),
    Scenario(
        name="supervisor_restart",
        summary="the supervisor is killed and restarted; then a slice dies",
        phases=("step",),
        build=builders.supervisor_restart,
        since=3,
        multi=True,
    ),
    Scenario(
        name="supervisor_lost",
        summary="the supervisor dies for good, then a slice: the job must end with "
        "SupervisorLostError within its bound",
        phases=("step",),
        build=builders.supervisor_lost,
        applies=lambda shape: True,
        since=3,
    ),
)
MULTI_ONLY: tuple[Scenario, ...] = (
    Scenario(
        name="kill_in_collective",
        summary="a worker process is SIGKILLed inside a step, its collectives in flight",
        phases=("mid_step",),
        build=builders.kill_in_collective,
        applies=lambda shape: shape.multi and shape.spare >= 1,
        since=4,
        multi=True,
    ),
    Scenario(
        name="kill_while_forming",
        summary="a worker dies, then a second while the group re-forms",
        phases=("forming",),
        build=builders.kill_in_reformation("forming"),
        applies=builders.multi_two_down,
        since=4,
        multi=True,
    ),
    Scenario(
        name="kill_while_restoring",
        summary="a worker dies, then a second while the re-formed group restores",
        phases=("restore",),
        build=builders.kill_in_reformation("restore"),
        applies=builders.multi_two_down,
        since=4,
        multi=True,
    ),
    Scenario(
        name="kill_with_buddy",
        summary="a worker and the holder of its buddy copy die in the same step",
        phases=("step",),
        build=builders.kill_with_buddy,
        applies=builders.multi_two_down,
        since=4,
        multi=True,
    ),
)
NOTICES: tuple[Scenario, ...] = (
    Scenario(
        name="notice_then_kill",
        summary="a slice is given notice a few seconds ahead and killed at its deadline: the job has left it",
        phases=("step", "deadline"),
        build=builders.notice_then_kill,
        since=5,
        multi=True,
    ),
    Scenario(
        name="notice_early_death",
        summary="a slice given notice with a long deadline dies before the job could leave it",
        phases=("step", "notice"),
        build=builders.notice_early_death,
        since=5,
        multi=True,
    ),
    Scenario(
        name="notice_during_restore",
        summary="a slice dies; while the job restores, a second slice is given notice",
        phases=("after_restore", "restore"),
        build=builders.notice_during_restore,
        applies=lambda shape: shape.spare >= 2,
        since=5,
    ),
    Scenario(
        name="staggered_notices",
        summary="two slices are given notice one or two steps apart",
        phases=("step",),
        build=builders.staggered_notices,
        applies=lambda shape: shape.spare >= 2,
        since=5,
        multi=True,
    ),
    Scenario(
        name="notice_short_deadline",
        summary="a notice whose deadline is shorter than a step, the slice killed at it",
        phases=("step", "deadline"),
        build=builders.notice_short_deadline,
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
