"""The controller's transition function as a table: (state, event) -> (next state, action)."""

from __future__ import annotations

import pytest

from elastic.control.transitions import (
    Abort,
    AwaitView,
    Boundary,
    Failed,
    Finish,
    GiveUp,
    LoopReturned,
    Machine,
    Noted,
    NoteFailure,
    Prepare,
    Probe,
    Probed,
    Ready,
    RunPass,
    Started,
    State,
    ViewSeen,
    transition,
)
from elastic.supervision.membership import View

S = State
V4 = View(epoch=1, active=frozenset({0, 1, 2, 3}))
V3 = View(epoch=2, active=frozenset({0, 2, 3}), reason="slice 1 lost")
V4_BACK = View(epoch=3, active=frozenset({0, 1, 2, 3}), reason="slice 1 back")
GAVE_UP = View(epoch=2, active=frozenset({0}), gave_up="too few slices", reason="too few slices")
DEAD = frozenset({1})
V3_LEFT = View(epoch=2, active=frozenset({0, 2, 3}), reason="slice 1 leaving", leaving=frozenset({1}))

# (id, state, view, event, next state, next view, action)
TABLE = [
    ("start", S.STARTING, View(), Started(V4), S.RESTORING, V4, Prepare(V4, live=False)),
    ("start-gave-up", S.STARTING, View(), Started(GAVE_UP), S.GAVE_UP, GAVE_UP, GiveUp("too few slices", 2)),
    ("restored", S.RESTORING, V4, Ready(), S.RUNNING, V4, RunPass()),
    ("resharded", S.RESHARDING, V3, Ready(), S.RUNNING, V3, RunPass()),
    ("grown", S.GROWING, V4_BACK, Ready(), S.RUNNING, V4_BACK, RunPass()),
    ("finished", S.RUNNING, V4, LoopReturned(complete=True, last_step=9), S.FINISHED, V4, Finish()),
    (
        "returned-early",
        S.RUNNING,
        V4,
        LoopReturned(complete=False, last_committed=3, last_step=9),
        S.FINISHED,
        V4,
        Abort(
            "early_return",
            "the loop returned before committing step 9 (last committed: 3): iterate run.steps to the end",
        ),
    ),
    ("grow-at-boundary", S.RUNNING, V3, Boundary(V4_BACK), S.GROWING, V4_BACK, Prepare(V4_BACK, live=True)),
    ("shrink-at-boundary", S.RUNNING, V4, Boundary(V3), S.RESHARDING, V3, Prepare(V3, live=True)),
    ("leave-at-boundary", S.RUNNING, V4, Boundary(V3_LEFT), S.LEAVING, V3_LEFT, Prepare(V3_LEFT, live=True)),
    ("left", S.LEAVING, V3_LEFT, Ready(), S.RUNNING, V3_LEFT, RunPass()),
    (
        "leave-past-the-deadline-restores",
        S.RUNNING,
        V4,
        Boundary(V3_LEFT, late=True),
        S.RESTORING,
        V3_LEFT,
        Prepare(V3_LEFT, live=False),
    ),
    (
        "late-but-nothing-leaving-is-a-shrink",
        S.RUNNING,
        V4,
        Boundary(V3, late=True),
        S.RESHARDING,
        V3,
        Prepare(V3, live=True),
    ),
    ("fail-leaving", S.LEAVING, V3_LEFT, Failed("x"), S.FAILED, V3_LEFT, NoteFailure("x")),
    ("noted-after-a-leave", S.FAILED, V4, Noted(V3_LEFT), S.RESTORING, V3_LEFT, Prepare(V3_LEFT, live=False)),
    ("gave-up-at-boundary", S.RUNNING, V4, Boundary(GAVE_UP), S.GAVE_UP, GAVE_UP, GiveUp("too few slices", 2)),
    ("fail-running", S.RUNNING, V4, Failed("UNAVAILABLE"), S.FAILED, V4, NoteFailure("UNAVAILABLE")),
    ("fail-restoring", S.RESTORING, V4, Failed("x"), S.FAILED, V4, NoteFailure("x")),
    ("fail-hung", S.RUNNING, V4, Failed("StepHungError: step 3"), S.FAILED, V4, NoteFailure("StepHungError: step 3")),
    ("fail-resharding", S.RESHARDING, V3, Failed("x"), S.FAILED, V3, NoteFailure("x")),
    ("fail-growing", S.GROWING, V4_BACK, Failed("x"), S.FAILED, V4_BACK, NoteFailure("x")),
    ("noted-probe", S.FAILED, V4, Noted(V4), S.PROBING, V4, Probe(V4.active)),
    ("noted-supervisor-knows", S.FAILED, V4, Noted(V3), S.RESTORING, V3, Prepare(V3, live=False)),
    ("noted-newer-but-bigger", S.FAILED, V3, Noted(V4_BACK), S.PROBING, V3, Probe(V3.active)),
    ("noted-gave-up", S.FAILED, V4, Noted(GAVE_UP), S.GAVE_UP, GAVE_UP, GiveUp("too few slices", 2)),
    ("probed-dead", S.PROBING, V4, Probed(DEAD, attempt=1), S.AWAITING_VIEW, V4, AwaitView(DEAD, 1)),
    ("probed-none-retry", S.PROBING, V4, Probed(frozenset(), attempt=3), S.RESTORING, V4, Prepare(V4, live=False)),
    (
        "probed-none-exhausted",
        S.PROBING,
        V4,
        Probed(frozenset(), attempt=4),
        S.GAVE_UP,
        V4,
        Abort("persistent", "slice-loss errors persist with every slice healthy after 3 retries"),
    ),
    (
        "probed-none-hung-retry",
        S.PROBING,
        V4,
        Probed(frozenset(), attempt=2, cause="StepHungError: step 3", hung=True),
        S.RESTORING,
        V4,
        Prepare(V4, live=False),
    ),
    (
        "probed-none-hung-exhausted",
        S.PROBING,
        V4,
        Probed(frozenset(), attempt=4, cause="StepHungError: step 3 made no progress in 1s", hung=True),
        S.GAVE_UP,
        V4,
        Abort(
            "persistent",
            "hung steps persist with every slice healthy after 3 retries; the last: StepHungError: "
            "step 3 made no progress in 1s",
        ),
    ),
    (
        "probed-hung-dead",
        S.PROBING,
        V4,
        Probed(DEAD, attempt=1, cause="StepHungError: step 3", hung=True),
        S.AWAITING_VIEW,
        V4,
        AwaitView(DEAD, 1),
    ),
    ("view-seen", S.AWAITING_VIEW, V4, ViewSeen(V3), S.RESTORING, V3, Prepare(V3, live=False)),
    ("view-seen-gave-up", S.AWAITING_VIEW, V4, ViewSeen(GAVE_UP), S.GAVE_UP, GAVE_UP, GiveUp("too few slices", 2)),
]


