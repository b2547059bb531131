"""A multi-process job leasing its slices from a pool (``ElasticConfig(pool=..., processes=...)``) on a real Ray:
workers start on the lent slices only; another job's higher-priority lease takes one by notice (its worker leaves at
a step boundary and exits 0, nothing recomputed), and when that job ends the slice is lent back, a new worker starts
on it and the job grows onto it. A worker SIGKILLed is reported failed to the pool by the job, which swaps in a
lower-priority job's slice (a spare) that the job grows onto; the killed slice, returned, goes to that other job. The
final parameters match a plain run's."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from elastic.api.job import ElasticJob
from elastic.config import Policy, Processes, Tiers
from elastic.demos.demo import init_state, max_abs_diff
from elastic.demos.processes import ProcessDemoSpec, process_config, reference_params
from elastic.demos.slurm import paced_loop
from elastic.pool import JobSpec
from elastic.pool.access import user_credential
from elastic.pool.client import find_pool, start_pool
from elastic.pool.member import PoolMember
from elastic.supervision import credential, identity
from tests.conftest import until

pytestmark = pytest.mark.integration

N = 40
SLICES = 2
POOL = 4


@pytest.fixture
def pool(ray_local, request, monkeypatch):
    token = credential.new_token()
    name = f"mp{abs(hash(request.node.nodeid)) % 10**8}"
    op = start_pool(name, POOL, token, users=["alice", "bob"])
    monkeypatch.setenv("ELASTIC_POOL_USER", "alice")
    monkeypatch.setenv("ELASTIC_POOL_TOKEN", user_credential(token, "alice"))
    yield name, token, op
    ray_local.kill(op.handle, no_restart=True)
    identity.forget(f"pool-{name}")


@pytest.mark.timeout(180)
def test_a_process_job_leaves_a_reclaimed_slice_and_grows_back(pool) -> None:
    name, token, op = pool
    spec = ProcessDemoSpec(steps=N, num_slices=SLICES, devices_per_slice=1, job_name="pool-mp-low")
    config = process_config(
        spec,
        pool=name,
        min_slices=1,
        policy=Policy(min_slices=1, repair_timeout_s=60.0),
        tiers=Tiers(keeper_every=0),
        processes=Processes(standby=False),
    )
    high = PoolMember(
        find_pool(name, user_credential(token, "bob"), user="bob"),
        JobSpec(name="high", user="bob", priority=9, min_slices=3, max_slices=3),
    )
    steps: list[int] = []
    seen: dict[str, object] = {}

    def scenario() -> None:
        try:
            until(lambda: len(steps) >= 4, 120, "the job's first steps")
            high.join(90)  # lent once the job left the slice at a step boundary
            seen["lent_at"] = len(steps)
            seen["low_then"] = op.call("lease", "pool-mp-low")["slices"]
            until(lambda: len(steps) >= int(seen["lent_at"]) + 4, 60, "steps on the slices left")  # type: ignore[call-overload]
            high.close()
        except BaseException as err:  # noqa: BLE001 - reported by the test's thread below
            seen["error"] = err

    driver = threading.Thread(target=scenario, daemon=True)
    job = ElasticJob(config, init_fn=init_state, on_step=lambda step, metrics, run: steps.append(step))
    driver.start()
    with job:
        result = job.run(paced_loop(0.25, 1.5, SLICES))  # 1.5 s a step below SLICES: time for a new worker
    driver.join(timeout=30)
    assert "error" not in seen, seen.get("error")
    assert seen["low_then"] == [0] and int(seen["lent_at"]) < N - 10, seen  # type: ignore[call-overload]
    r = result.report
    extra = r.to_dict()
    assert (r.notices, r.recoveries, r.steps_recomputed, r.duplicate_steps, r.skipped_steps) == (1, 0, 0, 0, 0), extra
    assert r.steps_committed == N and r.min_slices_seen == SLICES - 1 and r.slices_final == SLICES, extra
    assert r.grows >= 1 and extra["leaving_exit_codes"] == {1: 0}, extra
    (detail,) = r.notice_details
    assert detail["source"] == "pool" and detail["slices"] == [1] and detail["steps_recomputed"] == 0, detail
    assert extra["pool"]["slices_failed"] == [], extra["pool"]
    assert op.call("status")["free"] == list(range(POOL)), "the job gave every slice back at its end"
    params, _ = reference_params(spec)
    assert max_abs_diff(result.state["params"], params) <= 1e-4


class LeavesAtOnce:
    """Another job's side, as its client would hold it: a reclaim is left at once, grants recorded."""

    def __init__(self) -> None:
        self.member: PoolMember | None = None
        self.grants: list[frozenset[int]] = []

    def reclaim(self, slices: frozenset[int], reason: str) -> None:
        assert self.member is not None
        self.member.left(slices)

    def granted(self, slices: frozenset[int]) -> None:
        self.grants.append(slices)


