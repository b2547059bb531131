"""A Ray node drain is a notice: the GCS says a node holding slice 3's agent will go by a deadline; the job leaves
the slice before it (nothing recomputed), the node is removed at the deadline, and a new node's agent brings slice 3
back (a grow)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from ..conftest import fresh_cluster
from .helpers import ledger_job

pytestmark = pytest.mark.integration

N = 24
LEAD_S = 8


def drain(address: str, node_id: str, deadline_s: int) -> None:
    """What ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` sends."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address)
    accepted, why = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim (test)",
        time.time_ns() // 1_000_000 + deadline_s * 1000,
    )
    assert accepted, why


@pytest.mark.timeout(150)
def test_a_ray_node_drain_leaves_the_slice_before_the_node_goes():
    with fresh_cluster(2, [{"num_cpus": 0}]) as (cluster, (host,)):
        seen: dict[str, float] = {}

        def on_step(step, metrics, run):
            if step == 5 and "drained" not in seen:
                seen["drained"] = time.time()
                seen["deadline"] = seen["drained"] + LEAD_S
                drain(cluster.address, host.node_id, LEAD_S)
                left = ray.get(job.group.supervisor.wait_for_epoch.remote(run.epoch, 20), timeout=40)
                seen["left"] = time.time()
                assert 3 not in left.active and 3 in left.leaving, left
            if step == 10 and "back" not in seen:
                assert time.time() < seen["deadline"], "the job reached step 10 after the deadline"
                time.sleep(max(seen["deadline"] - time.time(), 0.0))  # the node goes at its deadline, no earlier
                cluster.remove_node(host)  # kills the raylet and the agent on it
                seen["removed"] = time.time()
                fresh = cluster.add_node(num_cpus=0)  # a new node; its agent brings slice 3 back
                cluster.wait_for_nodes()
                job.group._agent_nodes[3] = fresh.node_id  # the slice's agent goes to the new node
                epoch = ray.get(job.group.supervisor.view.remote(), timeout=30).epoch
                back = threading.Event()

                def revive() -> None:
                    deadline = time.monotonic() + 40
                    while time.monotonic() < deadline:  # until the dead agent is counted gone and the new one in
                        job.group.revive(3)
                        view = ray.get(job.group.supervisor.wait_for_epoch.remote(epoch, 2), timeout=10)
                        if 3 in view.active:
                            back.set()
                            return

                reviver = threading.Thread(target=revive)
                reviver.start()
                reviver.join(45)
                seen["back"] = time.time() if back.is_set() else -1.0

        job, loop = ledger_job("ray-drain", on_step=on_step, num_steps=N)
        head = cluster.head_node.node_id
        job._agent_nodes = {0: head, 1: head, 2: head, 3: host.node_id}
        with job:
            result = job.run(loop)
            events = job.group.events()
    assert seen["back"] > 0, "slice 3 did not come back on the new node"
    assert seen["left"] < seen["deadline"] <= seen["removed"], seen
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed) == (1, 1, 0, 0), r
    assert (r.duplicate_steps, r.skipped_steps, r.steps_committed, r.grows, r.slices_final) == (0, 0, N, 1, 4), r
    (detail,) = r.notice_details
    assert detail["source"] == "ray_drain" and detail["slices"] == [3] and detail["planned"] is True, detail
    notice = next(e for e in events if e["kind"] == "notice")
    assert notice["source"] == "ray_drain" and notice["deadline"] == pytest.approx(seen["deadline"], abs=1.0)
