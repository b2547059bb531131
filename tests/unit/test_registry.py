"""The supervisor's agent registry: plain calls, the clock passed in, no Ray and no event loop."""

from __future__ import annotations

import pytest

from elastic.errors import SupervisorError
from elastic.supervision.notices import Notice
from elastic.supervision.registry import AgentRegistry


def registered(*pairs: tuple[int, int], now: float = 0.0) -> AgentRegistry:
    agents = AgentRegistry()
    for s, incarnation in pairs:
        agents.register(s, incarnation, f"handle-{s}-{incarnation}", now)
    return agents


def notice(*slices: int, deadline: float = 100.0) -> Notice:
    return Notice(slices=frozenset(slices), deadline=deadline, reason="maintenance", source="api", at=0.0)


def test_a_registered_agent_beats_and_an_unknown_one_must_register() -> None:
    agents = registered((0, 0), (1, 0))
    assert agents.beat(0, 0, 5.0) and agents.last_beat(0, -1.0) == 5.0
    assert not agents.beat(1, 1, 5.0)  # another incarnation than the registered one
    assert not agents.beat(2, 0, 5.0)  # a slice nobody registered
    assert (agents.count(), agents.agent(1), agents.handle(1)) == (2, 0, "handle-1-0")
    agents.drop(1)
    assert not agents.holds(1) and agents.agent(1) is None and not agents.beat(1, 0, 6.0)


def test_an_older_or_refused_agent_is_not_admitted() -> None:
    agents = registered((0, 2))
    assert agents.admits(0, 2) and agents.admits(0, 3) and not agents.admits(0, 1)
    assert agents.admits(5, 0)  # a slice never seen
    assert agents.refuse(0, 2) and not agents.refuse(0, 2)  # the second time: already refused
    assert not agents.admits(0, 2) and agents.refused(0, 2) and agents.refusals == 1


def test_watch_returns_only_the_pairs_not_watched_yet() -> None:
    agents = AgentRegistry()
    assert agents.watch([(0, 0), (1, 0)]) == [(0, 0), (1, 0)]
    assert agents.watch([(0, 0), (2, 0)]) == [(2, 0)]  # an agent back from a lapse is watched already
    agents.unwatch([(0, 0)])
    assert agents.watch([(0, 0)]) == [(0, 0)]


def test_an_overdue_slice_is_asked_once_and_a_late_answer_restarts_its_silence() -> None:
    agents = registered((0, 0), (1, 0), now=0.0)
    agents.beat(1, 0, 9.0)
    assert agents.overdue(10.0, 5.0) == [(0, 0)]
    assert agents.overdue(11.0, 5.0) == []  # being asked already
    agents.asked(0)
    agents.late(0, 12.0)
    assert agents.late_beats == 1 and agents.overdue(13.0, 5.0) == []
    agents.stalled(100.0)  # the supervisor did not run: nobody's silence grew
    assert agents.overdue(110.0, 5.0) == []
    agents.lapsed(1)
    assert agents.silent_drops == 1 and not agents.holds(1)
    assert agents.overdue(1000.0, 5.0) == [(0, 0)]  # a dropped slice is not judged by its beats


def test_a_replacement_is_expected_until_it_registers_is_refused_or_is_late() -> None:
    agents = registered((0, 0), (1, 0), (2, 0))
    agents.expect(0, 1, until=10.0)
    agents.expect(1, 1, until=10.0)
    agents.expect(2, 1, until=3.0)
    assert agents.arriving(5.0) == frozenset({0, 1})  # slice 2's replacement is late
    agents.register(0, 1, "new", 6.0)  # here
    agents.refuse(1, 1)  # died before registering
    assert agents.arriving(6.0) == frozenset()


def test_an_older_expectation_than_the_newest_agent_is_ignored() -> None:
    agents = registered((0, 3))
    agents.expect(0, 2, until=10.0)
    assert agents.arriving(0.0) == frozenset()


def test_renewed_names_an_active_slice_whose_agent_changed_since_the_view() -> None:
    agents = registered((0, 0), (1, 0))
    active = frozenset({0, 1})
    assert agents.renewed(active) == frozenset()  # adopted: nothing was published for them yet
    agents.register(1, 1, "new", 1.0)
    assert agents.renewed(active) == frozenset({1})
    agents.published(active)
    assert agents.renewed(active) == frozenset()


def test_a_notice_marks_slices_leaving_until_a_newer_agent_registers() -> None:
    agents = registered((0, 0), (1, 0))
    given = notice(0, 1)
    agents.leave({0: 0, 1: agents.current(1)}, given)
    assert agents.leaving == frozenset({0, 1}) and agents.notice_of(1) is given and agents.notices == 1
    agents.register(1, 0, "again", 2.0)  # the same agent re-registering: still leaving
    agents.register(0, 1, "new", 2.0)  # a new agent: the slice went and is back
    assert agents.leaving == frozenset({1})


def test_respawnable_lists_dead_agents_of_slices_nobody_holds() -> None:
    agents = registered((0, 0), (1, 0), (2, 0), (3, 0), (4, 0))
    for s in range(5):
        agents.refuse(s, 0)
        agents.drop(s)
    for s in (0, 2, 3, 4):
        agents.died(s, 0)
    agents.client_lost(2, 0)  # its hardware is suspect
    agents.leave({4: 0}, notice(4, deadline=50.0))
    assert agents.respawnable(quarantined=frozenset({3}), wall=10.0) == {0: 0}  # 1 was silent, not dead
    assert agents.respawnable(quarantined=frozenset({3}), wall=60.0) == {0: 0, 4: 0}  # past the notice's deadline


def test_current_is_the_registered_agent_else_the_newest() -> None:
    agents = registered((0, 2))
    agents.drop(0)
    assert agents.current(0) == 2 and agents.current(9) is None
    agents.resume(healthy=[0], active=frozenset({0}), now=0.0)
    assert agents.current(0) is None and agents.holds(0)  # unknown until its agent registers again


def test_target_is_the_live_agent_that_registered_here() -> None:
    agents = registered((0, 1))
    assert agents.target(0, frozenset({0})) == (1, "handle-0-1")
    with pytest.raises(SupervisorError, match="slice 5 has no live agent"):
        agents.target(5, frozenset({0}))
    agents.refuse(0, 1)
    with pytest.raises(SupervisorError, match="no live agent"):
        agents.target(0, frozenset({0}))
    replayed = AgentRegistry()
    replayed.saw(3, 0)
    with pytest.raises(SupervisorError, match="agent-3-0 is not registered here"):
        replayed.target(3, frozenset({3}))


def test_resume_forgets_a_leaving_slice_whose_agent_was_replaced_and_publishes_the_newest() -> None:
    agents = AgentRegistry()
    agents.saw(0, 0)
    agents.saw(1, 0)
    agents.leave({0: 0, 1: 0}, notice(0, 1))
    agents.saw(1, 1)
    agents.resume(healthy=[0, 1], active=frozenset({0, 1}), now=5.0)
    assert agents.leaving == frozenset({0})
    assert agents.last_beat(1, -1.0) == 5.0 and agents.count() == 2
    agents.register(1, 2, "new", 6.0)
    assert agents.renewed(frozenset({0, 1})) == frozenset({1})  # published: incarnation 1, the log's newest
