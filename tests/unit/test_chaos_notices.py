"""Notices in the chaos catalogue: drawn as built, replayable from (seed, index), after the earlier catalogue (its
draws unchanged), only where the job can spare the slices; and the giver that carries them out (a fake job): the
notice given from a thread, the noticed slice killed at once or not before its deadline, nothing struck after the
run's end."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from elastic.chaos.catalogue import CATALOGUE, NOTICE_PHASES, ChaosFault, JobShape, Schedule, applicable, schedules
from elastic.chaos.notices import NoticeGiver
from elastic.control.report import Timeline
from elastic.errors import NoticeError
from elastic.supervision.membership import View
from elastic.supervision.notices import make_notice

DEMO = JobShape(num_slices=4, min_slices=2, num_steps=40, snapshot_every=5, survives_two=True)
MULTI = JobShape(
    num_slices=4, min_slices=2, num_steps=40, snapshot_every=5, survives_two=True, multi=True, replaces=True
)
SPARE_ONE = JobShape(num_slices=3, min_slices=2, num_steps=30, snapshot_every=5, survives_two=False)
NOTICES = [
    "notice_then_kill",
    "notice_early_death",
    "notice_during_restore",
    "staggered_notices",
    "notice_short_deadline",
]


def drawn(shape: JobShape, seed: int, rounds: int = 6) -> list[Schedule]:
    return [s for s in schedules(seed, rounds * len(applicable(shape)), shape) if s.scenario in NOTICES]


def test_the_notice_scenarios_come_after_the_earlier_catalogue_and_leave_its_draws_as_they_were():
    assert [s.name for s in CATALOGUE if s.since == 5] == NOTICES
    assert all(s.since < 5 for s in CATALOGUE if s.name not in NOTICES)
    for shape in (DEMO, MULTI, SPARE_ONE):
        before = [s.name for s in applicable(shape) if s.name not in NOTICES]
        for seed in range(10):  # an index below the earlier catalogue's size draws what it drew before the notices
            assert schedules(seed, len(before), shape) == schedules(seed, len(before), shape, before)
            later = {s.scenario for s in schedules(seed, len(applicable(shape)), shape)[len(before) :]}
            assert later == {s.name for s in applicable(shape) if s.name in NOTICES}
    # what `elastic chaos --seed 7 --schedules 5` ran before the notices, in both modes
    assert [s.scenario for s in schedules(7, 5, DEMO)] == [
        "transient",
        "kill_after_grow",
        "kill_revive",
        "every_slice",
        "kill_after_reshard",
    ]
    assert [s.scenario for s in schedules(7, 5, MULTI)] == ["silence", "transient", "flapping", "every_slice", "kill"]


def test_a_notice_schedule_replays_from_seed_and_index():
    for seed in range(5):
        assert drawn(DEMO, seed) == drawn(DEMO, seed)
        assert schedules(seed, 10, DEMO, NOTICES) == schedules(seed, 10, DEMO, NOTICES)
    assert schedules(1, 10, DEMO, NOTICES) != schedules(2, 10, DEMO, NOTICES)


def test_the_notice_scenarios_are_drawn_only_where_the_job_can_spare_the_slices():
    assert {s.name for s in applicable(DEMO, NOTICES)} == set(NOTICES)
    assert {s.name for s in applicable(MULTI, NOTICES)} == set(NOTICES) - {"notice_during_restore"}  # no such seam
    assert {s.name for s in applicable(SPARE_ONE, NOTICES)} == {
        "notice_then_kill",
        "notice_early_death",
        "notice_short_deadline",
    }
    nothing_spare = JobShape(num_slices=2, min_slices=2, num_steps=30, snapshot_every=5, survives_two=False)
    assert not {s.scenario for s in schedules(3, 30, nothing_spare)} & set(NOTICES)


@pytest.mark.parametrize("shape", [DEMO, MULTI], ids=["single", "multi"])
@pytest.mark.parametrize("seed", range(4))
def test_each_notice_scenario_is_drawn_as_built(shape, seed):
    runs = drawn(shape, seed)
    assert {s.scenario for s in runs} == {s.name for s in applicable(shape, NOTICES)}
    for s in runs:
        notices = [f for f in s.faults if f.kind == "notice"]
        kills = [f for f in s.faults if f.kind == "kill"]
        assert s.expect == "finish" and all(f.slice is not None and f.seconds for f in notices), s
        assert all(0 < f.at_step < shape.num_steps - 2 for f in s.faults), s
        assert s.notices() == tuple(f for f in s.faults if f.kind == "notice" or f.phase in NOTICE_PHASES)
        assert not set(s.notices()) & set(s.seams()), s  # the notices' giver carries them out, not the seams
        assert not [f for f in s.plan().faults if f.at_step == notices[0].at_step and f.slice == notices[0].slice]
        (n, *rest) = notices
        if s.scenario == "notice_then_kill":
            assert 4.0 <= n.seconds <= 8.0 and n.phase == "step" and not rest, s  # room for a step boundary
            assert kills == [ChaosFault(kind="kill", slice=n.slice, at_step=n.at_step, phase="deadline")], s
        elif s.scenario == "notice_early_death":
            assert n.seconds >= 30.0 and not rest, s
            assert kills == [ChaosFault(kind="kill", slice=n.slice, at_step=n.at_step, phase="notice")], s
        elif s.scenario == "notice_short_deadline":
            assert n.seconds < 0.2 and kills == [replace_phase(n, "deadline")], s  # shorter than a step
        elif s.scenario == "staggered_notices":
            (m,) = rest
            assert n.slice != m.slice and 1 <= m.at_step - n.at_step <= 2 and not kills, s
            assert shape.num_slices - 2 >= shape.min_slices
        else:
            assert s.scenario == "notice_during_restore" and not shape.multi
            (kill,) = kills
            assert kill.phase == "step" and kill.slice != n.slice and kill.at_step == n.at_step, s
            assert n.phase in ("after_restore", "restore") and n.seconds >= 10.0 and not rest, s
            assert s.plan().faults[0].kind == "kill"  # the lead kill goes through elastic.Faults


def test_both_restore_phases_are_drawn_for_a_notice_during_restore():
    phases = {f.phase for seed in range(6) for s in drawn(DEMO, seed) for f in s.faults if f.kind == "notice"}
    assert {"after_restore", "restore", "step"} <= phases


def replace_phase(notice: ChaosFault, phase: str) -> ChaosFault:
    return ChaosFault(kind="kill", slice=notice.slice, at_step=notice.at_step, phase=phase)  # type: ignore[arg-type]


# -- the giver, on a fake job -----------------------------------------------------------------------------------
@dataclass
class FakeJob:
    """What the giver uses of ElasticJob: ``notice`` (refused for a slice in ``refuse``), ``timeline``, ``config``."""

    refuse: set[int] = field(default_factory=set)
    given: list[tuple[int, float, str, str]] = field(default_factory=list)
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def config(self) -> Any:
        return SimpleNamespace(job_name="fake", num_steps=12, policy=SimpleNamespace(min_slices=2))

    def notice(self, slices: int, deadline_s: float, reason: str) -> Any:
        self.given.append((slices, deadline_s, reason, threading.current_thread().name))
        if slices in self.refuse:
            raise NoticeError("notice refused: the job does not hold slice(s) 1")
        return make_notice(slices, deadline_s, reason)


def plan(*faults: ChaosFault) -> Schedule:
    return Schedule(seed=0, index=0, scenario="test", faults=faults, expect="finish")


def giver(job: FakeJob, schedule: Schedule, view: Any = None) -> tuple[NoticeGiver, list[tuple[int, float]]]:
    struck: list[tuple[int, float]] = []

    def aim(s: int, step: int) -> Any:
        return lambda: struck.append((s, time.time()))

    return NoticeGiver(schedule, job, aim, view), struck  # type: ignore[arg-type]


def test_the_giver_notices_from_a_thread_and_kills_not_before_the_deadline():
    notice = ChaosFault(kind="notice", slice=2, at_step=3, seconds=0.3)
    job = FakeJob()
    g, struck = giver(job, plan(notice, replace_phase(notice, "deadline")))
    g.give(notice, 3, wait=True)
    g.give(notice, 3, wait=True)  # once only
    assert len(job.given) == 1 and job.given[0][:2] == (2, 0.3) and job.given[0][3] == "chaos-notice"
    assert struck == []  # not yet: the deadline is 0.3 s away
    (record,) = g.given
    assert record["reason"] == job.given[0][2] and record["refused"] is None
    g.hold()  # the run's last step waits for it (single-process mode)
    assert [s for s, _ in struck] == [2] and struck[0][1] >= record["deadline"]
    assert record["killed_at"] >= record["deadline"]
    g.close()
    assert [e["event"] for e in job.timeline.events] == ["inject_notice"]  # the aim's kill adds its own


def test_the_giver_kills_at_once_after_the_notice_and_a_refused_notice_still_loses_its_slice():
    early = ChaosFault(kind="notice", slice=1, at_step=5, seconds=60.0)
    job = FakeJob(refuse={1})
    g, struck = giver(job, plan(early, replace_phase(early, "notice")))
    g.give(early, 5, wait=True)
    (record,) = g.given
    assert [s for s, _ in struck] == [1] and record["killed_at"] < record["deadline"]  # waited for by give
    assert "does not hold" in record["refused"]


def test_the_giver_gives_multi_process_notices_as_the_group_commits_their_step_and_closing_cancels_kills():
    a = ChaosFault(kind="notice", slice=0, at_step=4, seconds=0.4)
    b = ChaosFault(kind="notice", slice=3, at_step=6, seconds=0.4)
    job = FakeJob()
    g, struck = giver(job, plan(a, replace_phase(a, "deadline"), b))
    g.reached(3)
    assert job.given == []
    g.reached(5)  # past a's step, not b's
    g.reached(7)
    deadline = time.monotonic() + 10
    while len(job.given) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(s for s, *_ in job.given) == [0, 3]
    g.close()  # the run ended before a's deadline: its kill never strikes
    time.sleep(0.6)
    assert struck == [] and all(r["killed_at"] is None for r in g.given)
    g.reached(9)
    assert len(job.given) == 2


def test_the_drivers_last_commit_waits_for_a_kill_due_at_a_deadline():
    a = ChaosFault(kind="notice", slice=1, at_step=2, seconds=0.3)
    g, struck = giver(FakeJob(), plan(a, replace_phase(a, "deadline")))
    g.give(a, 2, wait=True)  # as reached(2) does, then waited for: its deadline's kill is set
    g.reached(10)
    assert struck == []  # not the last step (num_steps=12)
    g.reached(11)  # the last: held until the kill struck
    assert [s for s, _ in struck] == [1] and g.given[0]["killed_at"] >= g.given[0]["deadline"]
    g.close()


@pytest.mark.parametrize(
    ("view", "could_leave"),
    [
        (View(epoch=2, active=frozenset({0, 1, 3}), leaving=frozenset({2})), True),  # the supervisor let it leave
        (View(epoch=1, active=frozenset({1, 2})), False),  # kept: leaving would go below min_slices=2
        (View(epoch=1, active=frozenset({0, 1, 2, 3})), True),  # not marked leaving although it could be spared
    ],
)
def test_the_giver_records_whether_the_job_could_spare_the_slice(view, could_leave):
    notice = ChaosFault(kind="notice", slice=2, at_step=3, seconds=10.0)
    g, _ = giver(FakeJob(), plan(notice), view=lambda: view)
    g.give(notice, 3, wait=True)
    assert g.given[0]["could_leave"] is could_leave
    g.close()
