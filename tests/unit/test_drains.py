"""drain_notices: which notices a set of draining Ray nodes makes (a table; no cluster, no clock)."""

from __future__ import annotations

import pytest

from elastic.supervision.drains import NO_DEADLINE_S, drain_notices

NOW = 1_000.0
NODES = {0: "head", 1: "head", 2: "a", 3: "b"}


@pytest.mark.parametrize(
    ("draining", "noticed", "expected"),
    [
        ({}, set(), []),
        ({"elsewhere": 2_000_000}, set(), []),  # a node the job does not run on
        ({"b": 1_020_000}, set(), [({3}, 1_020.0)]),
        ({"b": 1_020_000}, {3}, []),  # already leaving, or already told
        ({"b": 0}, set(), [({3}, NOW + NO_DEADLINE_S)]),  # no deadline: the default warning
        ({"head": 1_030_000, "a": 1_010_000}, set(), [({2}, 1_010.0), ({0, 1}, 1_030.0)]),
        ({"head": 1_030_000}, {0}, [({1}, 1_030.0)]),
        ({"b": 990_000}, set(), [({3}, 990.0)]),  # already past: the supervisor refuses it, the loss is a failure
    ],
)
def test_drain_notices(draining, noticed, expected) -> None:
    notices = drain_notices(draining, NODES, noticed, NOW)
    got = sorted(((set(n.slices), n.deadline) for n in notices), key=lambda x: x[1])
    assert got == sorted(expected, key=lambda x: x[1])
    assert all(n.source == "ray_drain" and n.at == NOW and "drains node" in n.reason for n in notices)
