"""Multi-controller mode under the failures that are not a clean SIGKILL: a worker hung inside the step (its
process stopped, so its peers' collective waits on it), and a real Ray node removed with the workers on it, then
a node added back for the group to grow on."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import ray

from elastic.config import Policy
from elastic.demos.demo import max_abs_diff
from elastic.demos.processes import McDemoSpec, ProcessFaults, init_state, loop, reference_params
from elastic.placements.mc_driver import McConfig, McDriver

from .helpers import JoinGate, gated_mc_loop
pytestmark = pytest.mark.integration


def _assert_exact(report: dict, params: dict, spec: McDemoSpec) -> None:
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0
    assert report["steps_committed"] == spec.steps
    reference, _ = reference_params(spec)
    assert max_abs_diff(params["params"], reference) <= 1e-4
    assert np.isfinite(report["final_loss"])


@pytest.mark.timeout(150)
def test_a_hung_worker_is_killed_and_the_rest_recover_within_a_bound(ray_local) -> None:  # noqa: ANN001
    """Slice 1's process is stopped (SIGSTOP) mid-run: the others' next collective fails on the gloo timeout,
    the stopped one is killed once ``settle_timeout_s`` passed, and the two survivors re-form in place."""
    spec = McDemoSpec(steps=20, num_slices=3, kill_slice=1, kill_at=6, snapshot_every=5)
    config = McConfig(num_steps=spec.steps, num_slices=3, snapshot_every=5, settle_timeout_s=4.0,
                      replace_lost=False, policy=Policy(min_slices=1))
    faults = ProcessFaults(kill_slice=1, kill_at=6, revive_at=None, sig=signal.SIGSTOP)
    with McDriver(config, init_fn=init_state, loop=loop, hooks=(faults,)) as driver:
        stopped_pid = driver.pids[1]
        out = driver.run()
    report = out["report"]
    _assert_exact(report, out["params"], spec)
    events = [e["event"] for e in report["timeline"]]
    assert "worker_signalled" in events and "worker_stuck_killed" in events, events
    assert report["workers_hung_killed"] == 1
    assert report["worker_processes_restarted"] == 0 and report["survivors_lost"] == 0
    assert report["failures_injected"] == 1 and report["recoveries"] == 1
    # bounded: the collective timeout (5 s) + settle (4 s) + re-forming and the first step, not a hang
    assert report["recovery_seconds"] and report["recovery_seconds"][0] < 25.0, report["recovery_seconds"]
    assert _gone(stopped_pid, 15.0), "the stopped process was left behind"


def _gone(pid: int, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


class _NodeFaults:
    """At ``remove_at``, remove the node under slice ``slice_index``'s worker (taking every worker on it) and add
    a new node at once, where the replacement processes start."""

    def __init__(self, cluster, *, slice_index: int, remove_at: int) -> None:  # noqa: ANN001
        self.cluster, self.slice, self.remove_at = cluster, slice_index, remove_at
        self.removed: list[int] = []

    def __call__(self, driver: McDriver, step: int) -> None:
        if not self.removed and step >= self.remove_at:
            node_id = driver._nodes[self.slice]
            self.removed = sorted(s for s, n in driver._nodes.items() if n == node_id and s in driver.workers)
            (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
            driver.record_fault("node removed", self.removed)
            self.cluster.remove_node(node)
            self.cluster.add_node(num_cpus=1, resources={"mc_host": 2})


@pytest.mark.timeout(300)
def test_a_removed_node_takes_its_workers_and_the_group_grows_back_on_a_new_one(tmp_path) -> None:  # noqa: ANN001
    from ray.cluster_utils import Cluster

    ray.shutdown()  # leave the shared embedded cluster; this test runs its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(2):  # two hosts of two worker processes each
            cluster.add_node(num_cpus=1, resources={"mc_host": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        spec = McDemoSpec(steps=30, num_slices=4, snapshot_every=5)
        config = McConfig(num_steps=spec.steps, num_slices=4, snapshot_every=5, settle_timeout_s=10.0,
                          resources_per_worker={"mc_host": 1}, policy=Policy(min_slices=1, repair_timeout_s=120.0))
        gate = str(tmp_path / "gate")
        faults = _NodeFaults(cluster, slice_index=1, remove_at=6)
        with McDriver(config, init_fn=init_state, loop=gated_mc_loop(gate, 20), hooks=(faults, JoinGate(gate))) \
                as driver:
            nodes = dict(driver._nodes)
            out = driver.run()
        report = out["report"]
        assert len(set(nodes.values())) == 2 and len(faults.removed) == 2  # the scheduler put two on each host
        _assert_exact(report, out["params"], spec)
        assert report["failures_injected"] == 1 and report["recoveries"] >= 1 and report["grows"] >= 1
        assert report["min_slices_seen"] <= 2 and report["slices_final"] == 4
        survivors = [s for s in range(4) if s not in faults.removed]
        started = next(e for e in report["timeline"] if e["event"] == "workers_started")["pids"]
        lost = {e["slice"] for e in report["timeline"] if e["event"] == "worker_lost"}
        for s in survivors:
            if s not in lost:  # a survivor gloo did not abort kept its process
                assert report["worker_pids"][s] == started[s]
        assert report["worker_processes_restarted"] == 0
        assert report["survivors_lost"] == len(lost - set(faults.removed))
        grown = [e for e in report["timeline"] if e["event"] == "group_formed"][-1]
        assert grown["members"] == [0, 1, 2, 3]
    finally:
        ray.shutdown()
        cluster.shutdown()


# -- state sharded across slices: a worker and the holder of its buddy copies die together -------------------

ROWS = 12  # splits over 4 and 2 slices
STEPS = 40


def _sharded_init(key):  # noqa: ANN001, ANN202
    import jax

    return {"w": jax.random.normal(key, (ROWS, 4))}


def _sharded_specs(mesh):  # noqa: ANN001, ANN202
    from jax.sharding import PartitionSpec

    return {"w": PartitionSpec("replica")}  # each slice holds its own rows only


def _sharded_step(state, x):  # noqa: ANN001, ANN202
    return {"w": state["w"] * 0.9 + 0.1 * x.mean()}


def _sharded_loop(run):  # noqa: ANN001, ANN202
    from elastic.demos.demo import batch

    state, step_fn = run.state, run.jit(_sharded_step)
    for step in run.steps:
        state = step_fn(state, run.shard_batch(batch(step, 48)["x"]))
        run.commit(state)
    from jax.sharding import NamedSharding, PartitionSpec

    return run.jit(lambda s: s, out_shardings=NamedSharding(run.mesh, PartitionSpec()))(state)  # gathered, to check


def _sharded_reference(steps: int) -> np.ndarray:
    import jax

    from elastic.demos.demo import batch

    state = _sharded_init(jax.random.key(0))
    for step in range(steps):
        state = _sharded_step(state, batch(step, 48)["x"])
    return np.asarray(state["w"])


class _KillTwo:
    """SIGKILL slices 1 and 2 together at ``at``: slice 2 held slice 1's buddy copies."""

    def __init__(self, at: int) -> None:
        self.at, self.done = at, False

    def __call__(self, driver: McDriver, step: int) -> None:
        if not self.done and step >= self.at:
            self.done = True
            driver.kill_worker(1)
            driver.kill_worker(2)


