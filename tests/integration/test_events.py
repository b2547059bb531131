"""The job's event stream lives in Ray's GCS: a supervisor restarted on another node (its node removed for real)
reads it back, and epochs continue; records are bounded per writer."""

from __future__ import annotations

import uuid

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.config import Policy
from elastic.supervision import events
from elastic.supervision.agent import SliceAgent
from elastic.supervision.supervisor import SUPERVISOR_NAME, Supervisor

from ..conftest import fresh_cluster, until

pytestmark = pytest.mark.integration

TIMEOUT_S, INTERVAL_S = 1.5, 0.1


def _usage(sup):
    try:
        return ray.get(sup.usage.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_a_writer_keeps_its_newest_records_only(ray_local):
    job = f"ev-bound-{uuid.uuid4().hex[:6]}"
    run = events.new_run(job)
    stream = events.EventStream(job, run, "client-1", keep=10)
    for i in range(25):
        stream.append("progress", step=i)
    kept = events.read(job, run, writers=["client-1"])
    assert [r["step"] for r in kept] == list(range(15, 25)) and stream.failed == 0
    again = events.EventStream(job, run, "client-1", keep=10)  # a restarted writer continues the sequence
    assert again.append("progress", step=25)["seq"] == 25
    for _ in range(events.KEEP_RUNS):
        events.new_run(job)
    assert run not in events.runs(job)  # a job keeps its newest runs only
    events.delete(job)
    assert events.runs(job) == [] and events.read(job) == []


@pytest.mark.timeout(120)
def test_records_written_behind_the_caller_land_in_order_by_flush(ray_local):
    """``append_behind`` (the client's timeline and progress: a loop or a recovery never waits for the GCS)
    returns the record at once; ``flush`` returns once all have landed, each under its own seq, in order."""
    job = f"ev-behind-{uuid.uuid4().hex[:6]}"
    run = events.new_run(job)
    stream = events.EventStream(job, run, "client-2", keep=100)
    assert stream.flush(1.0)  # nothing written behind yet
    sent = [stream.append_behind("progress", step=i) for i in range(30)]
    assert [r["seq"] for r in sent] == list(range(30))
    assert stream.flush(30.0)
    kept = events.read(job, run, writers=["client-2"])
    assert [r["step"] for r in kept] == list(range(30)) and stream.failed == 0
    events.delete(job)


@pytest.mark.timeout(240)
def test_the_stream_survives_a_supervisor_restart_on_another_node():
    with fresh_cluster(2, [{"num_cpus": 1, "resources": {"supervisor_host": 1}}] * 2) as (cluster, hosts):
        head = cluster.head_node.node_id
        job = f"ev-node-{uuid.uuid4().hex[:6]}"
        namespace, run = f"elastic-{job}", events.new_run(job)
        sup = Supervisor.options(  # on one of two hosts; Ray restarts it on the other when its host goes
            name=SUPERVISOR_NAME,
            namespace=namespace,
            lifetime="detached",
            resources={"supervisor_host": 0.01},
        ).remote(job, Policy(min_slices=1), TIMEOUT_S, INTERVAL_S / 2, run)
        agents = [
            SliceAgent.options(
                namespace=namespace, scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)
            ).remote(s, 0, sup, INTERVAL_S, job)
            for s in range(4)
        ]
        ray.get([a.start.remote() for a in agents], timeout=60)
        assert ray.get(sup.start.remote(), timeout=30).epoch == 1
        first = ray.get(sup.usage.remote(), timeout=30)["node"]
        (doomed,) = [h for h in hosts if h.node_id == first]
        (spare,) = [h for h in hosts if h.node_id != first]
        ray.kill(agents[3], no_restart=True)
        shrunk = ray.get(sup.wait_for_epoch.remote(1, 20), timeout=40)
        assert shrunk.epoch == 2 and shrunk.active == frozenset({0, 1, 2}), shrunk
        before = events.read(job, run, writers=["supervisor"])

        cluster.remove_node(doomed)  # the supervisor's node dies for real
        moved = until(lambda: _usage(sup), 90, "supervisor restarted on another node")
        assert moved["node"] == spare.node_id
        view = ray.get(sup.view.remote(), timeout=30)
        assert view.epoch == 2 and view.active == frozenset({0, 1, 2}), view  # rebuilt from the stream
        until(lambda: ray.get(sup.usage.remote(), timeout=30)["slices"] == 3, 30, "agents re-registered")
        ray.kill(agents[2], no_restart=True)
        after = ray.get(sup.wait_for_epoch.remote(2, 20), timeout=40)
        assert after.epoch == 3 and after.active == frozenset({0, 1}), after  # epochs continue, not from 0

        mine = events.read(job, run, writers=["supervisor"])
        assert mine[: len(before)] == before  # nothing lost, nothing rewritten
        seqs = [r["seq"] for r in mine]
        assert seqs == list(range(len(mine))), seqs  # the restarted writer continued its sequence
        views = [r["epoch"] for r in mine if r["kind"] == "view"]
        assert views == [1, 2, 3], views
        ray.get(sup.close.remote(), timeout=30)
        for a in [*agents[:2], sup]:
            ray.kill(a, no_restart=True)
        events.delete(job)
