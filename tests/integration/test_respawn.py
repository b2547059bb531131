"""Respawning (issue 7): with ``Policy.respawn_every_s`` set, a slice whose agent died gets a new agent on its node,
at most once per ``respawn_every_s``, and rejoins through decide; without it, the slice stays out."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from ray.exceptions import RaySystemError

from elastic.config import ElasticConfig, Policy
from elastic.control.cluster import ActorGroup, SliceAgents
from elastic.supervision.membership import View

from ..conftest import until
from .helpers import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EVERY_S = 1.0
ALL4 = frozenset(range(4))


def named_actors(namespace: str) -> list[str]:
    return sorted(e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == namespace)


def view_of(group: ActorGroup) -> View:
    return ray.get(group.supervisor.view.remote(), timeout=30)


def view_becomes(group: ActorGroup, active: frozenset[int], bound_s: float) -> View:
    return until(lambda: (v := view_of(group)).active == active and v, bound_s, f"view over {sorted(active)}")


def registered(group: ActorGroup, slice_index: int, incarnation: int) -> bool:
    """Whether the supervisor holds agent ``incarnation`` as slice ``slice_index``'s (a beat it knows)."""
    return ray.get(group.supervisor.heartbeats.remote([(slice_index, incarnation)]), timeout=30) == []


class RespawnerRounds:
    """Counts the rounds of the group's respawner that ran to the end (it wraps ``_respawn_once``, which the
    respawner's thread calls every ``min(respawn_every_s, 1)`` s): "no respawn" is shown by rounds that ran and
    started nothing, not by time slept."""

    def __init__(self, group: ActorGroup) -> None:
        self._done = 0
        self._errors: list[BaseException] = []
        self._cv = threading.Condition()
        inner = group._respawn_once

        def counted(every: float) -> None:
            try:
                inner(every)
            except BaseException as err:
                with self._cv:
                    self._errors.append(err)
                raise
            with self._cv:
                self._done += 1
                self._cv.notify_all()

        group._respawn_once = counted

    def wait_for(self, rounds: int, bound_s: float) -> None:
        """Until ``rounds`` more rounds have run to the end (bounded; the rounds that failed are named)."""
        with self._cv:
            target = self._done + rounds
            ran = self._cv.wait_for(lambda: self._done >= target, bound_s)
            assert ran, f"the respawner ran {rounds - (target - self._done)} of {rounds} rounds in {bound_s}s; " + (
                f"failed rounds: {self._errors}"
            )


class FailsOnce(SliceAgents):
    """Real agents, but creating the one ``(slice, incarnation)`` raises what Ray raises when the new actor is
    killed while Ray creates it."""

    def __init__(self, cfg: ElasticConfig, which: tuple[int, int]) -> None:
        super().__init__(cfg)
        self._which: tuple[int, int] | None = which

    def __call__(self, index: int, incarnation: int, *args: Any) -> Any:
        if (index, incarnation) == self._which:
            self._which = None
            raise RaySystemError("Actor creation cancelled.")
        return super().__call__(index, incarnation, *args)


@pytest.fixture
def launched(ray_local) -> Iterator[Callable[..., ActorGroup]]:
    """``launch(respawn_every_s)``: an ActorGroup over 4 slices, every agent pinned to this node; at the end it
    is shut down and its namespace must be empty."""
    groups: list[ActorGroup] = []

    def launch(respawn_every_s: float | None, fail_once: tuple[int, int] | None = None) -> ActorGroup:
        here = ray.get_runtime_context().get_node_id()
        cfg = config(
            f"respawn-{uuid.uuid4().hex[:8]}",
            policy=Policy(min_slices=2, repair_timeout_s=60.0, respawn_every_s=respawn_every_s),
        )
        agents = FailsOnce(cfg, fail_once) if fail_once is not None else None
        group = ActorGroup(cfg, agent_nodes={i: here for i in range(4)}, agents=agents)
        groups.append(group)
        group.launch()
        assert view_of(group).active == ALL4
        return group

    try:
        yield launch
    finally:
        for group in groups:
            group.shutdown()
            namespace = group._config.namespace
            until(
                lambda: not named_actors(namespace),  # noqa: B023 (called before the loop moves on)
                15,
                f"empty namespace (left: {named_actors(namespace)})",
            )


