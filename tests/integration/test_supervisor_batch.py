"""Batched heartbeats: agents holding many slices each keep them healthy with one call per interval,
a slice whose beats stop is found within 2 x the heartbeat timeout, and an agent's death loses all of its
slices at once."""

from __future__ import annotations

import uuid

import pytest
import ray

from elastic.config import Policy
from elastic.supervision import events
from elastic.supervision.agent import SliceGroupAgent
from elastic.supervision.supervisor import SUPERVISOR_NAME, Supervisor

from .helpers import silence

pytestmark = pytest.mark.integration

SLICES, AGENTS = 64, 2
INTERVAL_S, TIMEOUT_S = 0.2, 1.5


@pytest.fixture
def group(ray_local):
    """A supervisor over 64 slices held by 2 SliceGroupAgents (slice s on agent s % 2), started."""
    job = f"batch-{uuid.uuid4().hex[:8]}"
    namespace = f"elastic-{job}"
    sup = Supervisor.options(name=SUPERVISOR_NAME, namespace=namespace).remote(
        job, Policy(min_slices=1), TIMEOUT_S, INTERVAL_S / 2, events.new_run(job)
    )
    agents = [
        SliceGroupAgent.options(namespace=namespace).remote(
            {s: 0 for s in range(a, SLICES, AGENTS)}, sup, INTERVAL_S, job
        )
        for a in range(AGENTS)
    ]
    try:
        held = ray.get([agent.start.remote() for agent in agents], timeout=60)
        assert sorted(s for slices in held for s in slices) == list(range(SLICES))
        view = ray.get(sup.start.remote(), timeout=30)
        assert view.active == frozenset(range(SLICES)), view
        yield sup, agents
    finally:
        ray.get(sup.close.remote(), timeout=30)  # it writes nothing more: the agents' deaths leave no event
        ray.wait([agent.silence.remote() for agent in agents], num_returns=len(agents), timeout=5)
        for actor in [*agents, sup]:
            ray.kill(actor, no_restart=True)
        events.delete(job)


def lost_events(sup) -> list[dict]:
    return [e for e in ray.get(sup.events.remote(), timeout=30) if e["kind"] == "health" and not e["healthy"]]


def test_batched_heartbeats_keep_slices_healthy_and_a_silent_slice_is_found(group):
    sup, agents = group
    # Well past the timeout, no view change may come: only batched heartbeats keep the slices in.
    view = ray.get(sup.wait_for_epoch.remote(1, 2 * TIMEOUT_S), timeout=2 * TIMEOUT_S + 30)
    assert view.active == frozenset(range(SLICES)) and view.epoch == 1, view
    assert lost_events(sup) == []
    usage = ray.get(sup.usage.remote(), timeout=30)
    assert usage["slices"] == SLICES and usage["cpu_s"] > 0

    stopped = ray.get(agents[1].silence.remote([5]), timeout=30)  # slice 5 lives on agent 1, which lives on
    view = ray.get(sup.wait_for_epoch.remote(view.epoch, 4 * TIMEOUT_S), timeout=4 * TIMEOUT_S + 30)
    assert view.active == frozenset(range(SLICES)) - {5}, view
    (lost,) = lost_events(sup)
    assert lost["slice"] == 5 and "no heartbeat" in lost["cause"], lost
    assert 0 < lost["wall"] - stopped  # dropped after the silence began, within 2x the timeout of silence:
    assert silence(lost["cause"]) <= 2 * TIMEOUT_S, lost  # the supervisor's count (its own stalls left out)
    after = ray.get(sup.wait_for_epoch.remote(view.epoch, TIMEOUT_S), timeout=TIMEOUT_S + 30)  # no further change
    assert after.active == frozenset(range(SLICES)) - {5}  # agent 1's other slices still beat


def test_an_agents_death_loses_all_its_slices_at_once(group):
    sup, agents = group
    ray.kill(agents[0], no_restart=True)
    view = ray.get(sup.wait_for_epoch.remote(1, 4 * TIMEOUT_S), timeout=4 * TIMEOUT_S + 30)
    assert view.active == frozenset(range(1, SLICES, 2)), view  # one view change for all 32 slices
    assert all("agent died" in e["cause"] for e in lost_events(sup))  # the lifeline, not the heartbeat timeout


def test_heartbeats_name_the_slices_the_supervisor_does_not_know(group):
    sup, _ = group
    assert ray.get(sup.heartbeats.remote([(0, 0), (1, 0)]), timeout=30) == []
    assert ray.get(sup.heartbeats.remote([(0, 0), (1, 7), (999, 0)]), timeout=30) == [1, 999]
    assert ray.get(sup.heartbeat.remote(0, 0), timeout=30) is True
    assert ray.get(sup.heartbeat.remote(999, 0), timeout=30) is False
