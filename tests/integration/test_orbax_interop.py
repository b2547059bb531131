"""Orbax interop: a job starts from a user's existing Orbax checkpoint and writes one at the end; bad paths and
mismatched trees are refused at construction, and nothing already saved is overwritten."""

from __future__ import annotations

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from elastic import ConfigError, ElasticJob, Faults
from elastic.control.orbax_io import checkpoint_step
from elastic.demos.demo import batch, init_params, loss_fn

from .helpers import config, max_abs_diff

pytestmark = pytest.mark.integration

OPT = optax.adam(1e-2)


def init_state(key):
    params = init_params(key)
    return {"params": params, "opt": OPT.init(params), "key": jax.random.key(7)}


@jax.jit
def train_step(state, data):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], data)
    updates, opt = OPT.update(grads, state["opt"], state["params"])
    return {
        "params": optax.apply_updates(state["params"], updates),
        "opt": opt,
        "key": jax.random.split(state["key"])[0],
    }, loss


def loop(run):
    state, step_fn = run.state, run.guard(train_step)
    for step in run.steps:
        state, loss = step_fn(state, run.shard_batch(batch(step, 48)))
        run.commit(state, loss=loss)
    return state


def plain(state, first: int, count: int):
    for step in range(first, first + count):
        state, _ = train_step(state, batch(step, 48))
    return state


def users_checkpoint(tmp_path, steps: int = 7):
    """What a user arrives with: a CheckpointManager directory whose newest step holds the train state."""
    state = plain(init_state(jax.random.key(3)), 0, steps)
    with ocp.CheckpointManager(tmp_path / "ckpts") as manager:
        manager.save(steps, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    return tmp_path / "ckpts", state


@pytest.mark.timeout(180)
def test_a_job_starts_from_an_orbax_checkpoint_survives_a_loss_and_writes_one_at_the_end(ray_local, tmp_path):
    root, saved = users_checkpoint(tmp_path)
    assert checkpoint_step(root) == 7
    cfg = config("orbax-interop", num_steps=27)  # the run continues at the checkpoint's step 7, up to step 27
    job = ElasticJob(
        cfg,
        init_fn=init_state,
        init_from=root,
        save_final_to=tmp_path / "final",
        faults=Faults().kill_slice(2, at_step=12),
    )
    with job:
        result = job.run(loop)
    r = job.report
    assert r.recoveries == 1 and r.extra["continued_from_step"] == 7
    assert r.steps_committed == 27 and r.duplicate_steps == 0 and r.skipped_steps == 0  # 0..6 the checkpoint's
    assert min(e["step"] for e in r.restores) >= 10  # restored from a snapshot of this run, never before step 7
    expected = plain(saved, 7, 20)  # the user's run continued for 20 more steps, without the library
    assert max_abs_diff(result.state["params"], expected["params"]) < 1e-5
    assert np.array_equal(jax.random.key_data(result.state["key"]), jax.random.key_data(expected["key"]))
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), result.state)
    written = ocp.StandardCheckpointer().restore(tmp_path / "final", target)  # plain Orbax reads it back
    assert max_abs_diff(written["params"], result.state["params"]) == 0.0
    assert "saved_final" in [e["event"] for e in job.timeline.events]


def test_bad_checkpoints_and_targets_are_refused_at_construction(tmp_path):
    root, _ = users_checkpoint(tmp_path, steps=1)
    cfg = config("orbax-bad", num_steps=10)

    def other_state(key):
        state = init_state(key)
        state["params"]["w1"] = jax.numpy.zeros((16, 32))
        del state["params"]["b2"]
        return state

    with pytest.raises(ConfigError, match=r"does not match init_fn's state: .*b2.*missing.*|.*w1.*\(16, 64\)"):
        ElasticJob(cfg, init_fn=other_state, init_from=root)
    with pytest.raises(ConfigError, match="is not a directory"):
        ElasticJob(cfg, init_fn=init_state, init_from=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no single Orbax pytree checkpoint"):
        ElasticJob(cfg, init_fn=init_state, init_from=tmp_path / "empty")
    with pytest.raises(ConfigError, match="exists: choose a new directory"):
        ElasticJob(cfg, init_fn=init_state, save_final_to=root)
    with pytest.raises(ConfigError, match="checkpoint of step 1: the run continues from there, so num_steps"):
        ElasticJob(config("orbax-bad", num_steps=1), init_fn=init_state, init_from=root)
    assert checkpoint_step(root) == 1  # still there, untouched


def test_a_job_from_a_manager_root_whose_newest_step_is_120_first_commits_step_120(ray_local, tmp_path):
    """The issue's case as written: a CheckpointManager root holding steps 100 and 120; the job continues at the
    newest, so its first committed step is 120 (not 0, and not 100)."""
    state = plain(init_state(jax.random.key(3)), 0, 100)
    with ocp.CheckpointManager(tmp_path / "ckpts") as manager:
        manager.save(100, args=ocp.args.StandardSave(state))
        manager.save(120, args=ocp.args.StandardSave(plain(state, 100, 20)))
        manager.wait_until_finished()
    committed: list[int] = []
    job = ElasticJob(
        config("orbax-120", num_steps=124),
        init_fn=init_state,
        init_from=tmp_path / "ckpts",
        on_step=lambda step, metrics, run: committed.append(step),
    )
    with job:
        job.run(loop)
    assert committed[0] == 120 and committed == [120, 121, 122, 123]
    assert job.report.extra["continued_from_step"] == 120