def test_a_killed_agent_is_replaced_and_its_slice_rejoins(launched):
    group = launched(EVERY_S)
    namespace = group._config.namespace
    t0 = time.monotonic()
    group.kill_agent(1)  # ray.kill: the agent is gone for real, its node alive
    view_becomes(group, ALL4 - {1}, 15)
    back = view_becomes(group, ALL4, 15)
    assert "back" in back.reason, back
    assert time.monotonic() - t0 < 15
    assert group.respawns == [(1, 1)], group.respawns
    assert "agent-1-1" in named_actors(namespace) and "agent-1-0" not in named_actors(namespace)
    RespawnerRounds(group).wait_for(3, 30)  # a healthy replacement is not replaced again: 3 rounds leave it be
    assert group.respawns == [(1, 1)] and view_of(group).epoch == back.epoch


def test_a_replacement_that_fails_while_ray_creates_it_is_tried_again(launched):
    group = launched(EVERY_S, fail_once=(1, 1))
    group.kill_agent(1)
    view_becomes(group, ALL4 - {1}, 15)
    view_becomes(group, ALL4, 15)
    assert group.respawns == [(1, 2)], group.respawns


def test_respawns_are_rate_bounded_when_the_replacement_keeps_dying(launched):
    group = launched(EVERY_S)
    namespace = group._config.namespace
    group.kill_agent(1)
    view_becomes(group, ALL4 - {1}, 15)
    window_s, seen, next_incarnation = 8.0, [], 1
    end = time.monotonic() + window_s
    while time.monotonic() < end:  # kill every replacement as soon as it exists
        try:
            agent = ray.get_actor(f"agent-1-{next_incarnation}", namespace=namespace)
        except ValueError:
            time.sleep(0.02)
            continue
        seen.append(time.monotonic())
        if next_incarnation % 2 == 0:  # some die after registering (the supervisor sees them die), some before
            until(lambda: registered(group, 1, next_incarnation), 15, f"agent-1-{next_incarnation} registered")  # noqa: B023
        ray.kill(agent, no_restart=True)
        next_incarnation += 1
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert 2 <= len(seen) <= window_s / EVERY_S + 1, (seen, gaps)
    assert all(g >= EVERY_S - 0.25 for g in gaps), gaps  # at most once per respawn_every_s (poll slack)
    assert [s for s, _ in group.respawns] == [1] * len(group.respawns)
    assert len(group.respawns) <= len(seen) + 1
    view_becomes(group, ALL4, 15)  # left alone, the next replacement brings the slice back


def test_without_respawn_every_s_nothing_is_respawned(launched):
    group = launched(None)
    namespace = group._config.namespace
    group.kill_agent(1)
    out = view_becomes(group, ALL4 - {1}, 15)
    # the slice is one a respawner would bring back, but there is none
    assert ray.get(group.supervisor.respawnable.remote(), timeout=30) == {1: 0}
    assert group.respawn_every_s is None and group._respawner is None
    # the view would change (a new epoch) if anything brought the slice back: none within 4 s
    after = ray.get(group.supervisor.wait_for_epoch.remote(out.epoch, 4.0), timeout=30)
    assert after == out == view_of(group)
    assert group.respawns == [] and not any(n.startswith("agent-1-") for n in named_actors(namespace))


def test_a_slice_the_client_saw_fail_is_not_respawned(launched):
    """A slice-loss error in the client means suspect hardware: its agent's death brings no replacement."""
    group = launched(EVERY_S)
    namespace = group._config.namespace
    view = ray.get(group.supervisor.report_lost.remote([2], "test: its devices failed"), timeout=30)
    assert view.active == ALL4 - {2}, view
    rounds = RespawnerRounds(group)
    group.kill_agent(2)
    until(lambda: "agent-2-0" not in named_actors(namespace), 15, "agent-2-0 dead (its name freed)")
    rounds.wait_for(3, 30)  # rounds of the respawner after the death: none starts a new agent
    assert group.respawns == [] and view_of(group).active == ALL4 - {2}
    assert not any(n.startswith("agent-2-") for n in named_actors(namespace))
    assert ray.get(group.supervisor.respawnable.remote(), timeout=30) == {}
