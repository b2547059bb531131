"""The demo job: a small optax MLP on synthetic data, 4 simulated slices of 2 CPU devices.

Data is addressed by step (``batch(step)``), so a run with failures sees exactly the batches of a
failure-free run. The demo kills a slice mid-run, shrinks to the survivors, brings the slice back and
grows again, then reports what happened; with ``verify`` it also runs the same job without failures
and compares the final parameters.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elastic.api.trainer import Trainer, optax_step
from elastic.chaos.faults import Faults
from elastic.config import ElasticConfig, Policy, Tiers

__all__ = ["DemoSpec", "init_params", "loss_fn", "batch", "run_demo", "max_abs_diff"]

IN, HIDDEN = 16, 64


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    steps: int = 150
    num_slices: int = 4
    devices_per_slice: int = 2
    global_batch: int = 64  # divides 8 devices, not 6: the shrunk run accumulates micro-batches
    kill_slice: int = 1
    kill_at: int = 55
    revive_at: int = 95
    snapshot_every: int = 10
    keeper_every: int = 5  # every 5th snapshot also goes to the keeper actors
    seed: int = 0


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((1,)),
    }


def _forward(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params: dict[str, jax.Array], data: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((_forward(params, data["x"]) - data["y"]) ** 2)


OPTIMIZER = optax.adam(1e-2)  # the demos' optimizer, for loops written by hand (the Trainer builds its own step)


def init_state(key: jax.Array) -> dict[str, Any]:
    """The demo model's parameters and their adam state."""
    params = init_params(key)
    return {"params": params, "opt": OPTIMIZER.init(params)}


def train_step(state: dict[str, Any], data: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
    """One adam step on ``data``; the new state and the loss."""
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], data)
    updates, opt = OPTIMIZER.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


_TEACHER = (np.random.default_rng(1234).normal(size=(IN, 1)) / np.sqrt(IN)).astype(np.float32)


def batch(step: int, size: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """The global batch of ``step``: the same numbers for the same step, on any mesh."""
    rng = np.random.default_rng([seed, step])
    x = rng.normal(size=(size, IN)).astype(np.float32)
    return {"x": x, "y": np.sin(x @ _TEACHER).astype(np.float32)}


def max_abs_diff(a: Any, b: Any) -> float:
    diffs = jax.tree_util.tree_map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


def make_trainer(spec: DemoSpec, *, job_name: str, faults: Faults | None, on_step: Any = None) -> Trainer:
    config = ElasticConfig(
        simulated=True,
        job_name=job_name,
        num_slices=spec.num_slices,
        devices_per_slice=spec.devices_per_slice,
        num_steps=spec.steps,
        snapshot_every=spec.snapshot_every,
        seed=spec.seed,
        policy=Policy(min_slices=max(1, spec.num_slices - 1), repair_timeout_s=60.0),
        tiers=Tiers(keeper_every=spec.keeper_every),
    )
    return Trainer(
        init_fn=init_params,
        step_fn=optax_step(loss_fn, optax.adam(1e-2)),
        batch_fn=lambda step: batch(step, spec.global_batch, spec.seed),
        config=config,
        faults=faults,
        on_step=on_step,
    )


def run_demo(spec: DemoSpec, *, verify: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the demo (and, with ``verify``, its failure-free reference); the JSON-ready summary."""
    from elastic.ops.progress import Progress  # rich is only needed here

    faults = Faults().kill_slice(spec.kill_slice, at_step=spec.kill_at)
    if spec.revive_at is not None and spec.revive_at < spec.steps:
        faults.revive_slice(spec.kill_slice, at_step=spec.revive_at)
    with Progress(spec.steps, enabled=progress, stream=sys.stderr) as bar:
        result = make_trainer(spec, job_name="demo", faults=faults, on_step=bar.on_step).fit()
    out = result.report.to_dict()
    if verify:
        with Progress(spec.steps, enabled=progress, stream=sys.stderr, label="reference") as bar:
            reference = make_trainer(spec, job_name="demo-reference", faults=None, on_step=bar.on_step).fit()
        out["reference_final_loss"] = reference.report.final_loss
        out["max_abs_param_diff_vs_reference"] = max_abs_diff(result.state["params"], reference.state["params"])
    return out