def _sharded_job(node_store: bool) -> dict:
    config = McConfig(num_steps=STEPS, num_slices=4, snapshot_every=5, node_store=node_store,
                      policy=Policy(min_slices=1))
    with McDriver(config, init_fn=_sharded_init, loop=_sharded_loop, shardings_fn=_sharded_specs,
                  hooks=(_KillTwo(8),)) as driver:
        root = driver._store_root
        out = driver.run()
    assert root is None or not os.path.exists(root), "the node store outlived the job"
    return out


@pytest.mark.timeout(150)
def test_new_processes_take_over_the_snapshots_their_dead_predecessors_left_on_the_node(ray_local) -> None:  # noqa: ANN001
    out = _sharded_job(node_store=True)
    report = out["report"]
    assert report["restored_from_node_store"] >= 1, report
    assert report["duplicate_steps"] == 0 and report["skipped_steps"] == 0 and report["steps_committed"] == STEPS
    assert report["worker_processes_restarted"] == 0 and report["slices_final"] == 4
    adopted = next(e for e in report["timeline"] if e["event"] == "node_store_adopted")
    assert adopted["step"] > 0  # a snapshot before the kill, whole again with the predecessors' files
    w = np.asarray(out["params"]["w"])
    np.testing.assert_allclose(w, _sharded_reference(STEPS), rtol=0, atol=1e-5)


@pytest.mark.timeout(150)
def test_without_the_node_store_losing_a_shard_and_its_copy_is_a_clear_error(ray_local) -> None:  # noqa: ANN001
    from elastic.errors import ElasticError

    with pytest.raises(ElasticError, match=r"do not hold the whole state of any step: slice\(s\) \[1, 2\]"):
        _sharded_job(node_store=False)
