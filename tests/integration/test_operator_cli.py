"""The operator's commands on a running job: `status` shows its slices, epoch and step, `events` the supervisor's
decisions, `report` the driver's accounting. A multi-process job: what the commands read (the job's stream, written
by the client's accounting and the supervisor) is written by the same code in both modes. (After a finished run,
`report`, `events` and `status` are checked on `elastic demo`'s own run in test_demo_cli.py.)"""

from __future__ import annotations

import json
import os
import threading

import pytest
import ray

from elastic import Faults
from elastic.cli import main

pytestmark = pytest.mark.integration


def _held_at(step_to_hold: int, flag: str):
    """The demo loop, every worker waiting before ``step_to_hold`` until ``flag`` is set in Ray's internal KV."""

    def held(run):
        import time

        from ray.experimental import internal_kv

        from elastic.demos.demo import batch, train_step
        from elastic.demos.processes import BATCH

        state, step_fn = run.state, run.jit(train_step)
        for step in run.steps:
            if step == step_to_hold:
                deadline = time.monotonic() + 120
                while not internal_kv._internal_kv_exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
            state, loss = step_fn(state, run.shard_batch(batch(step, BATCH)))
            run.commit(state, loss=loss)
        return state

    return held


@pytest.mark.timeout(240)
def test_status_events_and_report_of_a_running_multi_process_job(ray_local, monkeypatch, capsys):
    """The same commands on a multi-process job (a worker process per slice, one SIGKILLed at step 8), while its
    workers are held at step 20: the driver's accounting and the supervisor's decisions are in the job's stream."""
    import time

    from ray.experimental import internal_kv

    from elastic import ElasticJob, Processes
    from elastic.demos.demo import init_state
    from elastic.demos.processes import ProcessDemoSpec, process_config

    flag = f"operator-cli-hold-{os.getpid()}"
    spec = ProcessDemoSpec(steps=30, num_slices=3, job_name="status-processes")
    job = ElasticJob(
        process_config(spec, processes=Processes(replace_lost=False, standby=False)),
        init_fn=init_state,
        faults=Faults().kill_slice(2, at_step=8),
    )
    box: dict = {}

    def work() -> None:
        with job:
            box["result"] = job.run(_held_at(20, flag))

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while (not job.ledger.steps or job.ledger.steps[-1] < 19) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.ledger.steps and job.ledger.steps[-1] == 19, "the job did not reach step 20"
        monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        capsys.readouterr()
        assert main(["status", "--json", "--job", "status-processes"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert main(["events", "--json", "--job", "status-processes"]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert main(["report", "--json", "--job", "status-processes"]) == 0
        report = json.loads(capsys.readouterr().out)
    finally:
        internal_kv._internal_kv_put(flag, b"1")
        worker.join(120)
        internal_kv._internal_kv_del(flag)
    # gloo may take the killed worker's ring neighbour with it (counted as survivors_lost; see test_processes):
    # then a second Shrink and recovery follow, and one slice is left
    second = status["slices"] != [0, 1]
    assert status["state"] == "running" and 2 not in status["slices"] and status["slices"], status
    assert status["epoch"] == 2 + second, status
    assert status["step"] is not None and 5 <= status["step"] <= 20, status  # progress: at most 5 s old
    # a neighbour lost while the survivors re-form is part of that recovery: one recovery or two
    assert 1 <= status["recoveries"] <= 1 + second and status["failures"] >= 1, status
    decisions = [r["decision"] for r in records if r["kind"] == "view"]
    assert decisions == ["Grow", "Shrink"] + ["Shrink"] * second, decisions
    lost = [r for r in records if r["kind"] == "health" and not r["healthy"]]
    # the worker was its agent: Ray's death notice of it, or the client's loss report when that arrives first
    assert lost and lost[0]["slice"] == 2, lost
    assert "agent died" in lost[0]["cause"] or "client report" in lost[0]["cause"], lost
    assert 1 <= report["recoveries"] <= 1 + second, report  # as the status's
    assert box["result"].report.steps_committed == 30
