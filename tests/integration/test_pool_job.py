"""A single-process job leasing its slices from a pool (ElasticConfig(pool=...)) on a real Ray: another job's lease
takes two of its slices by notice (left at a step boundary, nothing recomputed, the pool killed mid-reclaim and
replayed), gives them back, and the job grows onto them again; a job that starts with fewer slices than it has runs
on the lent ones only; a job at its minimum is suspended to its keepers and resumes from them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import ray

from elastic import Tiers
from elastic.pool import JobSpec
from elastic.pool.access import user_credential
from elastic.pool.client import find_pool, start_pool
from elastic.pool.member import PoolMember
from elastic.supervision import credential, identity
from tests.conftest import until

from .helpers import ledger_job

pytestmark = pytest.mark.integration

N = 40


@pytest.fixture
def pool(ray_local, request, monkeypatch):
    token = credential.new_token()
    name = f"j{abs(hash(request.node.nodeid)) % 10**8}"
    op = start_pool(name, 4, token, users=["alice", "bob"])
    monkeypatch.setenv("ELASTIC_POOL_USER", "alice")
    monkeypatch.setenv("ELASTIC_POOL_TOKEN", user_credential(token, "alice"))
    yield name, token, op
    ray_local.kill(op.handle, no_restart=True)
    identity.forget(f"pool-{name}")


def _other(pool_name: str, token: str, **spec) -> PoolMember:
    """Another job's lease (user bob), as its own client would hold it."""
    return PoolMember(find_pool(pool_name, user_credential(token, "bob"), user="bob"), JobSpec(user="bob", **spec))


def _view(job):
    return ray.get(job.group.supervisor.view.remote(), timeout=30)


def _active(job) -> int:
    return len(_view(job).active)


def test_reclaimed_by_notice_and_given_back(pool) -> None:
    name, token, op = pool
    high = _other(name, token, name="high", priority=9, max_slices=2)
    joined = threading.Event()

    def on_step(step, metrics, run):
        if step == 8:
            threading.Thread(target=lambda: (high.join(60), joined.set()), daemon=True).start()
            until(lambda: _view(job).leaving == {2, 3}, 60, "the pool's reclaim delivered as a notice")
            ray.kill(op.handle, no_restart=False)  # mid-reclaim: Ray restarts it, it replays its log, all goes on
        if step == 16:
            until(joined.is_set, 60, "the slices left and lent to the other job")
            assert op.call("lease", "low")["slices"] == [0, 1]
            high.close()
        if step == 24:
            until(lambda: _active(job) == 4, 60, "the slices given back registered again")

    job, loop = ledger_job("low", on_step=on_step, num_steps=N, pool=name, min_slices=2)
    with job:
        result = job.run(loop)
    np.testing.assert_array_equal(np.asarray(result.state["applied"]), np.ones(N, np.int32))
    r = result.report
    assert (r.notices, r.recoveries, r.steps_recomputed, r.duplicate_steps, r.skipped_steps) == (1, 0, 0, 0, 0), r
    assert r.min_slices_seen == 2 and r.slices_final == 4 and r.grows >= 1
    (detail,) = r.notice_details
    assert detail["source"] == "pool" and detail["slices"] == [2, 3] and detail["steps_recomputed"] == 0
    assert op.call("status")["free"] == [0, 1, 2, 3], "the job gave every slice back at its end"


def test_a_job_starts_on_the_slices_lent_only(pool) -> None:
    name, token, op = pool
    high = _other(name, token, name="high", priority=9, max_slices=2)
    high.join(30)

    def on_step(step, metrics, run):
        if step == 5:
            assert len(run.mesh.devices.flat) == 4, "two slices of two devices: the lent ones"
            high.close()
        if step == 15:
            until(lambda: _active(job) == 4, 60, "the slices lent registered")

    job, loop = ledger_job("late", on_step=on_step, num_steps=N, pool=name, min_slices=2)
    with job:
        result = job.run(loop)
    r = result.report
    assert (r.recoveries, r.steps_recomputed, r.duplicate_steps, r.skipped_steps) == (0, 0, 0, 0), r
    assert r.slices_final == 4 and r.min_slices_seen == 2


def test_a_pool_that_is_not_there_is_one_line(ray_local, monkeypatch) -> None:
    from elastic.errors import ConfigError

    monkeypatch.setenv("ELASTIC_POOL_USER", "alice")
    monkeypatch.setenv("ELASTIC_POOL_TOKEN", "x" * 64)
    job, _ = ledger_job("nopool", num_steps=N, pool="nosuchpool")
    with pytest.raises(ConfigError, match="pool 'nosuchpool' is not running"):
        job.start()


def test_suspended_to_its_keepers_and_resumed(pool) -> None:
    """A higher-priority job needs the minimum of a job at its minimum: the pool suspends it; it saves its state to
    its keepers at a step boundary, releases every slice, waits, and resumes from the keepers when they come back."""
    name, token, op = pool
    high = _other(name, token, name="high", priority=9, min_slices=3, max_slices=3)
    seen: dict = {}

    def other() -> None:  # the other job's client: it runs while the job is suspended, then ends
        high.join(60)
        seen["lease"] = op.call("lease", "low")
        high.close()

    def on_step(step, metrics, run):
        if step == 6:
            threading.Thread(target=other, daemon=True).start()
        elif step == 7:  # the pool's reclaim of every slice is pending before the job's last steps run (unpaced)
            until(lambda: op.call("lease", "low")["leave"], 60, "the pool to reclaim low's slices")

    job, loop = ledger_job(
        "low", on_step=on_step, num_steps=16, pool=name, min_slices=2, max_slices=2, tiers=Tiers()
    )  # suspended to its keepers
    with job:
        result = job.run(loop)
    np.testing.assert_array_equal(np.asarray(result.state["applied"]), np.ones(16, np.int32))
    np.testing.assert_array_equal(np.asarray(result.state["batch_of"]), np.arange(16))
    r = result.report
    assert (r.recoveries, r.steps_recomputed, r.duplicate_steps, r.skipped_steps) == (0, 0, 0, 0), r
    assert seen["lease"]["state"] == "suspended" and seen["lease"]["slices"] == [], seen
    assert [x["tier"] for x in r.restores] == ["keeper"], r.restores
    (suspension,) = r.extra["suspensions"]
    assert "high (priority 9) needs it" in suspension["reason"], suspension
    kinds = [e["event"] for e in job.timeline.events]
    assert kinds.index("suspended") < kinds.index("resumed"), kinds