@pytest.mark.timeout(180)
def test_a_killed_worker_is_reported_failed_and_a_spare_swapped_in(pool) -> None:
    name, token, op = pool
    spec = ProcessDemoSpec(steps=N, num_slices=2, devices_per_slice=1, job_name="pool-mp-high")
    config = process_config(
        spec,
        pool=name,
        priority=9,
        min_slices=1,
        spares=1,
        policy=Policy(min_slices=1, repair_timeout_s=60.0),
        tiers=Tiers(keeper_every=0),
        processes=Processes(standby=False),
    )
    hooks = LeavesAtOnce()
    low = PoolMember(
        find_pool(name, user_credential(token, "bob"), user="bob"), JobSpec(name="low", user="bob", max_slices=2), hooks
    )
    hooks.member = low
    steps: list[int] = []
    seen: dict[str, object] = {}

    def scenario() -> None:
        try:
            until(lambda: len(steps) >= 4, 120, "the job's first steps")
            low.join(30)
            low.watch()
            seen["low_before"] = op.call("lease", "low")["slices"]
            pid, _ = ray.get(job.group.agent(1).where.remote(), timeout=30)
            seen["killed_pool_slice"] = op.call("lease", "pool-mp-high")["slices"][1]
            os.kill(pid, signal.SIGKILL)
            until(lambda: op.call("status")["failed"], 60, "the job to report its slice failed")
            until(lambda: len(op.call("lease", "low")["slices"]) == 1, 60, "one of low's slices swapped in for high")
            op.call("slice_returned", seen["killed_pool_slice"])  # its host repaired: the operator says so
            until(lambda: len(op.call("lease", "low")["slices"]) == 2, 60, "the returned slice lent to low")
            seen["low_after"] = op.call("lease", "low")["slices"]
        except BaseException as err:  # noqa: BLE001 - reported by the test's thread below
            seen["error"] = err

    driver = threading.Thread(target=scenario, daemon=True)
    job = ElasticJob(config, init_fn=init_state, on_step=lambda step, metrics, run: steps.append(step))
    driver.start()
    with job:
        result = job.run(paced_loop(0.25, 1.5, SLICES))  # 1.5 s a step below SLICES: time for a new worker
    driver.join(timeout=30)
    low.close()
    assert "error" not in seen, seen.get("error")
    r = result.report
    extra = r.to_dict()
    assert (r.recoveries, r.duplicate_steps, r.skipped_steps, r.steps_committed) == (1, 0, 0, N), extra
    assert r.min_slices_seen == 1 and r.slices_final == 2 and r.grows >= 1, extra
    assert extra["pool"]["slices_failed"] == [1] and extra["pool"]["seconds_below_asked"] > 0, extra["pool"]
    assert seen["low_before"] == [2, 3] and seen["low_after"] == [1, 2] == sorted([2, seen["killed_pool_slice"]]), seen
    assert op.call("status")["free"] == [0, 1, 2, 3] and op.call("status")["failed"] == []
    params, _ = reference_params(spec)
    assert max_abs_diff(result.state["params"], params) <= 1e-4
