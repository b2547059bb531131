"""The catalogue's scenario builders: each draws its faults (seeded steps and slices) for a job of a given shape
and says what the job should do; and the predicates of the scenarios that need a spare slice or two."""

from __future__ import annotations

import random
from dataclasses import replace

from elastic.chaos.schedule import Build, ChaosFault, Expect, JobShape, Phase

__all__ = [
    "after",
    "corrupt",
    "during",
    "every_slice",
    "flapping",
    "hang",
    "kill",
    "kill_in_collective",
    "kill_in_reformation",
    "kill_revive",
    "kill_with_buddy",
    "multi_two_down",
    "notice_during_restore",
    "notice_early_death",
    "notice_short_deadline",
    "notice_then_kill",
    "silence",
    "staggered_notices",
    "straggler",
    "supervisor_lost",
    "supervisor_restart",
    "transient",
    "two_at_once",
    "two_down",
]


def _early(rng: random.Random, shape: JobShape) -> int:
    """A step in the first half of the run (room left to recover, grow and finish)."""
    return rng.randint(1, max(1, shape.num_steps // 2 - 1))


def _later(rng: random.Random, shape: JobShape, after: int, *, gap: int = 3) -> int:
    return min(after + rng.randint(gap, gap + 4), shape.num_steps - 2)


def kill(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    phase: Phase = "step" if shape.multi else rng.choice(["step", "mid_step", "snapshot"])
    step = _early(rng, shape)
    if phase == "snapshot":  # the commit of this step asks for the snapshot of the next
        step = max(shape.snapshot_every - 1, step - step % shape.snapshot_every - 1)
    return [ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=step, phase=phase)], "finish"


def kill_revive(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return [
        ChaosFault(kind="kill", slice=s, at_step=step),
        ChaosFault(kind="revive", slice=s, at_step=_later(rng, shape, step)),
    ], "finish"


def two_at_once(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    pair, step = rng.sample(range(shape.num_slices), 2), _early(rng, shape)
    return [ChaosFault(kind="kill", slice=s, at_step=step) for s in pair], "finish"


def every_slice(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Every slice dies: the job gives up within its bound; unless new processes replace the killed ones
    (multi-process mode, ``replace_lost``): then it waits for them and finishes from the keepers."""
    step = _early(rng, shape)
    expect: Expect = "finish" if shape.replaces else "give_up"
    return [ChaosFault(kind="kill", slice=s, at_step=step) for s in range(shape.num_slices)], expect


def flapping(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    s, step, faults = rng.randrange(shape.num_slices), rng.randint(1, 3), []
    for kind in ("kill", "revive", "kill", "revive"):
        faults.append(ChaosFault(kind=kind, slice=s, at_step=step))
        step = _later(rng, shape, step, gap=2)
    return faults, "finish"


def silence(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    faults = [ChaosFault(kind="silence", slice=s, at_step=step)]
    if rng.random() < 0.5:
        faults.append(ChaosFault(kind="revive", slice=s, at_step=_later(rng, shape, step)))
    return faults, "finish"


def transient(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    phase: Phase = "step" if shape.multi else rng.choice(["step", "mid_step"])
    return [ChaosFault(kind="transient", at_step=_early(rng, shape), phase=phase)], "finish"


def hang(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
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


def straggler(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    return [
        ChaosFault(
            kind="straggler", at_step=_early(rng, shape), phase="mid_step", seconds=round(rng.uniform(0.2, 1.0), 2)
        )
    ], "finish"


def corrupt(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    return [ChaosFault(kind="corrupt", at_step=_early(rng, shape))], "finish"


def after(phase: Phase) -> Build:
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


def during(phase: Phase) -> Build:
    """The lead faults of ``after_<phase>``, then a second slice killed inside the restore or move itself."""
    lead = after(f"after_{phase}")  # type: ignore[arg-type]

    def build(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
        faults, expect = lead(rng, shape)
        return faults[:-1] + [replace(faults[-1], phase=phase)], expect

    return build


def supervisor_restart(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """The supervisor is killed and restarted by Ray; a slice dies a few steps later: the restarted supervisor
    must still see it."""
    step = _early(rng, shape)
    return [
        ChaosFault(kind="supervisor_restart", at_step=step),
        ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=_later(rng, shape, step, gap=2)),
    ], "finish"


def supervisor_lost(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """The supervisor dies for good, then a slice: no recovery can be decided, so the job must end with
    ``SupervisorLostError`` within its bound (not wait out ``recovery_timeout_s``, not train on unsupervised)."""
    step = _early(rng, shape)
    return [
        ChaosFault(kind="supervisor_lost", at_step=step),
        ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=step + 1),
    ], "supervisor_lost"


def kill_in_collective(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Multi-process: a worker SIGKILLed a moment into a step, its collectives in flight."""
    return [
        ChaosFault(kind="kill", slice=rng.randrange(shape.num_slices), at_step=_early(rng, shape), phase="mid_step")
    ], "finish"


def kill_in_reformation(phase: Phase) -> Build:
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


def kill_with_buddy(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
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


def notice_then_kill(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A notice a few seconds ahead, then the slice killed at its deadline (the scheduler takes it): the job must
    have left it before, at a step boundary, nothing recomputed."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return _noticed(s, step, round(rng.uniform(4.0, 8.0), 1), then="deadline"), "finish"


def notice_early_death(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A notice with a long deadline, then its slice dies as soon as the notice is taken, before the job reaches the
    step boundary where it would leave: the failure path, no step lost or repeated."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return _noticed(s, step, round(rng.uniform(30.0, 120.0), 1), then="notice"), "finish"


def notice_during_restore(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A slice dies; while the job restores without it (inside the restore, or the first pass after it) a second
    slice is given notice: the job leaves that one too, live, once it runs again."""
    first, second = rng.sample(range(shape.num_slices), 2)
    step = _early(rng, shape)
    phase: Phase = rng.choice(["after_restore", "restore"])
    notice = _noticed(second, step, round(rng.uniform(10.0, 30.0), 1), phase=phase)
    return [ChaosFault(kind="kill", slice=first, at_step=step), *notice], "finish"


def staggered_notices(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """Two notices for two slices, one or two steps apart (one shrink or two; never below ``min_slices``: the
    supervisor keeps a slice whose leave would go below it until the slice goes)."""
    first, second = rng.sample(range(shape.num_slices), 2)
    step = _early(rng, shape)
    return [
        *_noticed(first, step, round(rng.uniform(5.0, 30.0), 1)),
        *_noticed(second, step + rng.randint(1, 2), round(rng.uniform(5.0, 30.0), 1)),
    ], "finish"


def notice_short_deadline(rng: random.Random, shape: JobShape) -> tuple[list[ChaosFault], Expect]:
    """A notice whose deadline is shorter than a step, the slice killed at it: the failure path or a leave, whichever
    comes first; no hang, nothing lost or repeated."""
    s, step = rng.randrange(shape.num_slices), _early(rng, shape)
    return _noticed(s, step, rng.choice([0.02, 0.05, 0.1]), then="deadline"), "finish"


def multi_two_down(shape: JobShape) -> bool:
    return shape.multi and two_down(shape)


def two_down(shape: JobShape) -> bool:
    return shape.spare >= 2 and shape.survives_two
