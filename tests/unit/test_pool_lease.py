"""A job's lease as its commits see it (``PoolLease.committed``), against a fake pool: a reclaimed slice goes back once
a step commits without it; a slice lost without a reclaim is reported failed, once; a slice lent but not yet joined
is neither; the report gets the pool's figures at the end; a reclaim of every slice suspends a single-process job,
which releases them all and resumes once its minimum is lent again."""

from __future__ import annotations

from typing import Any

import pytest

import elastic.api.pool_lease as pool_lease
from elastic.config import ElasticConfig, Policy, Processes
from elastic.supervision.membership import View
from tests.conftest import until


class FakePool:
    """The pool's calls a lease makes, answered from a list of held slices (the pool's numbers = the job's here)."""

    def __init__(self, held: list[int]) -> None:
        self.held, self.version = list(held), 1
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _lease(self) -> dict[str, Any]:
        return {
            "state": "running",
            "slices": sorted(self.held),
            "leave": [],
            "why": {},
            "version": self.version,
            "reason": "",
            "seconds_below_asked": 1.5,
        }

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((method, args))
        if method in ("release", "slice_failed"):
            gone = args[1] if method == "release" else [args[0]]
            self.held = [s for s in self.held if s not in gone]
            self.version += 1
        if method == "slice_failed":
            return self.version
        return None if method == "leave" else self._lease()


@pytest.fixture
def lease(monkeypatch):
    def make(held: list[int], *, processes: bool = True) -> tuple[pool_lease.PoolLease, FakePool, dict[str, Any]]:
        fake, extra = FakePool(held), {}
        monkeypatch.setenv("ELASTIC_POOL_USER", "alice")
        monkeypatch.setenv("ELASTIC_POOL_TOKEN", "t" * 64)
        monkeypatch.setattr(pool_lease, "find_pool", lambda *a, **k: fake)
        config = ElasticConfig(
            num_slices=4, pool="p", policy=Policy(min_slices=1), processes=Processes() if processes else None
        )
        out = pool_lease.PoolLease(config, notice=lambda *a: None, spawn=lambda s: None, extra=extra)
        out.join()
        return out, fake, extra

    return make


def _told(fake: FakePool, method: str) -> list[tuple[Any, ...]]:
    return [args for m, args in fake.calls if m == method]


def test_a_reclaim_goes_back_and_a_loss_is_reported_once(lease) -> None:
    job, fake, extra = lease([0, 1, 2])
    assert job.launch_slices == {0, 1, 2}, "multi-process mode starts the lent slices' workers only"
    job.committed(0, View(epoch=1, active=frozenset({0, 1, 2})))
    job.reclaim(frozenset({2}), "high needs it")
    job.committed(1, View(epoch=1, active=frozenset({0, 1, 2})))  # not left yet
    job.committed(2, View(epoch=2, active=frozenset({0, 1})))
    until(lambda: _told(fake, "release"), 10, "the slice given back")
    job.committed(3, View(epoch=3, active=frozenset({0})))  # slice 1 lost, not reclaimed
    job.committed(4, View(epoch=3, active=frozenset({0})))
    until(lambda: _told(fake, "slice_failed"), 10, "the lost slice reported")
    job.close()
    assert [args[1] for args in _told(fake, "release")] == [[2]]
    assert [args[0] for args in _told(fake, "slice_failed")] == [1], "reported once"
    assert extra["pool"] == {"seconds_below_asked": 1.5, "slices_failed": [1]}


def test_a_slice_lent_but_not_joined_yet_is_not_lost(lease) -> None:
    job, fake, extra = lease([0])
    job.committed(0, View(epoch=1, active=frozenset({0})))
    fake.held = [0, 1]  # lent later: the member's map follows the lease
    job.member._take({**fake._lease(), "version": 5}, tell=False)
    job.committed(1, View(epoch=1, active=frozenset({0})))  # its worker still starting
    job.committed(2, View(epoch=2, active=frozenset({0, 1})))
    job.close()
    assert not _told(fake, "slice_failed") and extra["pool"]["slices_failed"] == []


def test_single_process_slices_never_lent_are_not_reported(lease) -> None:
    job, fake, extra = lease([0, 1], processes=False)
    assert job.launch_slices is None, "single-process mode starts every agent, then leaves the slices not lent"
    job.committed(0, View(epoch=1, active=frozenset({0, 1, 2, 3})))
    job.committed(1, View(epoch=2, active=frozenset({0, 1})))
    fake.held = [0, 1, 2]
    job.member._take({**fake._lease(), "version": 5}, tell=False)
    job.committed(2, View(epoch=2, active=frozenset({0, 1})))  # 2 lent again, not joined yet
    job.close()
    assert not _told(fake, "slice_failed") and extra["pool"]["slices_failed"] == []


class FakeController:
    def __init__(self) -> None:
        self.on_suspend: Any = None
        self.asked: list[str] = []

    def request_suspend(self, reason: str) -> None:
        self.asked.append(reason)


def test_a_reclaim_of_every_slice_suspends_a_single_process_job(lease) -> None:
    import threading

    notices, spawned = [], []
    job, fake, _ = lease([0, 1, 2], processes=False)
    job._notice, job._spawn = (lambda *a: notices.append(a[0])), spawned.append
    controller = FakeController()
    job.attach(controller)
    assert controller.on_suspend == job.suspended
    job.reclaim(frozenset({2}), "high needs it")
    assert notices == [{2}] and not controller.asked, "a partial reclaim is a notice"
    job.reclaim(frozenset({0, 1}), "high needs it")
    assert notices == [{2}] and controller.asked == ["pool p: high needs it"], "every slice: the job is suspended"

    out: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: out.update(lent=job.suspended(7, View(epoch=3, active=frozenset({0, 1, 2}))))
    )
    waiter.start()
    until(lambda: fake.held == [], 10, "every slice released")
    assert waiter.is_alive(), "the job waits for its minimum"
    fake.held = [0, 3]  # its minimum lent again: agents started for them, then it resumes
    job.member._take({**fake._lease(), "version": 9})
    waiter.join(10)
    assert out["lent"] == {0, 1} and sorted(spawned) == [0, 1], "the job's own numbers for the slices lent"
    assert notices == [{2}, {2}], "a slice it ran on that was not lent back is left by notice"
    job.close()


def test_a_multi_process_job_is_not_suspended(lease) -> None:
    job, fake, _ = lease([0, 1])
    controller = FakeController()
    job.attach(controller)
    job.reclaim(frozenset({0, 1}), "high needs it")
    assert controller.on_suspend is None and not controller.asked
    job.close()


def test_a_resumed_job_restores_on_the_view_lent_back() -> None:
    from elastic.control.transitions import Machine, Prepare, Resumed, State, transition

    before, after = View(epoch=3, active=frozenset({0, 1, 2})), View(epoch=5, active=frozenset({0, 1}))
    machine, action = transition(Machine(State.RUNNING, before), Resumed(after), 0)
    assert machine == Machine(State.RESTORING, after) and action == Prepare(after, live=False)
    with pytest.raises(ValueError, match="no transition from restoring on Resumed"):
        transition(machine, Resumed(after), 0)
