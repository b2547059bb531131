"""A Grain pipeline's position rides in the snapshot: rolled back with the model on a restore, kept on a live
reshard; every committed step eats the batch a fresh iterator yields at that step, and the model ends where the
library-free reference does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic import ConfigError, ElasticJob, Faults, Run
from elastic.examples.grain_pipeline import Consumed, Examples, init_state, make_loop, train_step
from elastic.examples.reference import run_reference

from .helpers import config, max_abs_diff

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _dataset() -> grain.MapDataset:
    """The IterDataset flavour (the example uses a DataLoader): 400 examples, reshuffled each epoch, endless."""
    return grain.MapDataset.source(Examples()).shuffle(seed=5).repeat(None).batch(48)


def _reference_ids_and_state(job: ElasticJob, consumed: Consumed) -> tuple[dict[int, list[int]], Any]:
    ids: dict[int, list[int]] = {}
    it = iter(_dataset())
    step_jit = jax.jit(train_step)

    def step_fn(state: Any, step: int, mesh: Mesh) -> Any:
        batch = next(it)
        ids[step] = batch["id"].tolist()
        x, y = jax.device_put((batch["x"], batch["y"]), NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
        return step_jit(state, x, y)[0]

    return ids, run_reference(job, consumed, step_fn)


def test_grain_iterator_resumes_exactly_after_a_shrink_with_restore(ray_local):
    consumed = Consumed()
    job = ElasticJob(
        config("data-restore", num_steps=20),
        init_fn=init_state,
        on_step=consumed,
        faults=Faults().kill_slice(2, at_step=8),
    )
    with job:
        result = job.run(make_loop(_dataset(), consumed))
    r = result.report
    assert [x["step"] for x in r.restores] == [5] and r.steps_recomputed > 0, (r.restores, r.steps_recomputed)
    assert r.min_slices_seen == 3 and r.slices_final == 3
    reference_ids, reference = _reference_ids_and_state(job, consumed)
    assert consumed.ids == reference_ids  # each step its batch: nothing skipped, nothing repeated, same order
    assert max_abs_diff(result.state["params"], reference["params"]) <= 1e-6


def test_grain_iterator_keeps_its_position_on_a_live_reshard(ray_local):
    consumed = Consumed()

    def on_step(step: int, metrics: dict[str, Any], run: Run) -> None:
        consumed(step, metrics, run)
        if step in (7, 14):  # hold the step until the client has seen the supervisor's new view
            job._watcher.wait_for(lambda v, e=run.epoch: v.epoch > e, 30, what="the next view")

    job = ElasticJob(
        config("data-live", num_steps=20),
        init_fn=init_state,
        on_step=on_step,
        faults=Faults().silence_agent(1, at_step=6).revive_slice(1, at_step=14),
    )
    loop = make_loop(_dataset(), consumed)
    with job:
        result = job.run(loop)
    r = result.report
    events = [e["event"] for e in r.timeline]
    assert "shrink" in events and "grow" in events, events
    assert r.restores == [] and r.steps_recomputed == 0  # both moves live: no snapshot read back
    assert consumed.moves() == 2
    reference_ids, reference = _reference_ids_and_state(job, consumed)
    assert consumed.ids == reference_ids
    assert max_abs_diff(result.state["params"], reference["params"]) <= 1e-6


def test_an_iterator_without_get_state_is_refused(ray_local):
    def loop(run: Run) -> Any:
        data = run.data(lambda: iter(np.zeros((100, 48, 16), np.float32)))
        for _ in run.steps:
            run.commit(run.state, loss=next(data).sum())
        return run.state

    with ElasticJob(config("data-refused", num_steps=4), init_fn=init_state) as job:
        with pytest.raises(ConfigError) as info:
            job.run(loop)
    for words in ("has no get_state() and set_state(state)", "get_batch(step)"):
        assert words in str(info.value)


def test_the_grain_example_verifies(ray_local):
    import ray

    # on this process's Ray cluster (as a job submitted to a cluster runs), not an embedded one started for it
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    proc = subprocess.run(
        [sys.executable, "-m", "elastic.examples.grain_pipeline", "--json", "--verify"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    out = json.loads(lines[0])
    assert out["max_abs_param_diff_vs_reference"] <= 1e-6
    assert out["examples_skipped"] == 0 and out["examples_repeated"] == 0
    assert out["batches_differing_from_reference"] == 0
    assert out["recoveries"] == 1 and out["grows"] == 1 and out["steps_committed"] == 40
    assert out["restores"][0]["step"] % 5 == 0 and out["steps_recomputed"] > 0  # rolled back mid-epoch
