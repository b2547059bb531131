"""Promise 5: bad configuration or input fails at once, says what to fix, and loses nothing saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from elastic import ConfigError, ElasticConfig, ElasticError, ElasticJob, Faults, Policy, Processes, Trainer

from .helpers import config, ledger_job


def _init(key):
    return {"w": jnp.zeros((24, 4)), "b": jnp.zeros((4,))}


def test_min_slices_above_slice_count():
    with pytest.raises(ConfigError, match=r"min_slices=5 is above num_slices=4.*lower min_slices"):
        ElasticConfig(num_slices=4, policy=Policy(min_slices=5))


def test_state_structure_not_matching_shardings_fails_before_anything_starts(ray_local):
    cfg = config("bad-structure")
    with pytest.raises(ConfigError, match="one sharding or PartitionSpec per array leaf"):
        ElasticJob(cfg, init_fn=_init, shardings_fn=lambda mesh: {"w": P()})
    # It failed before launching anything: on a connected cluster, no supervisor exists for the job.
    assert ray_local.is_initialized()
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray_local.get_actor("supervisor", namespace=cfg.namespace)


def test_leaf_that_does_not_split_over_the_mesh():
    with pytest.raises(ConfigError, match=r"state leaf \['b'\] of shape \(4,\) does not split"):
        ElasticJob(
            config("bad-split"),
            init_fn=_init,
            shardings_fn=lambda mesh: {"w": P(("replica", "local")), "b": P(("replica", "local"))},
        )


def test_too_few_devices_names_the_flag():
    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=16"):
        ElasticJob(config("too-big", num_slices=8, devices_per_slice=2), init_fn=_init)


def test_real_devices_that_do_not_fit_say_what_to_set():
    """``simulated=False`` (the default): the 8 devices jax sees here cannot be 8 slices of 2."""
    with pytest.raises(ConfigError) as info:
        ElasticJob(config("too-big-real", simulated=False, num_slices=8, devices_per_slice=2), init_fn=_init)
    msg = str(info.value)
    assert "\n" not in msg and "needs 16 devices but jax sees 8 cpu devices" in msg
    assert "num_slices=4, devices_per_slice=2" in msg and "simulated=True" in msg


def test_workers_the_cluster_cannot_hold_fail_at_start_in_one_line(ray_local):
    """Multi-process mode: four workers of one GPU each on a cluster with none fail at ``start``, naming the
    setting, instead of waiting out the start-up timeout for workers Ray can never place."""
    cfg = config("no-gpus", num_slices=4, devices_per_slice=2, processes=Processes(resources_per_worker={"GPU": 1}))
    job = ElasticJob(cfg, init_fn=_init)
    with pytest.raises(ConfigError) as info:
        job.start()
    msg = str(info.value)
    assert "\n" not in msg and "num_slices=4 workers of {'GPU': 1} need 4 GPU but the cluster has 0" in msg
    assert "processes.resources_per_worker" in msg
    with pytest.raises(ValueError):  # nothing of the job was left behind
        ray_local.get_actor("supervisor", namespace=cfg.namespace)


def test_impossible_faults_are_rejected_at_once():
    with pytest.raises(ConfigError, match="slice 7; slices are 0..3"):
        ElasticJob(config("bad-fault"), init_fn=_init, faults=Faults().kill_slice(7, at_step=1))


def test_loop_that_stops_early_is_an_error_and_keeps_snapshots(ray_local):
    job, _ = ledger_job("early-exit")

    def loop(run):
        state = run.state
        for step in run.steps:
            run.commit(state)
            if step == 7:
                return state
        return state

    with job, pytest.raises(ConfigError, match="returned before committing step 39"):
        job.run(loop)
    assert job.latest_snapshot().step == 5


def test_commit_outside_the_steps(ray_local):
    job, _ = ledger_job("stray-commit")
    with job, pytest.raises(ConfigError, match="inside `for step in run.steps`"):
        job.run(lambda run: run.commit(run.state))


def test_bad_batch_mid_run_surfaces_and_keeps_what_was_saved(ray_local):
    def batch_fn(step):
        rows = 48 if step != 17 else 47
        return {"x": np.zeros((rows, 16), np.float32), "y": np.zeros((rows - (step == 17), 1), np.float32)}

    import optax

    from elastic import optax_step
    from elastic.demos.demo import init_params, loss_fn

    trainer = Trainer(
        init_fn=init_params, step_fn=optax_step(loss_fn, optax.sgd(0.1)), batch_fn=batch_fn, config=config("bad-batch")
    )
    with pytest.raises(ConfigError, match=r"batch_fn\(17\) returned leaves with different leading sizes"):
        trainer.fit()
    snap = trainer.job.latest_snapshot()
    # steps 0..16 ran; 16 may still have been in flight (steps_in_flight=2) when step 17's batch was refused
    assert snap.step == 15 and trainer.job.ledger.steps in (list(range(16)), list(range(17)))


def test_plain_step_fn_with_indivisible_batch_after_shrink_is_refused_when_built(ray_local):
    """8 rows split over 8 devices but not over 6 or 4: refused when the Trainer is built (it learns the size from
    batch_fn(0)), not after the shrink; the message says what to do."""

    def step_fn(state, batch):
        return jax.tree_util.tree_map(lambda w: w + batch.mean(), state), {"loss": batch.mean()}

    with pytest.raises(ConfigError, match=r"batch_fn\(0\) returned a batch of 8 rows.*elastic.optax_step"):
        Trainer(
            init_fn=_init,
            step_fn=step_fn,
            batch_fn=lambda step: np.ones((8,), np.float32),
            config=config("plain-indivisible", num_steps=10),
            faults=Faults().kill_slice(0, at_step=3),
        )


def test_leaf_that_would_not_split_after_a_shrink_fails_at_once():
    """16 rows split over 8 devices but not over the 6 left after losing a slice (min_slices=3)."""

    def init(key):
        return {"w": jnp.zeros((16, 4))}

    with pytest.raises(ConfigError, match=r"state leaf \['w'\] of shape \(16, 4\) does not split over the mesh"):
        ElasticJob(
            config("shrink-split", policy=Policy(min_slices=3)),
            init_fn=init,
            shardings_fn=lambda mesh: {"w": P(("replica", "local"))},
        )


@pytest.mark.timeout(120)
def test_a_worker_whose_devices_are_not_its_slice_says_so(ray_local):
    """Multi-process mode on real devices: each worker uses the devices its process sees (here the driver's 8
    forced CPU devices, passed on in XLA_FLAGS), which must number ``devices_per_slice``."""
    cfg = config(
        "mp-real", simulated=False, num_slices=2, devices_per_slice=2, num_steps=4, processes=Processes(standby=False)
    )
    job = ElasticJob(cfg, init_fn=_init)

    def loop(run):
        for _ in run.steps:
            run.commit(run.state)
        return run.state

    with pytest.raises(ElasticError) as info, job:
        job.run(loop)
    assert "worker sees 8 cpu device(s) but devices_per_slice=2: set devices_per_slice=8" in str(info.value)
