"""The fault-injection plan: fluent building, ordering and validation."""

from __future__ import annotations

import pickle

import pytest

from elastic.chaos.faults import Fault, Faults
from elastic.errors import ConfigError


def test_fluent_api_returns_same_object():
    plan = Faults()
    assert plan.kill_slice(1, at_step=3) is plan
    assert plan.revive_slice(1, at_step=5) is plan
    assert plan.silence_agent(2, at_step=4) is plan
    assert plan.transient_error(at_step=1) is plan
    assert len(plan) == 4


def test_faults_sorted_by_step_stable_for_ties():
    plan = (
        Faults()
        .kill_slice(1, at_step=30)
        .transient_error(at_step=5)
        .kill_slice(2, at_step=30)
        .revive_slice(1, at_step=60)
        .silence_agent(3, at_step=0)
    )
    assert plan.faults == (
        Fault(kind="silence", slice=3, at_step=0),
        Fault(kind="transient", at_step=5),
        Fault(kind="kill", slice=1, at_step=30),
        Fault(kind="kill", slice=2, at_step=30),
        Fault(kind="revive", slice=1, at_step=60),
    )
    assert isinstance(plan.faults, tuple)
    assert plan.faults[1].slice is None


def test_empty_plan():
    plan = Faults()
    assert plan.faults == () and len(plan) == 0
    plan.validate(num_slices=1, num_steps=1)


@pytest.mark.parametrize(
    "add",
    [
        pytest.param(lambda f: f.kill_slice(0, at_step=-1), id="kill"),
        pytest.param(lambda f: f.revive_slice(0, at_step=-5), id="revive"),
        pytest.param(lambda f: f.silence_agent(0, at_step=-1), id="silence"),
        pytest.param(lambda f: f.transient_error(at_step=-2), id="transient"),
    ],
)
def test_negative_step_rejected_when_added(add):
    plan = Faults()
    with pytest.raises(ConfigError, match=r"at_step must be 0 or more, got -\d"):
        add(plan)
    assert len(plan) == 0, "a rejected fault must not be kept"


@pytest.mark.parametrize(
    ("add", "words"),
    [
        pytest.param(lambda f: f.kill_slice(0, at_step=2.5), "kill at_step must be an int, got 2.5", id="float-step"),
        pytest.param(lambda f: f.transient_error(at_step="3"), "at_step must be an int, got '3'", id="str-step"),
        pytest.param(lambda f: f.kill_slice("1", at_step=3), "kill slice must be an int, got '1'", id="str-slice"),
        pytest.param(lambda f: f.revive_slice(True, at_step=3), "slice must be an int, got True", id="bool-slice"),
    ],
)
def test_non_int_step_or_slice_rejected_when_added(add, words):
    plan = Faults()
    with pytest.raises(ConfigError, match=words):
        add(plan)
    assert len(plan) == 0


# (id, plan builder, num_slices, num_steps, words the message must hold)
INVALID = [
    ("slice-too-high", lambda: Faults().kill_slice(4, at_step=1), 4, 10, ("kill", "slice 4", "0..3")),
    ("slice-negative", lambda: Faults().kill_slice(-1, at_step=1), 4, 10, ("slice -1", "0..3")),
    ("silence-slice-too-high", lambda: Faults().silence_agent(2, at_step=1), 2, 10, ("silence", "slice 2", "0..1")),
    ("step-at-end", lambda: Faults().kill_slice(0, at_step=10), 4, 10, ("kill", "step 10", "last step 9")),
    ("step-past-end", lambda: Faults().transient_error(at_step=99), 4, 10, ("transient", "step 99", "last step 9")),
    (
        "revive-never-killed",
        lambda: Faults().revive_slice(1, at_step=5),
        4,
        10,
        ("revive_slice(1)", "step 5", "not down"),
    ),
    (
        "revive-before-kill",
        lambda: Faults().revive_slice(1, at_step=2).kill_slice(1, at_step=5),
        4,
        10,
        ("revive_slice(1)", "not down"),
    ),
    (
        "revive-other-slice",
        lambda: Faults().kill_slice(0, at_step=1).revive_slice(1, at_step=2),
        4,
        10,
        ("revive_slice(1)", "not down"),
    ),
    (
        "revive-twice",
        lambda: Faults().kill_slice(2, at_step=1).revive_slice(2, at_step=3).revive_slice(2, at_step=4),
        4,
        10,
        ("revive_slice(2)", "step 4", "not down"),
    ),
]


@pytest.mark.parametrize(
    ("build", "num_slices", "num_steps", "words"), [pytest.param(*c[1:], id=c[0]) for c in INVALID]
)
def test_validate_rejects(build, num_slices, num_steps, words):
    with pytest.raises(ConfigError) as info:
        build().validate(num_slices=num_slices, num_steps=num_steps)
    assert isinstance(info.value, ValueError)
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} lacks {w!r}"
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is ConfigError and str(back) == str(info.value)


@pytest.mark.parametrize(
    ("build", "num_slices", "num_steps"),
    [
        pytest.param(lambda: Faults().kill_slice(1, at_step=3).revive_slice(1, at_step=6), 4, 10, id="kill-revive"),
        pytest.param(
            lambda: Faults().revive_slice(1, at_step=6).kill_slice(1, at_step=3),
            4,
            10,
            id="kill-revive-added-out-of-order",
        ),
        pytest.param(
            lambda: Faults().kill_slice(1, at_step=3).revive_slice(1, at_step=3), 4, 10, id="kill-revive-same-step"
        ),
        pytest.param(
            lambda: Faults().silence_agent(0, at_step=2).revive_slice(0, at_step=4), 2, 5, id="silence-revive"
        ),
        pytest.param(lambda: Faults().kill_slice(3, at_step=9).transient_error(at_step=0), 4, 10, id="edges"),
        pytest.param(
            lambda: (
                Faults()
                .kill_slice(1, at_step=1)
                .revive_slice(1, at_step=2)
                .kill_slice(1, at_step=3)
                .revive_slice(1, at_step=4)
            ),
            2,
            5,
            id="twice",
        ),
    ],
)
def test_validate_accepts(build, num_slices, num_steps):
    build().validate(num_slices=num_slices, num_steps=num_steps)


def test_hang_step_plan_and_validation():
    plan = Faults().hang_step(at_step=4).hang_step(at_step=7, slice=2).revive_slice(2, at_step=9)
    assert plan.faults == (
        Fault(kind="hang", at_step=4),
        Fault(kind="hang", slice=2, at_step=7),
        Fault(kind="revive", slice=2, at_step=9),
    )
    plan.validate(num_slices=4, num_steps=10)  # a slice wedged by a hang is down: it may be revived
    with pytest.raises(ConfigError, match="not down"):
        Faults().hang_step(at_step=2).revive_slice(1, at_step=5).validate(num_slices=4, num_steps=10)
    with pytest.raises(ConfigError, match="slices are 0..3"):
        Faults().hang_step(at_step=2, slice=4).validate(num_slices=4, num_steps=10)
    with pytest.raises(ConfigError, match="at_step must be 0 or more"):
        Faults().hang_step(at_step=-1)
