"""A restarted supervisor's state from its records: ``replay`` over plain record lists, no actor, no Ray."""

from __future__ import annotations

import random
from typing import Any

import pytest

from elastic.config import Policy
from elastic.supervision.events import sign
from elastic.supervision.membership import View
from elastic.supervision.registry import AGENT_DIED, CLIENT_REPORT
from elastic.supervision.replay import replay

KEY = "stream-key"
POLICY = Policy(min_slices=2, max_slice_failures=2)


class Log:
    """Records as the supervisor writes them: its writer, one ``seq`` and one wall second after another."""

    def __init__(self, key: str | None = KEY) -> None:
        self.key, self.records = key, []

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        seq = len(self.records)
        record = {"wall": 100.0 + seq, "writer": "supervisor", "seq": seq, "kind": kind, "epoch": 0, **fields}
        record = sign(record, self.key) if self.key is not None else record
        self.records.append(record)
        return record

    def health(self, s: int, healthy: bool, incarnation: int | None = 0, cause: str = "agent registered") -> None:
        self("health", slice=s, healthy=healthy, cause=cause, incarnation=incarnation)

    def view(self, epoch: int, *active: int, gave_up: str | None = None, leaving: tuple[int, ...] = ()) -> None:
        self("view", epoch=epoch, active=sorted(active), gave_up=gave_up, reason="r", leaving=list(leaving))


def history() -> Log:
    """Four slices join; slice 3's agent dies; slice 2 fails twice in the client (quarantined); slice 1 gets a
    notice; a few records of kinds replay does not fold."""
    log = Log()
    for s in range(4):
        log.health(s, True)
    log.view(1, 0, 1, 2, 3)
    log("refused", slice=3, incarnation=0, cause=AGENT_DIED)
    log.health(3, False, cause="agent died: RayActorError")
    log("refused", slice=2, incarnation=0, cause="its slice failed in the client")
    log.health(2, False, cause=f"{CLIENT_REPORT}boom")
    log.view(2, 0, 1)
    log.health(2, True, incarnation=1)
    log.health(2, False, incarnation=1, cause=f"{CLIENT_REPORT}boom again")
    log("wait", reason="waiting")
    log("late", slice=0, silent_s=2.0)
    log("notice", slices=[1], deadline=500.0, reason="maintenance", source="api", at=110.0, agents=[[1, 0]])
    log.view(3, 0, leaving=(1,))
    return log


def test_nothing_recorded_is_a_fresh_start() -> None:
    state = replay([], policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    assert state.view == View() and state.records == [] and state.forged == []
    assert not state.tally.healthy and state.registry.count() == 0


def test_a_history_rebuilds_the_view_the_tally_and_the_agents() -> None:
    log = history()
    state = replay(log.records, policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    assert (state.view.epoch, state.view.active, state.view.leaving) == (3, frozenset({0}), frozenset({1}))
    assert state.tally.healthy == {0, 1} and state.tally.quarantined == {2}
    agents = state.registry
    assert agents.respawnable(state.tally.quarantined, wall=200.0) == {3: 0}  # died; 2 failed in the client
    assert agents.refused(3, 0) and agents.refused(2, 0) and agents.refusals == 2
    assert agents.newest(2) == 1 and not agents.admits(2, 0)
    assert agents.leaving == frozenset({1}) and agents.notices == 1 and agents.notice_of(1).deadline == 500.0
    assert agents.holds(0) and agents.holds(1) and agents.agent(0) is None  # healthy: unknown until they register
    assert agents.last_beat(0, -1.0) == 1000.0 and not agents.holds(3)
    assert state.records == log.records and state.forged == []
    assert state.summary() == {"epoch": 3, "active": [0], "quarantined": [2], "refused": 2}


def test_a_health_event_is_placed_on_the_monotonic_clock_by_its_age() -> None:
    log = Log()
    log.health(0, True)
    log.health(1, True)  # wall 101
    log.health(1, False)  # wall 102: below min_slices since then
    state = replay(log.records, policy=POLICY, wall=110.0, now=1000.0, key=KEY)
    assert state.tally.below_min_since == pytest.approx(1000.0 - 8.0)


def test_forged_records_are_set_apart_and_not_replayed() -> None:
    log = history()
    forger = Log(key="someone-elses-key")
    forged = forger("view", epoch=99, active=[], gave_up="forged", reason="forged", leaving=[])
    unsigned = {**forged, "seq": 50, "mac": None}
    records = [*log.records, forged, unsigned]
    state = replay(records, policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    assert state.view.epoch == 3 and state.view.gave_up is None
    assert [r["seq"] for r in state.forged] == [0, 50] and state.records == log.records


def test_without_a_key_every_record_counts() -> None:
    log = Log(key=None)
    log.health(0, True)
    log.view(1, 0)
    state = replay(log.records, policy=POLICY, wall=200.0, now=1000.0)
    assert state.view.active == frozenset({0}) and state.forged == []


def test_records_of_kinds_it_does_not_fold_are_skipped() -> None:
    log = Log()
    log.health(0, True)
    log("made_up", slice=0, healthy=False)
    log("closed")
    log("inject", fault="kill", slice=0, incarnation=0)
    state = replay(log.records, policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    assert state.tally.healthy == {0} and state.view == View() and len(state.records) == 4


@pytest.mark.parametrize("seed", range(5))
def test_records_in_any_order_replay_as_in_the_streams_order(seed: int) -> None:
    log = history()
    shuffled = list(log.records)
    random.Random(seed).shuffle(shuffled)
    ordered = replay(log.records, policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    state = replay(shuffled, policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    assert state.records == log.records
    assert (state.view, state.summary()) == (ordered.view, ordered.summary())
    assert state.registry.leaving == ordered.registry.leaving


def test_a_slice_leaving_under_an_agent_older_than_its_newest_is_back() -> None:
    log = Log()
    log.health(0, True)
    log("notice", slices=[0], deadline=500.0, reason="maintenance", source="api", at=100.0, agents=[[0, 0]])
    log.health(0, True, incarnation=1)  # a new agent: the slice went and came back
    state = replay(log.records, policy=POLICY, wall=200.0, now=1000.0, key=KEY)
    assert state.registry.leaving == frozenset() and state.registry.notices == 1
