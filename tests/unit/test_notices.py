"""Notices as tables: what a notice must hold, when the job refuses one, and how long a move off its slices waits."""

from __future__ import annotations

import dataclasses

import pytest

from elastic import Notice, NoticeError
from elastic.supervision.notices import make_notice, move_bound, past_deadline, refusal


def notice(slices=frozenset({1}), deadline=100.0, at=40.0, **kw) -> Notice:
    return Notice(slices=slices, deadline=deadline, reason=kw.pop("reason", "maintenance"), at=at, **kw)


ACTIVE = frozenset({0, 1, 2, 3})

# (id, notice, active, leaving, now, gave_up, None or words the refusal holds)
REFUSALS = [
    ("taken", notice(), ACTIVE, frozenset(), 50.0, False, None),
    ("two-slices-taken", notice(frozenset({1, 2})), ACTIVE, frozenset(), 50.0, False, None),
    ("unknown-slice", notice(frozenset({7})), ACTIVE, frozenset(), 50.0, False, ("does not hold slice(s) 7", "0, 1")),
    ("slice-already-left", notice(), frozenset({0, 2, 3}), frozenset(), 50.0, False, ("does not hold slice(s) 1",)),
    ("already-leaving", notice(), ACTIVE, frozenset({1}), 50.0, False, ("already leaving",)),
    ("deadline-passed", notice(), ACTIVE, frozenset(), 100.0, False, ("deadline passed",)),
    ("deadline-long-past", notice(), ACTIVE, frozenset(), 160.0, False, ("60.0s ago",)),
    ("gave-up", notice(), ACTIVE, frozenset(), 50.0, True, ("given up",)),
]


@pytest.mark.parametrize(
    ("n", "active", "leaving", "now", "gave_up", "words"), [pytest.param(*r[1:], id=r[0]) for r in REFUSALS]
)
def test_refusal(n, active, leaving, now, gave_up, words):
    why = refusal(n, active=active, leaving=leaving, now=now, gave_up=gave_up)
    if words is None:
        assert why is None
        return
    assert why is not None and len(why.splitlines()) == 1 and why.startswith("notice refused")
    for w in words:
        assert w in why, why


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"slices": frozenset()}, "at least one slice"),
        ({"slices": {1}}, "frozenset"),
        ({"slices": frozenset({True})}, "ints"),
        ({"deadline": float("nan")}, "deadline"),
        ({"at": "now"}, "at"),
        ({"reason": " "}, "reason"),
        ({"source": "rumour"}, "source"),
    ],
)
def test_a_malformed_notice_is_refused_at_construction(fields, words):
    with pytest.raises(NoticeError, match=words):
        dataclasses.replace(notice(), **fields)


def test_a_notice_is_frozen_and_reports_its_lead():
    n = notice()
    assert n.lead_s == 60.0 and n.record()["slices"] == [1] and n.record()["lead_s"] == 60.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.deadline = 0.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("slices", "deadline_s", "words"),
    [
        (1, -1.0, "deadline has passed"),
        (1, 0, "deadline has passed"),
        (1, float("inf"), "seconds from now"),
        (None, 5.0, "slice index"),
        ([], 5.0, "at least one slice"),
        ("1", 5.0, "ints"),
    ],
)
def test_make_notice_refuses_what_is_not_a_notice(slices, deadline_s, words):
    with pytest.raises(NoticeError, match=words):
        make_notice(slices, deadline_s, "test")


def test_make_notice_takes_one_slice_or_several():
    one, two = make_notice(2, 30.0, "x"), make_notice([0, 3], 30.0, "y", source="operator")
    assert one.slices == frozenset({2}) and one.lead_s == pytest.approx(30.0) and one.source == "api"
    assert two.slices == frozenset({0, 3}) and two.source == "operator"


# (id, wait_s, deadlines, now, bound)
BOUNDS = [
    ("no-notice-the-usual-bound", 20.0, (), 0.0, 20.0),
    ("no-notice-no-bound", None, (), 0.0, None),
    ("deadline-later-than-the-bound", 20.0, (100.0,), 50.0, 20.0),
    ("deadline-sooner-than-the-bound", 20.0, (55.0,), 50.0, 5.0),
    ("deadline-bounds-an-unbounded-wait", None, (55.0,), 50.0, 5.0),
    ("earliest-of-several", 20.0, (58.0, 53.0), 50.0, 3.0),
    ("deadline-passed-waits-nothing", 20.0, (45.0,), 50.0, 0.0),
]


@pytest.mark.parametrize(("wait_s", "deadlines", "now", "bound"), [pytest.param(*b[1:], id=b[0]) for b in BOUNDS])
def test_move_bound(wait_s, deadlines, now, bound):
    notices = [notice(deadline=d, at=0.0) for d in deadlines]
    assert move_bound(wait_s, notices, now) == bound


# (id, (slices, deadline) of each notice, now, the late slices named)
LATE = [
    ("none", (), 50.0, ""),
    ("in-time", ((frozenset({1}), 60.0),), 50.0, ""),
    ("at-the-deadline", ((frozenset({1}), 50.0),), 50.0, "1"),
    ("one-of-two-late", ((frozenset({1}), 45.0), (frozenset({2, 3}), 70.0)), 50.0, "1"),
    ("both-late", ((frozenset({3}), 45.0), (frozenset({0, 2}), 49.0)), 50.0, "0, 2, 3"),
]


@pytest.mark.parametrize(("notices", "now", "named"), [pytest.param(*r[1:], id=r[0]) for r in LATE])
def test_past_deadline(notices, now, named):
    assert past_deadline([notice(slices=s, deadline=d, at=0.0) for s, d in notices], now) == named
