"""Chaos schedules: replayable from (seed, index), valid for elastic.Faults, covering the catalogue, and a
violation that says how to replay it."""

from __future__ import annotations

import pytest

from elastic.chaos.catalogue import CATALOGUE, JobShape, applicable, schedule, schedules
from elastic.chaos.invariants import RunRecord, check
from elastic.chaos.report import ChaosResult, ScheduleResult
from elastic.config import ElasticConfig, Policy, Tiers
from elastic.errors import ConfigError

DEMO = JobShape(num_slices=4, min_slices=2, num_steps=40, snapshot_every=5, survives_two=True)
MULTI = JobShape(
    num_slices=4, min_slices=2, num_steps=40, snapshot_every=5, survives_two=True, multi=True, replaces=True
)
SP = len(applicable(DEMO))


def test_a_schedule_replays_from_seed_and_index():
    assert schedules(7, 12, DEMO) == schedules(7, 12, DEMO)
    assert schedule(7, 5, DEMO) == schedules(7, 12, DEMO)[5]
    assert schedules(7, 12, DEMO) != schedules(8, 12, DEMO)


def test_consecutive_schedules_cover_the_catalogue():
    names = {s.scenario for s in schedules(3, SP, DEMO)}
    assert names == {s.name for s in CATALOGUE if not s.name.startswith(("kill_in_", "kill_while_", "kill_with_"))}
    multi = {s.scenario for s in schedules(3, len(applicable(MULTI)), MULTI)}
    assert {
        "kill_in_collective",
        "kill_while_forming",
        "kill_while_restoring",
        "kill_with_buddy",
        "silence",
        "kill",
        "two_at_once",
        "supervisor_restart",
    } <= multi


@pytest.mark.parametrize("seed", range(6))
def test_schedules_are_valid_faults_and_expect_a_give_up_only_below_min_slices(seed):
    for s in schedules(seed, 2 * SP, DEMO):
        s.plan().validate(num_slices=DEMO.num_slices, num_steps=DEMO.num_steps)  # raises ConfigError if not
        assert all(0 <= f.at_step < DEMO.num_steps for f in s.faults)
        down, worst = set(), 0
        for f in s.faults:
            if f.kind in ("kill", "silence") or (f.kind == "hang" and f.slice is not None):  # a wedged slice
                down.add(f.slice)
            elif f.kind == "revive":
                down.discard(f.slice)
            worst = max(worst, len(down))
        below = DEMO.num_slices - worst < DEMO.min_slices
        assert (s.expect == "give_up") == below == (s.scenario == "every_slice"), s


def test_the_job_shape_limits_the_scenarios():
    config = ElasticConfig(
        simulated=True,
        num_slices=2,
        devices_per_slice=2,
        num_steps=30,
        policy=Policy(min_slices=2),
        tiers=Tiers(keeper_every=0),
    )
    shape = JobShape.of(config)
    assert not shape.survives_two and shape.spare == 0
    drawn = schedules(1, 20, shape)
    assert {s.scenario for s in drawn} == {
        "every_slice",
        "transient",
        "straggler",
        "corrupt",
        "hang",
        "supervisor_lost",
    }
    assert all(f.slice is None for s in drawn for f in s.faults if f.kind == "hang")  # no slice to spare
    assert {s.scenario for s in schedules(1, 4, DEMO, ["kill", "silence"])} == {"kill", "silence"}
    with pytest.raises(ConfigError, match="unknown chaos scenario"):
        schedule(1, 0, DEMO, ["meteor"])
    with pytest.raises(ConfigError, match="no chaos scenario"):
        schedule(1, 0, shape, ["kill"])


def test_a_violation_names_its_schedule_and_how_to_replay_it():
    plan = schedule(7, 2, DEMO)
    twice = (0, 1, 1, 2, 3)
    bad = RunRecord(
        num_steps=4,
        snapshot_every=2,
        steps=twice,
        batches=twice,
        executed=twice,
        latest_snapshot_step=4,
        snapshots_dropped=0,
        bound_s=10.0,
    )
    ref = RunRecord(
        num_steps=4,
        snapshot_every=2,
        steps=(0, 1, 2, 3),
        batches=(0, 1, 2, 3),
        executed=(0, 1, 2, 3),
        latest_snapshot_step=4,
        snapshots_dropped=0,
        bound_s=10.0,
    )
    one = ScheduleResult(
        schedule=plan, record=bad, injected=1, verdict=check(bad, ref), replay="elastic chaos --seed 7 --index 2"
    )
    result = ChaosResult(seed=7, target="t:f", results=(one,), reference=ref, reference_verdict=check(ref))
    assert not result.ok and result.recovered == 0
    out = result.to_dict()
    (violation,) = [v for v in out["violations"] if v["promise"] == "exactly_once"]
    assert (violation["seed"], violation["index"], violation["scenario"]) == (7, 2, plan.scenario)
    assert violation["replay"] == "elastic chaos --seed 7 --index 2" and violation["evidence"]["repeats"] == [1]
    assert "exactly_once broken by" in str(result.violations[0])


