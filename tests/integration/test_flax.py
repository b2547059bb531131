"""Flax jobs end to end on a real local Ray: NNX state (typed-key RNG stream, BatchNorm statistics) through a
shrink and a grow, equal to plain NNX on the same devices; the in-place trap refused inside a job; the Linen example
verified through its command line, the NNX one through its command line in multi-process mode."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from elastic import ConfigError, ElasticConfig, ElasticJob, Faults, Policy
from elastic.examples import flax_nnx as example
from elastic.examples.reference import Placements, run_reference

pytestmark = pytest.mark.integration


def _config(job_name: str, **overrides) -> ElasticConfig:
    base = dict(
        job_name=job_name,
        simulated=True,
        num_slices=4,
        devices_per_slice=2,
        num_steps=16,
        snapshot_every=5,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=Policy(min_slices=2, repair_timeout_s=30.0),
    )
    return ElasticConfig(**{**base, **overrides})


def joined() -> dict[str, str]:
    """This process's environment with RAY_ADDRESS naming its Ray cluster: an example run there joins it (as a job
    submitted to a cluster does) instead of starting an embedded one of its own."""
    import os

    import ray

    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


@pytest.mark.timeout(120)
def test_nnx_rng_stream_and_batch_stats_survive_a_shrink(ray_local):
    """The NNX example's model and loop in this process (its command line runs in multi-process mode below): a slice
    lost and brought back; every leaf equals plain NNX over the same devices at the same steps."""
    adapter, placements = example.make_adapter(), Placements()
    job = ElasticJob(
        _config("flax-nnx-shrink"),
        init_fn=adapter.init_fn,
        shardings_fn=adapter.shardings_fn,
        faults=Faults().kill_slice(1, at_step=7).revive_slice(1, at_step=11),
        on_step=placements,
    )
    with job:
        result = job.run(example.make_loop(adapter))
    report = result.report
    assert report.recoveries == 1 and report.steps_recomputed == 1  # 5 again (6 was in flight)
    assert report.min_slices_seen == 3 and report.grows == 1 and report.slices_final == 4  # and back
    reference = run_reference(job, placements, example.make_reference_step())  # plain NNX, same devices and steps
    assert example.max_abs_state_diff(result.state, reference) == 0.0
    got, ref_model = adapter.module(result.state), adapter.module(reference)
    key = got.dropout1.rngs.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)  # a typed key, restored as one
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(ref_model.dropout1.rngs.key[...]))
    assert int(got.dropout1.rngs.count[...]) == 16  # one draw per committed step, none lost or repeated
    for name in ("mean", "var"):
        stat = getattr(got.batch_norm1, name)[...]  # BatchNorm running statistics
        assert np.array_equal(stat, getattr(ref_model.batch_norm1, name)[...]) and float(np.abs(stat).max()) > 0
    assert got.linear1.kernel[...].sharding.spec == PartitionSpec(None, "local")  # the annotation, after the moves
    assert len(got.linear1.kernel[...].sharding.device_set) == 8


@pytest.mark.timeout(60)
def test_run_jit_refuses_the_in_place_step_inside_a_job(ray_local):
    adapter = example.make_adapter()

    def loop(run):
        run.jit(example.train_step)  # the tutorial's @nnx.jit step, straight into run.jit

    with ElasticJob(
        _config("flax-nnx-trap", num_steps=4), init_fn=adapter.init_fn, shardings_fn=adapter.shardings_fn
    ) as job:
        with pytest.raises(ConfigError, match=r"nnx\.jit function.*NnxAdapter"):
            job.run(loop)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", ["elastic.examples.flax_linen"])  # NNX: the tests above and below
def test_example_runs_and_verifies(module, ray_local):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--json", "--verify"],
        capture_output=True,
        text=True,
        timeout=110,
        stdin=subprocess.DEVNULL,
        env=joined(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold one JSON object, got: {proc.stdout[-2000:]}"
    out = json.loads(lines[0])
    assert out["max_abs_param_diff_vs_reference"] <= 1e-6
    assert out["failures_injected"] == 1 and out["recoveries"] == 1 and out["grows"] == 1
    assert out["slices_initial"] == out["slices_final"] == 4 and out["min_slices_seen"] == 3
    assert out["steps_committed"] == 40 and out["duplicate_steps"] == 0 and out["skipped_steps"] == 0
    assert out["final_loss"] < 1.0 and out["eval_accuracy"] > 0.5  # it trained (the trap would leave ~2.3)


@pytest.mark.timeout(240)
def test_the_nnx_example_in_multi_process_mode_matches_a_replay_bit_for_bit(ray_local):
    """The same example with a worker process per slice (3 slices; slice 1's process SIGKILLed, the survivors
    re-forming in place): every leaf equals, bit for bit, plain NNX replayed in plain processes over the same slices
    at the same steps. (A new process joining is the demo's and test_processes.py's, and the standby group
    test_processes.py's; here they would double the test's time.)"""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic.examples.flax_nnx",
            "--mode",
            "multi-process",
            "--json",
            "--verify",
            "--steps",
            "12",
            "--kill-at",
            "5",
            "--revive-at",
            "12",
            "--slices",
            "3",
            "--no-standby",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        stdin=subprocess.DEVNULL,
        env=joined(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == "multi-process" and out["max_abs_param_diff_vs_reference"] == 0.0
    lost = out["survivors_lost"]  # gloo may take the killed worker's ring neighbour too (see test_processes)
    assert lost <= 1 and 1 <= out["recoveries"] <= 1 + lost and out["grows"] <= lost, out
    assert 1 <= out["slice_moves"] <= 1 + 2 * lost, out  # the loss; the neighbour's loss and its replacement
    assert out["restores"][0]["tier"] == "memory" and out["worker_processes_restarted"] == 0
    assert out["steps_committed"] == 12 and out["duplicate_steps"] == 0 and out["skipped_steps"] == 0
