"""Table tests of the supervisor's pure decision function ``elastic.supervision.policy.decide``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from elastic.config import Policy
from elastic.supervision.membership import HealthEvent, View
from elastic.supervision.policy import Decision, GiveUp, Grow, Leave, Shrink, Stay, Wait, decide, healthy_slices


def ev(time: float, slice: int, healthy: bool) -> HealthEvent:
    return HealthEvent(time=time, slice=slice, healthy=healthy, cause="test")


def up(time: float, *slices: int) -> list[HealthEvent]:
    return [ev(time, s, True) for s in slices]


def names_slice(reason: str, n: int) -> bool:
    """``reason`` mentions slice number ``n`` as a number of its own (not inside 60.0 or min_slices=2)."""
    return re.search(rf"(?<![\d.=]){n}(?![\d.])", reason) is not None


ALL4 = frozenset({0, 1, 2, 3})

# Shared histories.
ONE_LOST = [*up(0.0, 0, 1, 2, 3), ev(5.0, 1, False)]
THREE_GONE = [*up(0.0, 0, 1, 2, 3), ev(5.0, 3, False)]
TWO_OF_THREE_LOST = [*up(0.0, 0, 1, 2), ev(10.0, 1, False), ev(12.0, 2, False)]
FAILED_TWICE = [*up(0.0, 0, 1, 2, 3), ev(10.0, 1, False), ev(20.0, 1, True), ev(30.0, 1, False)]
FAILED_TWICE_BACK = [*FAILED_TWICE, ev(40.0, 1, True)]

# (id, policy, view, history, now, expected type, expected fields, slices the reason must name, words it must hold)
CASES: list[
    tuple[str, Policy, View, list[HealthEvent], float, type, dict[str, Any], tuple[int, ...], tuple[str, ...]]
] = [
    (
        "startup-fewer-registered-than-min",
        Policy(min_slices=2),
        View(),
        up(0.0, 0),
        1.0,
        Stay,
        {},
        (),
        ("1 of 2",),
    ),
    (
        "startup-none-registered",
        Policy(min_slices=1),
        View(),
        [],
        0.0,
        Stay,
        {},
        (),
        ("0 of 1",),
    ),
    (
        "startup-all-registered-join",
        Policy(min_slices=2),
        View(),
        up(0.0, 0, 1, 2, 3),
        1.0,
        Grow,
        {"to": ALL4},
        (0, 1, 2, 3),
        ("joined",),
    ),
    (
        "all-healthy-view-matches",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        up(0.0, 0, 1, 2, 3),
        9.0,
        Stay,
        {},
        (),
        ("unchanged",),
    ),
    (
        "one-lost-enough-left",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        ONE_LOST,
        6.0,
        Shrink,
        {"to": frozenset({0, 2, 3})},
        (1,),
        ("lost",),
    ),
    (
        "one-lost-leaving-exactly-min",
        Policy(min_slices=3),
        View(epoch=1, active=ALL4),
        ONE_LOST,
        6.0,
        Shrink,
        {"to": frozenset({0, 2, 3})},
        (1,),
        ("lost",),
    ),
    (
        "lost-and-another-back-at-once",
        Policy(min_slices=2),
        View(epoch=2, active=frozenset({0, 1, 2})),
        [*THREE_GONE, ev(10.0, 1, False), ev(10.5, 3, True)],
        11.0,
        Shrink,
        {"to": frozenset({0, 2, 3})},
        (1, 3),
        ("lost", "back"),
    ),
    (
        "slice-back",
        Policy(min_slices=2),
        View(epoch=2, active=frozenset({0, 1, 2})),
        [*THREE_GONE, ev(20.0, 3, True)],
        21.0,
        Grow,
        {"to": ALL4},
        (3,),
        ("back",),
    ),
    (
        "below-min-wait",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=1, active=frozenset({0, 1, 2})),
        TWO_OF_THREE_LOST,
        30.0,
        Wait,
        {"until": 72.0},
        (0,),
        ("min_slices",),
    ),
    (
        "below-min-wait-just-before-deadline",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=1, active=frozenset({0, 1, 2})),
        TWO_OF_THREE_LOST,
        71.9,
        Wait,
        {"until": 72.0},
        (0,),
        ("min_slices",),
    ),
    (
        "below-min-at-deadline-give-up",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=1, active=frozenset({0, 1, 2})),
        TWO_OF_THREE_LOST,
        72.0,
        GiveUp,
        {},
        (0,),
        ("min_slices=2", "repair_timeout_s"),
    ),
    (
        "below-min-long-after-deadline-give-up",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=1, active=frozenset({0, 1, 2})),
        TWO_OF_THREE_LOST,
        500.0,
        GiveUp,
        {},
        (0,),
        ("min_slices=2",),
    ),
    (
        "all-lost-wait",
        Policy(min_slices=1, repair_timeout_s=5.0),
        View(epoch=1, active=frozenset({0, 1})),
        [*up(0.0, 0, 1), ev(3.0, 0, False), ev(4.0, 1, False)],
        4.5,
        Wait,
        {"until": 9.0},
        (),
        ("min_slices=1",),
    ),
    (
        "repaired-within-timeout-shrink-no-give-up",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=1, active=frozenset({0, 1, 2})),
        [*TWO_OF_THREE_LOST, ev(40.0, 1, True)],
        1000.0,
        Shrink,
        {"to": frozenset({0, 1})},
        (2,),
        ("lost",),
    ),
    (
        "repaired-within-timeout-grow-no-give-up",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=2, active=frozenset({0, 1})),
        [*up(0.0, 0, 1, 2), ev(5.0, 2, False), ev(10.0, 1, False), ev(20.0, 1, True), ev(25.0, 2, True)],
        1000.0,
        Grow,
        {"to": frozenset({0, 1, 2})},
        (2,),
        ("back",),
    ),
    (
        "second-outage-restarts-repair-clock",
        Policy(min_slices=2, repair_timeout_s=60.0),
        View(epoch=1, active=frozenset({0, 1})),
        [*up(0.0, 0, 1), ev(10.0, 1, False), ev(20.0, 1, True), ev(100.0, 1, False)],
        150.0,
        Wait,
        {"until": 160.0},
        (0,),
        ("min_slices",),
    ),
    (
        "quarantine-second-failure-shrinks",
        Policy(min_slices=1, max_slice_failures=2),
        View(epoch=3, active=ALL4),
        FAILED_TWICE,
        31.0,
        Shrink,
        {"to": frozenset({0, 2, 3})},
        (1,),
        ("failed too often",),
    ),
    (
        "quarantine-failed-slice-stays-out",
        Policy(min_slices=1, max_slice_failures=2),
        View(epoch=4, active=frozenset({0, 2, 3})),
        FAILED_TWICE_BACK,
        41.0,
        Stay,
        {},
        (1,),
        ("failed too often",),
    ),
    (
        "quarantine-limit-not-reached-grows",
        Policy(min_slices=1, max_slice_failures=3),
        View(epoch=4, active=frozenset({0, 2, 3})),
        FAILED_TWICE_BACK,
        41.0,
        Grow,
        {"to": ALL4},
        (1,),
        ("back",),
    ),
    (
        "quarantine-disabled-grows",
        Policy(min_slices=1, max_slice_failures=0),
        View(epoch=4, active=frozenset({0, 2, 3})),
        FAILED_TWICE_BACK,
        41.0,
        Grow,
        {"to": ALL4},
        (1,),
        ("back",),
    ),
    (
        "already-gave-up",
        Policy(min_slices=1),
        View(epoch=5, active=frozenset({0}), gave_up="only slice 0 left for too long"),
        [*up(0.0, 0, 1, 2, 3)],
        1000.0,
        Stay,
        {},
        (0,),
        ("gave up", "only slice 0 left for too long"),
    ),
    (
        "already-gave-up-even-when-below-min",
        Policy(min_slices=3, repair_timeout_s=1.0),
        View(epoch=5, active=frozenset({0}), gave_up="too few slices"),
        TWO_OF_THREE_LOST,
        1000.0,
        Stay,
        {},
        (),
        ("gave up",),
    ),
]


def check_reason(decision: Decision, must_name: tuple[int, ...], words: tuple[str, ...]) -> None:
    reason = decision.reason
    assert isinstance(reason, str)
    assert reason.strip(), "a decision must say why"
    assert reason.isprintable(), reason
    assert "frozenset" not in reason and "HealthEvent" not in reason, f"reason shows reprs, not prose: {reason!r}"
    for n in must_name:
        assert names_slice(reason, n), f"reason {reason!r} does not name slice {n}"
    for w in words:
        assert w in reason, f"reason {reason!r} lacks {w!r}"


@pytest.mark.parametrize(
    ("policy", "view", "history", "now", "kind", "fields", "must_name", "words"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_decide(policy, view, history, now, kind, fields, must_name, words):
    decision = decide(view, history, now, policy)
    assert type(decision) is kind, decision
    for name, expected in fields.items():
        got = getattr(decision, name)
        if name == "until":
            assert got == pytest.approx(expected)
        else:
            assert isinstance(got, frozenset)
            assert got == expected
    check_reason(decision, must_name, words)


@pytest.mark.parametrize(
    ("view", "history"),
    [
        pytest.param(View(epoch=1, active=ALL4), ONE_LOST, id="shrink"),
        pytest.param(View(epoch=1, active=frozenset({0, 1, 2})), TWO_OF_THREE_LOST, id="wait"),
    ],
)
def test_decide_is_pure(view, history):
    """Same inputs, same decision; the history passed in is not modified."""
    policy = Policy(min_slices=2)
    before = list(history)
    assert decide(view, history, 30.0, policy) == decide(view, history, 30.0, policy)
    assert history == before


@pytest.mark.parametrize("now", [1000.0, 30.0], ids=["after-deadline", "before-deadline"])
def test_quarantine_below_min_waits_then_gives_up(now):
    policy = Policy(min_slices=2, repair_timeout_s=60.0, max_slice_failures=1)
    view = View(epoch=1, active=frozenset({0, 1}))
    history = [*up(0.0, 0, 1), ev(10.0, 1, False), ev(20.0, 1, True)]  # slice 1 failed once: quarantined
    decision = decide(view, history, now, policy)
    if now >= 70.0:
        assert isinstance(decision, GiveUp), decision
        assert "min_slices" in decision.reason
    else:
        assert isinstance(decision, Wait), decision
        assert decision.until == pytest.approx(70.0)


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        pytest.param([], frozenset(), id="empty"),
        pytest.param(up(0.0, 0, 1, 2), frozenset({0, 1, 2}), id="all-up"),
        pytest.param([*up(0.0, 0, 1), ev(1.0, 1, False)], frozenset({0}), id="one-lost"),
        pytest.param([ev(0.0, 2, False)], frozenset(), id="only-lost-event"),
        pytest.param([ev(0.0, 0, False), ev(1.0, 0, True)], frozenset({0}), id="lost-then-back"),
        pytest.param(
            [*up(0.0, 0), ev(1.0, 0, False), ev(2.0, 0, True), ev(3.0, 0, False)], frozenset(), id="latest-event-wins"
        ),
        pytest.param(FAILED_TWICE_BACK, ALL4, id="quarantine-is-not-health"),
    ],
)
def test_healthy_slices(history, expected):
    got = healthy_slices(history)
    assert isinstance(got, frozenset)
    assert got == expected


def test_a_job_below_min_slices_waits_past_the_repair_timeout_while_replacements_that_would_suffice_start():
    policy = Policy(min_slices=2, repair_timeout_s=1.0)
    view = View(epoch=3, active=frozenset({0, 1, 2}))
    decision = decide(view, TWO_OF_THREE_LOST, 1000.0, policy, coming=frozenset({2}))
    assert isinstance(decision, Wait), decision
    check_reason(decision, (0, 2), ("starting",))
    # nothing coming, or not enough of it (a quarantined slice never counts): the bound holds as before
    assert isinstance(decide(view, TWO_OF_THREE_LOST, 1000.0, policy), GiveUp)
    three = Policy(min_slices=3, repair_timeout_s=1.0)
    assert isinstance(decide(view, TWO_OF_THREE_LOST, 1000.0, three, coming=frozenset({2})), GiveUp)
    assert isinstance(decide(view, TWO_OF_THREE_LOST, 1000.0, three, coming=frozenset({1, 2})), Wait)
    strict = Policy(min_slices=2, repair_timeout_s=1.0, max_slice_failures=1)
    assert isinstance(decide(view, TWO_OF_THREE_LOST, 1000.0, strict, coming=frozenset({2})), GiveUp)


# Notices: (id, policy, view, history, leaving, expected type, expected fields, slices the reason must name, words)
ALL_UP = up(0.0, 0, 1, 2, 3)
LEAVING_CASES: list[tuple[str, Policy, View, list[HealthEvent], frozenset[int], type, dict[str, Any], tuple, tuple]] = [
    (
        "leaving-slice-left",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        ALL_UP,
        frozenset({1}),
        Leave,
        {"to": frozenset({0, 2, 3}), "leaving": frozenset({1})},
        (1, 0, 2, 3),
        ("leaving", "notice"),
    ),
    (
        "two-leaving-at-once",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        ALL_UP,
        frozenset({1, 3}),
        Leave,
        {"to": frozenset({0, 2}), "leaving": frozenset({1, 3})},
        (1, 3),
        ("leaving",),
    ),
    (
        "leaving-already-left-stays-out",
        Policy(min_slices=2),
        View(epoch=2, active=frozenset({0, 2, 3})),
        ALL_UP,
        frozenset({1}),
        Stay,
        {},
        (),
        ("unchanged",),
    ),
    (
        "leaving-would-go-below-min-kept",
        Policy(min_slices=4),
        View(epoch=1, active=ALL4),
        ALL_UP,
        frozenset({1}),
        Stay,
        {},
        (1,),
        ("leaving", "min_slices=4", "kept"),
    ),
    (
        "leaving-slice-died-first-is-a-loss",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        ONE_LOST,
        frozenset({1}),
        Shrink,
        {"to": frozenset({0, 2, 3})},
        (1,),
        ("lost",),
    ),
    (
        "one-leaving-one-lost-is-a-loss",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        THREE_GONE,
        frozenset({1}),
        Shrink,
        {"to": frozenset({0, 2})},
        (3, 1),
        ("lost", "leaving"),
    ),
    (
        "leaving-while-another-back",
        Policy(min_slices=2),
        View(epoch=2, active=frozenset({0, 1, 2})),
        ALL_UP,
        frozenset({1}),
        Leave,
        {"to": frozenset({0, 2, 3}), "leaving": frozenset({1})},
        (1, 3),
        ("leaving", "back"),
    ),
    (
        "nothing-leaving-all-healthy",
        Policy(min_slices=2),
        View(epoch=1, active=ALL4),
        ALL_UP,
        frozenset(),
        Stay,
        {},
        (),
        ("unchanged",),
    ),
    (
        "leaving-below-min-already-waits",
        Policy(min_slices=3),
        View(epoch=1, active=frozenset({0, 1, 2})),
        TWO_OF_THREE_LOST,
        frozenset({0}),
        Wait,
        {},
        (0,),
        ("min_slices=3",),
    ),
]


@pytest.mark.parametrize(
    ("policy", "view", "history", "leaving", "kind", "fields", "must_name", "words"),
    [pytest.param(*c[1:], id=c[0]) for c in LEAVING_CASES],
)
def test_decide_with_slices_leaving(policy, view, history, leaving, kind, fields, must_name, words):
    decision = decide(view, history, 30.0, policy, leaving=leaving)
    assert type(decision) is kind, decision
    for name, expected in fields.items():
        assert getattr(decision, name) == expected, decision
    check_reason(decision, must_name, words)


# -- a renewed member: the same slices, but an active slice's agent was replaced ------------------------------------


@pytest.mark.parametrize(
    ("view", "history", "renewed", "kind", "to"),
    [
        pytest.param(View(epoch=1, active=ALL4), up(0.0, 0, 1, 2, 3), {2}, Grow, ALL4, id="unchanged-renewed-grows"),
        pytest.param(View(epoch=1, active=ALL4), up(0.0, 0, 1, 2, 3), set(), Stay, None, id="unchanged-stays"),
        pytest.param(View(epoch=1, active=ALL4), ONE_LOST, {2}, Shrink, frozenset({0, 2, 3}), id="a-shrink-wins"),
        pytest.param(
            View(epoch=1, active=frozenset({0, 1})), up(0.0, 0, 1, 2), {1}, Grow, frozenset({0, 1, 2}), id="a-grow-wins"
        ),
        pytest.param(
            View(epoch=3, active=ALL4, gave_up="too few"), up(0.0, 0, 1, 2, 3), {2}, Stay, None, id="gave-up-stays"
        ),
    ],
)
def test_a_renewed_member_turns_a_stay_into_a_grow_over_the_same_slices(view, history, renewed, kind, to):
    """``renewed`` (an active slice whose lost agent a new one replaced before a view could drop it) makes ``decide``
    answer a Grow over the view's own slices where it would stay, naming them; any other answer is unchanged."""
    decision = decide(view, history, 10.0, Policy(min_slices=1), renewed=frozenset(renewed))
    assert type(decision) is kind, decision
    if to is not None:
        assert decision.to == to, decision
    if kind is Grow and to == view.active:
        assert decision.reason == "slice(s) 2: a new agent replaces the lost one", decision
        check_reason(decision, (2,), ("new agent",))


