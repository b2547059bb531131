"""A multi-process job leasing its slices from a pool (``ElasticConfig(pool=..., processes=...)``) on a real Ray:
workers start on the lent slices only; another job's higher-priority lease takes one by notice (its worker leaves at
a step boundary and exits 0, nothing recomputed), and when that job ends the slice is lent back, a new worker starts
on it and the job grows onto it; the final parameters match a plain run's."""

from __future__ import annotations

import threading

import pytest

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


@pytest.fixture
def pool(ray_local, request, monkeypatch):
    token = credential.new_token()
    name = f"mp{abs(hash(request.node.nodeid)) % 10**8}"
    op = start_pool(name, SLICES, token, users=["alice", "bob"])
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
        find_pool(name, user_credential(token, "bob"), user="bob"), JobSpec(name="high", user="bob", priority=9)
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
        result = job.run(paced_loop(0.25))
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
    assert op.call("status")["free"] == list(range(SLICES)), "the job gave every slice back at its end"
    params, _ = reference_params(spec)
    assert max_abs_diff(result.state["params"], params) <= 1e-4
