"""The invariant checker: a clean run passes every promise; each broken promise fails with its evidence."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from elastic.chaos.invariants import RunRecord, check

N = 20


def state(w: float = 1.0) -> dict[str, np.ndarray]:
    return {"['params']['w']": np.full((4, 2), w, np.float32), "['step']": np.array(N, np.int32)}


def record(**overrides) -> RunRecord:
    """A run of N steps, snapshot every 5, that lost slice 1 at step 13 and restored from the snapshot at 10."""
    base = dict(
        num_steps=N,
        snapshot_every=5,
        keeper_every=1,
        steps=tuple(range(N)),
        batches=tuple(range(N)),
        executed=tuple(range(13)) + tuple(range(10, N)),
        recomputed=3,
        restores=({"step": 10, "tier": "memory", "generation": 2},),
        slices_initial=4,
        min_slices_seen=3,
        state=state(),
        latest_snapshot_step=N,
        snapshots_dropped=0,
        seconds=4.0,
        bound_s=60.0,
    )
    base.update(overrides)
    return RunRecord(**base)


REFERENCE = RunRecord(
    num_steps=N,
    snapshot_every=5,
    steps=tuple(range(N)),
    batches=tuple(range(N)),
    executed=tuple(range(N)),
    slices_initial=4,
    min_slices_seen=4,
    state=state(),
    latest_snapshot_step=N,
    snapshots_dropped=0,
    seconds=3.0,
    bound_s=60.0,
)


def failed(run: RunRecord, reference: RunRecord | None = REFERENCE) -> dict[str, str]:
    return {p.promise: p.detail for p in check(run, reference).failed}


def test_a_clean_run_keeps_every_promise():
    verdict = check(record(), REFERENCE)
    assert verdict.ok, verdict.failed
    assert {p.promise for p in verdict.promises} == {
        "equivalence",
        "exactly_once",
        "bounded_loss",
        "no_hang",
        "outcome",
        "nothing_lost",
        "notices_recompute_nothing",
    }
    assert verdict["notices_recompute_nothing"].status == "n/a"  # no notice given
    assert verdict["bounded_loss"].evidence["rollbacks"] == [
        {"from": 13, "to": 10, "lost": 3, "tier": "memory", "bound": 5}
    ]
    assert check(REFERENCE).ok


def test_a_duplicated_step_breaks_exactly_once():
    steps = tuple(range(12)) + (11,) + tuple(range(12, N))
    problems = failed(record(steps=steps, batches=steps))
    assert "exactly_once" in problems and "more than once" in problems["exactly_once"]
    assert check(record(steps=steps, batches=steps), REFERENCE)["exactly_once"].evidence["repeats"] == [11]


def test_a_skipped_step_breaks_exactly_once():
    steps = tuple(s for s in range(N) if s != 7)
    problems = failed(record(steps=steps, batches=steps))
    assert "never committed: [7]" in problems["exactly_once"]


def test_a_batch_consumed_twice_breaks_exactly_once():
    batches = tuple(range(10)) + (9,) + tuple(range(11, N))  # step 10 ate step 9's batch again
    assert "batches consumed differ" in failed(record(batches=batches))["exactly_once"]


def test_a_give_up_needs_only_a_clean_prefix():
    run = record(
        outcome="gave_up",
        expect="give_up",
        steps=tuple(range(8)),
        batches=tuple(range(8)),
        executed=tuple(range(8)),
        recomputed=0,
        restores=(),
        state=None,
        latest_snapshot_step=5,
    )
    assert check(run, REFERENCE).ok
    assert check(run, REFERENCE)["equivalence"].status == "n/a"


def test_state_differing_from_the_reference_breaks_equivalence():
    assert check(record(state=state(1.0 + 1e-7)), REFERENCE).ok  # device count changed: within 1e-5
    assert "max abs diff" in failed(record(state=state(1.001)))["equivalence"]
    # Same device count all along: bit for bit, so one ulp is a difference.
    same_mesh = record(min_slices_seen=4, state=state(np.nextafter(np.float32(1), np.float32(2))))
    assert "bit for bit" in failed(same_mesh)["equivalence"]
    missing = record(state={"['params']['w']": state()["['params']['w']"]})
    assert "leaves differ" in failed(missing)["equivalence"]


def test_a_rollback_past_the_snapshot_interval_breaks_bounded_loss():
    run = record(executed=tuple(range(17)) + tuple(range(10, N)), recomputed=7)
    assert "redid 7 steps, more than 5" in failed(run)["bounded_loss"]
    keeper = record(
        executed=tuple(range(17)) + tuple(range(10, N)),
        recomputed=7,
        restores=({"step": 10, "tier": "keeper", "generation": 2},),
    )
    assert check(keeper, REFERENCE).ok  # every snapshot in the keepers, one push in flight: 10 steps at most


def test_recomputed_steps_must_match_the_ledger():
    assert "differ from the steps the ledger counts" in failed(record(recomputed=0))["bounded_loss"]


@pytest.mark.parametrize(
    "overrides, text",
    [
        ({"outcome": "hang"}, "did not end within 60 s"),
        ({"seconds": 75.0}, "past its bound of 60 s"),
    ],
)
def test_a_run_past_its_bound_is_a_hang(overrides, text):
    assert text in failed(record(**overrides))["no_hang"]


@pytest.mark.parametrize(
    "overrides, text",
    [
        ({"expect": "give_up"}, "expected the run to give up, it finished"),
        (
            {"outcome": "error", "error": "ElasticError: no tier can restore", "state": None},
            "expected the run to finish, it ended in an error: ElasticError: no tier can restore",
        ),
        ({"outcome": "crashed", "error": "KeyError: 'w'", "state": None}, "it crashed: KeyError"),
        ({"expect": "supervisor_lost"}, "expected the run to end with SupervisorLostError, it finished"),
        (
            {"expect": "supervisor_lost", "outcome": "gave_up", "state": None},
            "expected the run to end with SupervisorLostError, it gave up",
        ),
        (
            {"outcome": "supervisor_lost", "state": None},
            "expected the run to finish, it ended with SupervisorLostError",
        ),
    ],
)
def test_an_unexpected_ending_breaks_the_outcome(overrides, text):
    assert text in failed(record(**overrides))["outcome"]


def test_a_lost_or_dropped_snapshot_breaks_nothing_lost():
    assert "not the last step 20" in failed(record(latest_snapshot_step=15))["nothing_lost"]
    assert "dropped without being counted" in failed(record(snapshots_dropped=1))["nothing_lost"]
    gave_up = record(
        outcome="gave_up",
        expect="give_up",
        state=None,
        executed=tuple(range(17)),
        recomputed=0,
        restores=(),
        steps=tuple(range(17)),
        batches=tuple(range(17)),
        latest_snapshot_step=5,
    )
    assert "older than" in failed(gave_up)["nothing_lost"]  # 17 steps reached: the snapshot at 10 must remain
    assert check(replace(gave_up, latest_snapshot_step=10), REFERENCE).ok


def test_a_give_up_before_the_second_boundary_may_hold_no_snapshot():
    """Every slice died at step 2 (snapshots every 5): the first snapshot's copy may still have been in flight,
    so none need remain; from the second boundary on, the one before it must."""
    early = record(
        outcome="gave_up",
        expect="give_up",
        state=None,
        executed=(0, 1),
        recomputed=0,
        restores=(),
        steps=(0, 1),
        batches=(0, 1),
        latest_snapshot_step=None,
    )
    assert check(early, REFERENCE).ok
    later = replace(early, executed=tuple(range(6)), steps=tuple(range(6)), batches=tuple(range(6)))
    assert "no snapshot at the end" in failed(later)["nothing_lost"]  # 6 steps reached: the snapshot at 0 must remain
    assert "no snapshot at the end" in failed(replace(early, outcome="finished", expect="finish"))["nothing_lost"]


def notice(reason: str = "chaos notice 0: slice 2 at step 6", seconds: float = 5.0, **overrides) -> dict:
    """A notice the chaos runner gave at wall clock 1000.0 (``killed_at``: when it killed the slice, or None)."""
    given = {"reason": reason, "slices": [2], "seconds": seconds, "step": 6, "at": 1000.0, "deadline": 1000.0 + seconds}
    return given | {"refused": None, "could_leave": True, "killed_at": None} | overrides


def detail(reason: str = "chaos notice 0: slice 2 at step 6", recomputed: int = 0, planned: bool = True) -> dict:
    """What the report's notice_details says of it."""
    said = {"source": "api", "reason": reason, "slices": [2], "lead_s": 5.0, "steps_recomputed": recomputed}
    return said | {"planned": planned, "running_on_rest_s": 0.4, "epoch": 3}