def test_next_view_carries_a_decision_out_as_the_next_epochs_view():
    """``next_view``: the view a decision makes (the next epoch), None for Stay and Wait; a Leave's view holds each
    notice once, however many of its slices it names."""
    from elastic.supervision.notices import Notice
    from elastic.supervision.policy import next_view

    view = View(epoch=3, active=ALL4)
    given = Notice(slices=frozenset({2, 3}), deadline=100.0, reason="maintenance", source="api", at=0.0)
    left = next_view(view, Leave(to=frozenset({0, 1}), leaving=frozenset({2, 3}), reason="r"), lambda s: given)
    assert left == View(epoch=4, active=frozenset({0, 1}), reason="r", leaving=frozenset({2, 3}), notices=(given,))
    shrunk = next_view(view, Shrink(to=frozenset({0}), reason="lost"), lambda s: given)
    assert shrunk == View(epoch=4, active=frozenset({0}), reason="lost")
    grown = next_view(view, Grow(to=ALL4, reason="renewed"), lambda s: given)
    assert grown == View(epoch=4, active=ALL4, reason="renewed")
    gone = next_view(view, GiveUp(reason="too few"), lambda s: given)
    assert gone == View(epoch=4, active=ALL4, gave_up="too few", reason="too few")
    assert next_view(view, Stay(reason="s"), lambda s: given) is None
    assert next_view(view, Wait(until=1.0, reason="w"), lambda s: given) is None
