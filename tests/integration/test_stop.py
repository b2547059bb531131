"""A job asked to stop (``ElasticJob.stop``, or its ``stop_signal`` to the driver) saves its state to the persistent
tier at the next step boundary and returns; the same job started again resumes there, nothing recomputed, every
step applied exactly once."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from elastic import ElasticJob, Tiers
from elastic.control.teardown import cleanup

from .helpers import config, ledger_job

pytestmark = pytest.mark.integration

STEPS = 30


def test_a_signal_to_the_driver_saves_to_orbax_at_a_step_boundary_and_a_new_run_resumes_there(ray_local, tmp_path):
    name = "stop-on-signal"
    tiers = Tiers(keeper_every=0, persistent_dir=str(tmp_path), persistent_every=10)
    _, loop = ledger_job(name, num_steps=STEPS)
    init = ledger_job(name, num_steps=STEPS)[0].init_fn

    def on_step(step, metrics, run):
        if step == 12:  # what a scheduler does before it ends the job (Slurm's --signal=B:TERM@secs)
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = config(name, num_steps=STEPS, tiers=tiers)
    before = signal.getsignal(signal.SIGTERM)
    with ElasticJob(cfg, init_fn=init, on_step=on_step, stop_signal="SIGTERM") as job:
        first = job.run(loop)
    assert signal.getsignal(signal.SIGTERM) is before  # the job's handler was the run's only
    stopped = first.report.stopped
    assert stopped is not None and stopped["at_step"] == stopped["persisted_step"], first.report
    at = stopped["at_step"]
    assert 13 <= at < STEPS and at % 10, stopped  # the next boundary, not a persistent_every step
    assert first.report.steps_committed == at and first.report.skipped_steps == 0, first.report
    assert np.array_equal(np.asarray(first.state["applied"])[:at], np.ones(at, np.int32))
    assert not np.asarray(first.state["applied"])[at:].any()
    cleanup(name)

    job, loop = ledger_job(name, num_steps=STEPS, tiers=tiers)
    with job:
        job.stop("asked before the run")  # a stop asked before run begins holds at its first boundary
        again = job.run(loop)
    assert again.report.stopped["at_step"] == at + 1, again.report  # one step, then stopped again
    assert again.report.restores[0] == {**again.report.restores[0], "step": at, "tier": "persistent"}, again.report
    cleanup(name)

    job, loop = ledger_job(name, num_steps=STEPS, tiers=tiers)
    with job:
        last = job.run(loop)
    r = last.report
    assert r.stopped is None and r.restores[0]["step"] == at + 1 and r.restores[0]["tier"] == "persistent", r
    assert r.steps_committed == STEPS and r.duplicate_steps == 0 and r.skipped_steps == 0, r
    assert np.array_equal(np.asarray(last.state["applied"]), np.ones(STEPS, np.int32))
    assert np.array_equal(np.asarray(last.state["batch_of"]), np.arange(STEPS, dtype=np.int32))