LEFT = dict(executed=tuple(range(N)), recomputed=0, restores=(), min_slices_seen=3)  # left at a boundary, no rollback


def test_a_notice_with_room_whose_slice_lived_to_its_deadline_recomputes_nothing():
    kept = record(**LEFT, notices=(notice(killed_at=1005.2),), notice_details=(detail(),))  # killed at the deadline
    verdict = check(kept, REFERENCE)
    assert verdict.ok, verdict.failed
    assert verdict["notices_recompute_nothing"].status == "pass"
    assert verdict["notices_recompute_nothing"].evidence["judged"][0]["steps_recomputed"] == 0
    broken = record(notices=(notice(),), notice_details=(detail(recomputed=3, planned=False),))  # the failure path
    assert "cost 3 recomputed step(s)" in failed(broken)["notices_recompute_nothing"]
    late = record(notices=(notice(killed_at=1005.0),), notice_details=(detail(recomputed=3),))
    assert "notices_recompute_nothing" in failed(late)  # killed at the deadline exactly: not before it


@pytest.mark.parametrize(
    ("given", "why"),
    [
        (notice(killed_at=1000.1), "killed 4.90 s before the deadline"),  # it died before the job could leave
        (notice(seconds=0.05), "under 2.0 s"),  # a deadline shorter than a step
        (notice(refused="notice refused: its deadline passed 0.0s ago"), "refused"),
        (notice(reason="chaos notice 1: slice 2 at step 38"), "not acted on"),  # no detail: the run ended first
        (notice(reason="chaos notice 1", could_leave=False, killed_at=1005.1), "not acted on"),  # kept: min_slices
        (notice(reason="chaos notice 1", could_leave=None, killed_at=1005.1), "not acted on"),  # not known
    ],
)
def test_a_notice_without_room_is_listed_not_judged(given, why):
    run = record(notices=(given,), notice_details=(detail(recomputed=3, planned=False),))
    result = check(run, REFERENCE)["notices_recompute_nothing"]
    assert result.status == "n/a" and why in result.evidence["skipped"][0]["why"], result


def test_notices_judged_apart_one_with_room_one_killed_early():
    run = record(
        notices=(notice(), notice(reason="chaos notice 1: slice 3 at step 7", killed_at=1000.2)),
        notice_details=(detail(), detail(reason="chaos notice 1: slice 3 at step 7", recomputed=3, planned=False)),
    )
    result = check(run, REFERENCE)["notices_recompute_nothing"]
    assert result.status == "pass" and len(result.evidence["judged"]) == 1 and len(result.evidence["skipped"]) == 1


def test_a_notice_the_job_ignored_breaks_the_promise_once_its_slice_is_killed_at_the_deadline():
    """The job could spare the slice, was told 5 s ahead, and still ran on it when it was killed: no detail at all
    (the failure path took the slice), which only this promise sees: the ledger and the snapshots are whole."""
    ignored = record(notices=(notice(killed_at=1005.1),), notice_details=())
    assert "the notice was ignored" in failed(ignored)["notices_recompute_nothing"]
    assert set(failed(ignored)) == {"notices_recompute_nothing"}