def test_hang_schedules_go_through_faults_and_wedge_a_slice_only_where_one_can_be_spared():
    hangs = [s for s in schedules(4, 8 * SP, DEMO) if s.scenario == "hang"]
    assert len(hangs) == 8 and all(s.hangs and s.expect == "finish" for s in hangs)
    assert {f.slice is None for s in hangs for f in s.faults if f.kind == "hang"} == {True, False}  # both kinds
    for s in hangs:
        (hang,) = [f for f in s.faults if f.kind == "hang"]
        assert hang.phase == "step" and 1 <= hang.at_step < DEMO.num_steps // 2
        planned = s.plan().faults
        assert [(f.kind, f.slice, f.at_step) for f in planned if f.kind == "hang"] == [
            ("hang", hang.slice, hang.at_step)
        ]
        assert s.seams() == ()  # elastic.Faults carries it out (and a revive), not the runner's seams
        revives = [f for f in s.faults if f.kind == "revive"]
        assert all(hang.slice is not None and r.slice == hang.slice and r.at_step > hang.at_step for r in revives)
    assert not any(s.hangs for s in schedules(4, 8 * len(CATALOGUE), DEMO) if s.scenario != "hang")


def test_extending_the_catalogue_keeps_the_earlier_draws():
    """Scenarios added later are drawn after the first catalogue's in each round: (seed, index) with index below
    its size replays what it drew before (here: the first catalogue alone, drawn through ``scenarios``)."""
    first = [s.name for s in CATALOGUE if s.since == 1]
    assert "hang" not in first and len(first) < len(CATALOGUE)
    for seed in range(10):
        assert schedules(seed, len(first), DEMO) == [schedule(seed, i, DEMO, first) for i in range(len(first))]
        assert schedule(seed, len(first), DEMO).scenario == "hang"  # then the later ones
    # the draws other tests rely on (tests/integration/test_chaos.py: seed 8 begins with these two)
    assert [s.scenario for s in schedules(8, 2, DEMO)] == ["kill", "corrupt"]


def test_faults_inside_a_move_and_on_the_supervisor_are_drawn_as_built():
    for s in schedules(5, 4 * len(CATALOGUE), DEMO):
        phases = [f.phase for f in s.faults]
        if s.scenario.startswith("kill_during_"):
            inside = s.scenario.removeprefix("kill_during_")
            assert phases.count(inside) == 1 and s.expect == "finish", s
            (f,) = [f for f in s.faults if f.phase == inside]
            lead = [g for g in s.faults if g.phase == "step" and g.kind in ("kill", "silence")]
            assert f.kind == "kill" and f.slice not in {g.slice for g in lead}, s  # a second slice
        elif s.scenario == "supervisor_restart":
            assert [f.kind for f in s.faults] == ["supervisor_restart", "kill"] and s.expect == "finish", s
            assert s.faults[1].at_step > s.faults[0].at_step
        elif s.scenario == "supervisor_lost":
            assert [f.kind for f in s.faults] == ["supervisor_lost", "kill"] and s.expect == "supervisor_lost", s
        elif s.scenario == "notice_during_restore":  # a notice, not a kill, inside the restore (tested below)
            assert [f.kind for f in s.faults if f.phase in ("restore", "reshard", "grow")] in ([], ["notice"]), s
        else:
            assert not {"restore", "reshard", "grow"} & set(phases), s
            assert not any(f.kind.startswith("supervisor") for f in s.faults), s


def test_multi_process_schedules_place_real_process_kills_in_steps_and_re_formations():
    drawn = schedules(7, 3 * len(applicable(MULTI)), MULTI)
    for s in drawn:
        plan = s.plan()
        plan.validate(num_slices=MULTI.num_slices, num_steps=MULTI.num_steps)
        assert s.seams() == (), s  # every fault of a multi-process schedule is carried out by the workers or driver
        if s.scenario == "every_slice":
            assert s.expect == "finish", s  # replacements arrive: the job waits for them
    placed = {f.during for s in drawn for f in s.plan().faults if f.kind == "kill"}
    assert placed == {"step", "collective", "forming", "restore"}
    restart = [s for s in drawn if s.scenario == "supervisor_restart"][0]  # the driver restarts the supervisor
    assert [f.kind for f in restart.plan().faults] == ["supervisor_restart", "kill"]
    buddy = [s for s in drawn if s.scenario == "kill_with_buddy"][0]
    a, b = sorted(f.slice for f in buddy.faults)
    assert (b - a) % MULTI.num_slices in (1, MULTI.num_slices - 1)
