"""The pool's pure policy: each rule as a table row, the demo's timeline, and properties over random event
sequences (hypothesis): no slice lent twice, quotas kept, priority order."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.errors import ConfigError
from elastic.pool import (
    Arrive,
    JobSpec,
    Leave,
    Plan,
    PoolState,
    Release,
    Resize,
    SliceFailed,
    SliceReturned,
    decide,
    new_state,
    targets,
)
from elastic.pool.model import event_from_dict, event_to_dict, state_from_dict, state_to_dict
from elastic.pool.policy import apply


def job(name: str, *, user: str = "u", priority: int = 0, lo: int = 1, hi: int = 1, spares: int = 0) -> Arrive:
    return Arrive(spec=JobSpec(name=name, user=user, priority=priority, min_slices=lo, max_slices=hi, spares=spares))


def run(state: PoolState, *events) -> Plan:
    plan = None
    for e in events:
        plan = decide(state, e)
        state = plan.state
    assert plan is not None
    return plan


def settle(plan: Plan) -> Plan:
    """Every reclaim notice obeyed (its job releases the slices), until none is left."""
    while plan.state.reclaiming:
        job_, slices = next(
            (j, frozenset(s for s, h in plan.state.held.items() if h == j and s in plan.state.reclaiming))
            for j in plan.state.held.values()
            if any(plan.state.held[s] == j for s in plan.state.reclaiming)
        )
        plan = decide(plan.state, Release(job=job_, slices=slices))
    return plan


def holds(plan: Plan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s, j in sorted(plan.state.held.items()):
        out.setdefault(j, []).append(s)
    return out


def test_the_demo_timeline() -> None:
    """low on 5; high (3, one spare) arrives and low shrinks to 2; a slice of high fails and one of low's is swapped
    in (low to 1); it returns and goes to low; high ends and low grows back to 5."""
    p = run(new_state(5), job("low", hi=5))
    assert holds(p) == {"low": [0, 1, 2, 3, 4]}
    p = decide(p.state, job("high", priority=10, hi=3, spares=1))
    assert p.grants == {} and [(r.job, sorted(r.slices), r.for_job) for r in p.reclaims] == [("low", [2, 3, 4], "high")]
    assert p.status["high"].state == "waiting" and "being reclaimed" in p.status["high"].reason
    p = decide(p.state, Release(job="low", slices=frozenset({2, 3, 4})))
    assert p.grants == {"high": frozenset({2, 3, 4})} and holds(p) == {"low": [0, 1], "high": [2, 3, 4]}
    p = decide(p.state, SliceFailed(slice=3))
    (swap,) = p.reclaims
    assert swap.job == "low" and swap.for_job == "high" and swap.reason.startswith("hot swap")
    p = decide(p.state, Release(job="low", slices=swap.slices))
    assert len(holds(p)["high"]) == 3 and len(holds(p)["low"]) == 1
    p = decide(p.state, SliceReturned(slice=3))
    assert p.grants == {"low": frozenset({3})}
    p = decide(p.state, Leave(job="high"))
    assert holds(p) == {"low": [0, 1, 2, 3, 4]} and p.status["low"].state == "running"


@pytest.mark.parametrize(
    ("events", "expected", "why"),
    [
        ([job("a", hi=3), job("b", hi=3)], {"a": 3, "b": 2}, "arrival order among equals: the later one gets the rest"),
        ([job("a", hi=4), job("b", priority=1, hi=4)], {"a": 1, "b": 4}, "priority: the lower one shrinks to its min"),
        ([job("a", lo=2, hi=4), job("b", priority=1, lo=4, hi=5)], {"a": 0, "b": 5}, "a higher min suspends"),
        ([job("a", priority=1, lo=5, hi=5), job("b", hi=2)], {"a": 5, "b": 0}, "a lower job waits, the pool full"),
        (
            [job("a", priority=1, lo=4, hi=4), job("x", priority=2, lo=2, hi=2), job("b", hi=3)],
            {"a": 0, "x": 2, "b": 3},
            "a higher job whose min does not fit keeps no lower one from its own",
        ),
        (
            [job("a", user="q", hi=5), job("b", user="q", hi=5)],
            {"a": 2, "b": 1},
            "the user's quota (3), minimums first",
        ),
        ([job("a", hi=2), job("b", hi=5)], {"a": 2, "b": 3}, "fill: what is left goes to the next"),
        ([job("a", hi=5), Resize(job="a", want=2), job("b", hi=5)], {"a": 2, "b": 3}, "a job asking less"),
    ],
)
def test_targets(events, expected, why) -> None:
    state = replace(new_state(5), quotas={"q": 3})
    for e in events:
        state = decide(state, e).state
    assert targets(state) == expected, why


def test_a_job_below_its_min_waits_and_says_why() -> None:
    p = run(new_state(4), job("a", priority=5, lo=3, hi=3), job("b", lo=2, hi=2))
    assert p.status["b"].state == "waiting" and "min_slices=2" in p.status["b"].reason and p.status["b"].held == 0
    p = decide(p.state, Leave(job="a"))
    assert p.grants == {"b": frozenset({0, 1})} and p.status["b"].state == "running"


def test_a_job_asking_more_than_the_pool_has_runs_on_what_there_is() -> None:
    p = run(new_state(3), job("a", hi=8))
    assert p.status["a"].held == 3 and "the pool has 3 healthy slices" in p.status["a"].reason


@pytest.mark.parametrize(
    ("event", "match"),
    [
        (job("z", lo=6, hi=6), "min_slices=6 but the pool has 5 slices"),
        (job("x", user="q", lo=4, hi=4), "quota is 3"),
        (job("b"), "in the pool already"),
        (Leave(job="nobody"), "not in the pool"),
        (Release(job="b", slices=frozenset({0})), "does not hold slice 0"),
        (SliceFailed(slice=9), "slices are 0..4"),
        (Resize(job="b", want=0), "at least 1 slice"),
    ],
)
def test_refused_events_say_what_to_fix(event, match) -> None:
    state = run(replace(new_state(5), quotas={"q": 3}), job("a"), job("b", priority=-1)).state
    with pytest.raises(ConfigError, match=match) as info:
        decide(state, event)
    assert "\n" not in str(info.value)


def test_suspended_job_resumes_when_slices_come_back() -> None:
    p = settle(run(new_state(4), job("low", lo=2, hi=4), job("big", priority=9, lo=3, hi=3)))
    assert p.status["low"].state == "suspended" and holds(p) == {"big": [0, 1, 2]}
    p = decide(p.state, Leave(job="big"))
    assert p.status["low"].state == "running" and holds(p)["low"] == [0, 1, 2, 3]


def test_without_spares_a_failed_slice_is_not_replaced_from_a_lower_job() -> None:
    p = settle(run(new_state(5), job("low", hi=5), job("high", priority=9, hi=3)))
    p = decide(p.state, SliceFailed(slice=sorted(p.state.holding("high"))[0]))
    assert p.reclaims == () and p.status["high"].held == 2 and "0 spares" in p.status["high"].reason
    p = decide(p.state, Release(job="low", slices=frozenset({sorted(p.state.holding("low"))[0]})))
    assert len(p.state.holding("high")) == 3, "a slice freed goes to it (give back by priority)"


def test_spares_bound_the_hot_swaps() -> None:
    p = settle(run(new_state(6), job("low", hi=6), job("high", priority=9, hi=3, spares=1)))
    a, b = sorted(p.state.holding("high"))[:2]
    p = settle(decide(p.state, SliceFailed(slice=a)))
    assert len(p.state.holding("high")) == 3
    p = decide(p.state, SliceFailed(slice=b))
    assert p.reclaims == () and len(p.state.holding("high")) == 2, "the second failure is beyond its one spare"


def test_a_reclaim_racing_a_failure_of_the_same_slice() -> None:
    p = run(new_state(5), job("low", hi=5), job("high", priority=9, hi=2))
    (r,) = p.reclaims
    gone = min(r.slices)
    p = decide(p.state, SliceFailed(slice=gone))
    assert gone not in p.state.reclaiming and gone not in p.state.held
    again = [x for x in p.reclaims if x.for_job == "high"]
    assert again and gone not in again[0].slices, "another slice of low's is reclaimed in its place"
    with pytest.raises(ConfigError, match="does not hold"):
        decide(p.state, Release(job="low", slices=frozenset({gone})))  # its late release of the dead slice
    p = settle(p)
    assert len(p.state.holding("high")) == 2 and len(p.state.holding("low")) == 2


def test_a_notice_no_longer_needed_is_withdrawn() -> None:
    p = run(new_state(4), job("low", hi=4), job("high", priority=9, hi=2))
    (r,) = p.reclaims
    p = decide(p.state, Leave(job="high"))
    assert p.cancels == {"low": r.slices} and not p.state.reclaiming and len(p.state.holding("low")) == 4


def test_records_round_trip() -> None:
    p = run(new_state(5), job("low", hi=5), job("high", priority=9, hi=2, spares=1), SliceFailed(slice=0))
    assert state_from_dict(state_to_dict(p.state)) == p.state
    for e in (job("x", hi=2), Release(job="a", slices=frozenset({1, 2})), SliceReturned(slice=1)):
        assert event_from_dict(event_to_dict(e)) == e
    with pytest.raises(ConfigError):
        event_from_dict({"type": "Nope"})


# -- properties --------------------------------------------------------------------------------------------------
SIZE = 6
NAMES = ["a", "b", "c", "d"]
specs = st.builds(
    lambda name, user, pri, lo, extra, spares: job(name, user=user, priority=pri, lo=lo, hi=lo + extra, spares=spares),
    st.sampled_from(NAMES),
    st.sampled_from(["u", "v"]),
    st.integers(0, 3),
    st.integers(1, 3),
    st.integers(0, 4),
    st.integers(0, 2),
)
events = st.one_of(
    specs,
    st.builds(Leave, job=st.sampled_from(NAMES)),
    st.builds(Resize, job=st.sampled_from(NAMES), want=st.integers(1, 7)),
    st.builds(SliceFailed, slice=st.integers(0, SIZE - 1)),
    st.builds(SliceReturned, slice=st.integers(0, SIZE - 1)),
    st.just("release"),  # every job obeys its notices
)


def check(plan: Plan, before: PoolState, event) -> None:
    s = plan.state
    free = set(apply(before, event)[0].free())
    for granted in plan.grants.values():
        assert granted <= free, "a grant is a free slice"
        free -= granted
    assert set(s.held).isdisjoint(s.failed), "no failed slice is lent"
    assert set(s.reclaiming) <= set(s.held), "a slice reclaimed is still its holder's"
    t = targets(s)
    assert sum(t.values()) <= s.size - len(s.failed)
    for user, quota in s.quotas.items():
        assert sum(v for n, v in t.items() if s.jobs[n].spec.user == user) <= quota, "quota"
        assert sum(1 for j in s.held.values() if s.jobs[j].spec.user == user) <= quota + sum(
            1 for x, j in s.held.items() if x in s.reclaiming and s.jobs[j].spec.user == user
        ), "a user holds more than their quota only while giving it back"
    for n, e in s.jobs.items():
        assert t[n] == 0 or e.spec.min_slices <= t[n] <= e.asked
        held = len(s.holding(n))
        assert held - sum(1 for x in s.holding(n) if x in s.reclaiming) <= t[n], "what is above target is reclaimed"
    ranked = sorted(s.jobs, key=lambda n: (-s.jobs[n].spec.priority, s.jobs[n].arrival))
    for i, hi in enumerate(ranked):
        e = s.jobs[hi]
        claim = max(e.spec.min_slices, e.asked - max(0, s.lost(hi) - e.spec.spares))
        quota = s.quotas.get(e.spec.user)
        used = sum(t[n] for n in s.jobs if s.jobs[n].spec.user == e.spec.user)
        if t[hi] and t[hi] < claim and (quota is None or used < quota):
            for lo in ranked[i + 1 :]:
                assert t[lo] <= s.jobs[lo].spec.min_slices, f"{lo} above its min while {hi} is short"


@settings(max_examples=300, deadline=None)
@given(st.lists(events, min_size=1, max_size=40), st.integers(0, SIZE))
def test_properties(sequence, quota) -> None:
    state = replace(new_state(SIZE), quotas={"u": quota})
    for e in sequence:
        if e == "release":
            pending = {}
            for s_ in state.reclaiming:
                pending.setdefault(state.held[s_], set()).add(s_)
            for j, slices in pending.items():
                plan = decide(state, Release(job=j, slices=frozenset(slices)))
                check(plan, state, Release(job=j, slices=frozenset(slices)))
                state = plan.state
            continue
        try:
            plan = decide(state, e)
        except ConfigError:
            continue
        check(plan, state, e)
        state = plan.state
    assert state_from_dict(state_to_dict(state)) == state


def test_the_pool_actor_offers_its_gated_methods_only() -> None:
    from elastic.pool.actor import Pool
    from elastic.snapshot.gated import reachable

    assert reachable(Pool) == sorted(
        ["events", "lease", "leave", "release", "resize", "slice_failed", "slice_returned", "status", "submit"]
        + ["wait_lease"]
    )


def test_replay_resumes_from_the_newest_signed_decision() -> None:
    from elastic.pool.replay import replay
    from elastic.supervision.events import sign

    p1 = run(new_state(4), job("a", hi=2))
    p2 = decide(p1.state, job("b", hi=2))

    def record(seq: int, plan: Plan, epoch: int) -> dict:
        return {"wall": 1.0 + seq, "writer": "pool", "seq": seq, "kind": "decision", "epoch": epoch,
                "state": state_to_dict(plan.state)}  # fmt: skip

    older_dropped = [sign(record(7, p1, 40), "k"), sign(record(8, p2, 41), "k")]
    forged = {**record(9, run(new_state(4), job("x", hi=4)), 42), "mac": "0" * 64}
    r = replay([forged, *reversed(older_dropped)], size=4, quotas={}, key="k")
    assert r.state == p2.state and r.version == 42 and r.decisions == 2 and r.forged == [forged]
    assert replay([], size=3, quotas={"u": 1}, key="k").state == new_state(3, {"u": 1})
