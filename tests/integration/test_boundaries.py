"""Step boundaries belong to run.steps: a membership change never skips the user's code after commit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic import ElasticJob, Faults, Run

from .helpers import config

pytestmark = pytest.mark.integration


def test_code_after_commit_runs_on_grow_and_shrink_steps(ray_local):
    after_commit: list[tuple[int, int]] = []  # (step, epoch) recorded after each commit returned
    faults = Faults().silence_agent(1, at_step=6).revive_slice(1, at_step=14)

    def loop(run: Run):
        state = run.state
        step_fn = run.jit(lambda s: {"w": s["w"] + 1.0})
        for step in run.steps:
            state = step_fn(state)
            run.commit(state)
            after_commit.append((step, run.epoch))  # a loop that logs after commit
            if step in (7, 14):  # hold this step until the client has seen the supervisor's new view
                job._watcher.wait_for(lambda v, e=run.epoch: v.epoch > e, 30, what="the next view")
        return state

    job = ElasticJob(config("boundary", num_steps=24), init_fn=lambda key: {"w": jnp.zeros((8,))}, faults=faults)
    with job:
        result = job.run(loop)
    r = result.report
    events = [e["event"] for e in r.timeline]
    assert "shrink" in events and "grow" in events, events  # supervisor-led shrink (silent agent), then grow
    assert r.steps_recomputed == 0 and r.duplicate_steps == 0 and r.skipped_steps == 0
    assert [s for s, _ in after_commit] == list(range(24)), after_commit  # every step, once, in order
    epochs = [e for _, e in after_commit]
    assert len(set(epochs)) == 3  # three passes, each ended at a boundary after the logging ran
    assert np.asarray(jax.device_get(result.state["w"])).tolist() == [24.0] * 8
