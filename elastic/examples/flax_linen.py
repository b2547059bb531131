"""Flax Linen, a CNN with BatchNorm and Dropout trained from a ``TrainState``, made elastic: a slice dies,
the job shrinks, the slice returns, the job grows back.

    python -m elastic.examples.flax_linen --json --verify

``LinenAdapter`` gives the job its ``init_fn`` (a ``TrainState`` holding the parameters, the optimizer
state, the BatchNorm statistics and the dropout RNG key), its ``shardings_fn`` (from the model's
``nn.with_partitioning`` annotation) and a step from a loss function. Data: synthetic MNIST-shaped images
(28x28x1, 10 classes) addressed by step, 48 per batch (splits over 8, 6 and 4 devices). ``--verify`` also
trains with a plain Linen step written out by hand, without the library, on the same devices at the same
steps (:mod:`elastic.examples.reference`), and compares every leaf of the state. Prints one JSON object
on stdout (exit 1 if --verify finds a difference).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices: 4 slices x 2
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import logging
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import elastic
from elastic.api.flax_linen import LinenAdapter, TrainState
from elastic.examples.flax_nnx import BATCH, CLASSES, batch, max_abs_state_diff
from elastic.examples.reference import Placements, run_reference

__all__ = ["CNN", "loss_fn", "make_adapter", "make_loop", "plain_train_step", "run_example", "main"]


# ---- the user's model and loss ---------------------------------------------------------------
class CNN(nn.Module):
    """Conv, BatchNorm, Dropout, Dense; the Dense kernel is annotated to split its classes over 'model'."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
        x = nn.avg_pool(x, (4, 4), strides=(4, 4)).reshape(x.shape[0], -1)
        x = nn.Dropout(0.1, deterministic=not train)(x)
        kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        return nn.Dense(CLASSES, kernel_init=kernel_init)(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(axis=1) == labels).mean()}


# ---- elastic ---------------------------------------------------------------------------------
def make_adapter() -> LinenAdapter:
    sample = jax.ShapeDtypeStruct((1, 28, 28, 1), jnp.float32)  # the input's shape, for module.init
    return LinenAdapter(
        module=CNN(),
        tx=optax.adam(3e-3),
        sample_input=sample,
        init_kwargs={"train": False},
        train_kwargs={"train": True},
        axis_rules=[("model", "local")],
    )


def make_loop(adapter: LinenAdapter) -> Any:
    def loop(run: elastic.Run) -> TrainState:
        state = run.state  # a TrainState: params, opt_state, batch_stats, the dropout key
        step_fn = run.jit(adapter.step(loss_fn))
        for step in run.steps:
            images, labels = run.shard_batch(batch(step))
            state, metrics = step_fn(state, images, labels)
            run.commit(state, **metrics)  # loss and accuracy
        return state

    return loop


# ---- the reference: the classic Linen step, by hand ------------------------------------------
@jax.jit
def plain_train_step(state: TrainState, images: jax.Array, labels: jax.Array) -> TrainState:
    step_key = jax.random.fold_in(state.key, state.step)
    dropout_key = jax.random.fold_in(step_key, 0)  # the adapter's keys: stream i of rng_streams gets fold_in(.., i)

    def compute(params: Any) -> tuple[jax.Array, Any]:
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            images,
            train=True,
            rngs={"dropout": dropout_key},
            mutable=["batch_stats"],
        )
        return loss_fn(logits, labels)[0], updates

    (_, updates), grads = jax.value_and_grad(compute, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])


def run_example(*, steps: int = 40, kill_at: int = 13, revive_at: int = 27, verify: bool = False) -> dict[str, Any]:
    """Run the job (and with ``verify`` its plain-Linen reference); the JSON-ready summary."""
    config = elastic.ElasticConfig(
        simulated=True,
        job_name="flax-linen",
        num_slices=4,
        devices_per_slice=2,
        num_steps=steps,
        snapshot_every=5,
        global_batch_size=BATCH,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=elastic.Policy(min_slices=2, repair_timeout_s=30.0),
    )
    faults = elastic.Faults().kill_slice(1, at_step=kill_at).revive_slice(1, at_step=revive_at)
    adapter, placements = make_adapter(), Placements()
    job = elastic.ElasticJob(
        config, init_fn=adapter.init_fn, shardings_fn=adapter.shardings_fn, faults=faults, on_step=placements
    )
    with job:
        result = job.run(make_loop(adapter))
    out = result.report.to_dict()
    images, labels = batch(0, size=240, seed=99)
    logits = jax.jit(lambda v, x: CNN().apply(v, x, train=False))(adapter.variables(result.state), images)
    out.update(
        global_batch=BATCH,
        slice_moves=placements.moves(),
        eval_accuracy=float((logits.argmax(axis=1) == labels).mean()),
    )
    if verify:

        def reference_step(state: TrainState, step: int, mesh: Mesh) -> TrainState:  # the plain loop: no elastic
            images, labels = jax.device_put(batch(step), NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
            return plain_train_step(state, images, labels)

        reference = run_reference(job, placements, reference_step)
        out["max_abs_param_diff_vs_reference"] = max_abs_state_diff(result.state, reference)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.examples.flax_linen")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--verify", action="store_true", help="also train with a plain Linen step and compare")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=13)
    parser.add_argument("--revive-at", type=int, default=27)
    args = parser.parse_args(argv)
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")  # stdout holds the result only: anything else on fd 1 goes to stderr
    os.dup2(2, 1)
    from elastic.log import configure_logging

    configure_logging(logging.ERROR)
    out = run_example(steps=args.steps, kill_at=args.kill_at, revive_at=args.revive_at, verify=args.verify)
    if args.json:
        print(json.dumps(out), file=result, flush=True)
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "timeline"}, indent=2), file=result, flush=True)
    return 0 if not args.verify or out["max_abs_param_diff_vs_reference"] <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