@pytest.mark.parametrize(
    ("state", "view", "event", "next_state", "next_view", "action"),
    [pytest.param(*row[1:], id=row[0]) for row in TABLE],
)
def test_transition(state, view, event, next_state, next_view, action):
    machine, got = transition(Machine(state, view), event, max_transient_retries=3)
    assert machine == Machine(next_state, next_view)
    assert got == action


IMPOSSIBLE = [
    (S.RUNNING, Started(V4)),
    (S.RUNNING, Ready()),
    (S.FINISHED, Failed("x")),
    (S.GAVE_UP, Ready()),
    (S.PROBING, ViewSeen(V3)),
    (S.AWAITING_VIEW, Probed(DEAD, 1)),
    (S.RESTORING, LoopReturned(True)),
    (S.RESTORING, Boundary(V3)),
    (S.FAILED, Probed(DEAD, 1)),
    (S.RUNNING, Noted(V3)),
    (S.LEAVING, Boundary(V3_LEFT)),
]


@pytest.mark.parametrize(("state", "event"), IMPOSSIBLE, ids=[f"{s.value}-{type(e).__name__}" for s, e in IMPOSSIBLE])
def test_impossible_pairs_are_refused(state, event):
    with pytest.raises(ValueError, match=f"no transition from {state.value}"):
        transition(Machine(state, V4), event, max_transient_retries=3)


def test_every_state_is_reachable_from_the_table():
    assert {row[4] for row in TABLE} | {S.STARTING} == set(State)
