"""Standby executables: a recovery onto a mesh compiled ahead compiles nothing; one before the standbys
are ready still recovers (and says the standby was missing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic import ElasticJob, Faults, Run

from .helpers import config

pytestmark = pytest.mark.integration


def make_job(name: str, faults: Faults, marks: list, compiles: list[float], *, wait_standby_at: int | None):
    """``compiles``: the ``compiles`` fixture (conftest), the backend compilations while the test runs."""

    def init(key):
        return {"w": jax.random.normal(key, (24, 16)), "b": jnp.zeros((16,))}

    def train_step(state, x):
        h = jnp.tanh(x @ state["w"] + state["b"])
        return {"w": state["w"] - 0.01 * x.T @ h / x.shape[0], "b": state["b"] - 0.01 * h.mean(0)}

    def loop(run: Run):
        state = run.state
        step_fn = run.jit(train_step)
        for step in run.steps:
            x = run.shard_batch(np.full((48, 24), (step + 1) / 100, np.float32))  # host data, as loaders give
            state = step_fn(state, x)
            run.commit(state)
            marks.append((step, run.epoch, len(compiles)))
            if step == wait_standby_at:
                assert job.controller.wait_for_standbys(60)
        return state

    job = ElasticJob(config(name, num_steps=20), init_fn=init, faults=faults)
    return job, loop


def test_recovery_with_standbys_ready_compiles_nothing(ray_local, compiles):
    marks: list[tuple[int, int, int]] = []  # (step, epoch, compilations so far) at each commit
    job, loop = make_job("standby-ready", Faults().kill_slice(2, at_step=8), marks, compiles, wait_standby_at=5)
    with job:
        result = job.run(loop)
    r = result.report
    assert r.recoveries == 1 and r.min_slices_seen == 3 and r.standby_compiles >= 4
    events = [e["event"] for e in r.timeline]
    assert "standby_ready" in events and "compile_on_move" not in events, events
    # From the last commit before the failure to the first commit on the survivors: no compilation at all
    # (probe, restore, and the step on the 6-device mesh were all compiled ahead).
    before = [m for m in marks if m[1] == marks[0][1]][-1]
    after = next(m for m in marks if m[1] != marks[0][1])
    assert before[0] == 7 and after[2] - before[2] == 0, (before, after, marks)


def test_recovery_before_standbys_are_ready_still_works(ray_local, compiles):
    marks: list[tuple[int, int, int]] = []
    job, loop = make_job("standby-missing", Faults().kill_slice(1, at_step=0), marks, compiles, wait_standby_at=None)
    with job:
        result = job.run(loop)
    r = result.report
    assert r.recoveries == 1 and r.steps_committed == 20 and r.duplicate_steps == 0 and r.skipped_steps == 0
    events = [e["event"] for e in r.timeline]
    assert "compile_on_move" in events, events
