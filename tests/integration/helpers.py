"""Small jobs for the integration tests: a tiny model and a loop that records what each step consumed."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elastic import ElasticConfig, ElasticJob, Faults, Policy, Run, Tiers, Trainer, optax_step
from elastic.demos.demo import batch, init_params, loss_fn


def config(job_name: str, **overrides) -> ElasticConfig:
    """A small simulated job. No keeper tier unless ``tiers`` names one: a keeper is a Ray actor process of its own
    (about a CPU-second to start), and the tests of that tier ask for it."""
    base = dict(
        job_name=job_name,
        simulated=True,
        num_slices=4,
        devices_per_slice=2,
        num_steps=40,
        snapshot_every=5,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=Policy(min_slices=2, repair_timeout_s=30.0),
        tiers=Tiers(keeper_every=0),
    )
    base.update(overrides)
    return ElasticConfig(**base)


def trainer(job_name: str, faults: Faults | None = None, *, global_batch: int = 48, **overrides) -> Trainer:
    return Trainer(
        init_fn=init_params,
        step_fn=optax_step(loss_fn, optax.adam(1e-2)),
        batch_fn=lambda step: batch(step, global_batch),
        config=config(job_name, **overrides),
        faults=faults,
    )


def max_abs_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def ledger_job(job_name: str, faults: Faults | None = None, *, on_step=None, **overrides) -> tuple[ElasticJob, object]:
    """A wrapped user loop whose state records, per step, how often it was applied and which batch it ate.

    Exactly-once holds iff ``applied`` is all ones and ``batch_of`` is 0..N-1 at the end.
    """
    cfg = config(job_name, **overrides)
    n = cfg.num_steps

    def init(key):
        return {
            "applied": jnp.zeros((n,), jnp.int32),
            "batch_of": jnp.full((n,), -1, jnp.int32),
            "w": jax.random.normal(key, (8,)),
        }

    @jax.jit
    def step_fn(state, step, batch_id, batch):
        return {
            "applied": state["applied"].at[step].add(1),
            "batch_of": state["batch_of"].at[step].set(batch_id),
            "w": state["w"] * 0.99 + batch.mean(),
        }

    def loop(run: Run):
        state = run.state
        step_jit = run.guard(step_fn)
        for step in run.steps:
            batch_id = step  # data addressed by step
            data = run.shard_batch(np.full((48,), float(batch_id), np.float32))
            state = step_jit(state, step, batch_id, data)
            run.commit(state, batch=batch_id)
        return state

    return ElasticJob(cfg, init_fn=init, faults=faults, on_step=on_step), loop


def silence(cause: str) -> float:
    """The silence (seconds) a supervisor counted when it dropped a slice for it, read from the health cause
    (``no heartbeat for 1.6s ...``): the supervisor's own measure, which leaves out time it did not run itself."""
    found = re.search(r"no heartbeat for ([0-9.]+)s", cause)
    assert found, f"not a drop for silence: {cause!r}"
    return float(found.group(1))
