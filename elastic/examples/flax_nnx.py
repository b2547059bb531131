"""Flax NNX, the tutorial's CNN (Conv, BatchNorm, Dropout with its stored ``nnx.Rngs``, ``nnx.Optimizer``),
made elastic: a slice dies, the job shrinks, the slice returns, the job grows back.

    python -m elastic.examples.flax_nnx --json --verify

The model and its in-place ``@nnx.jit`` train step are the tutorial's, unchanged. ``NnxAdapter`` gives the
job its ``init_fn`` (the ``nnx.State`` of model and optimizer: parameters, optimizer moments, the dropout
RNG stream and the BatchNorm statistics, all snapshotted and resharded), its ``shardings_fn`` (from the
model's ``nnx.with_partitioning`` annotation) and a functional step for ``run.jit``. Data: synthetic
MNIST-shaped images (28x28x1, 10 classes) addressed by step, 48 per batch (splits over 8, 6 and 4 devices).
``--verify`` also trains the same model with plain NNX, without the library, on the same devices at the
same steps (:mod:`elastic.examples.reference`) and compares every leaf of the state. Prints one JSON
object on stdout (exit 1 if --verify finds a difference).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices: 4 slices x 2
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __name__ == "__main__":  # run as a command: no native warning per multi-process group formed
    from elastic.quiet import quiet_native

    quiet_native(2)

import argparse
import json
import logging
import sys
from functools import partial
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import elastic
from elastic.api.flax_nnx import NnxAdapter
from elastic.examples.reference import Placements, run_reference, run_reference_processes

__all__ = [
    "CNN",
    "batch",
    "train_step",
    "make_adapter",
    "make_loop",
    "make_reference_step",
    "max_abs_state_diff",
    "run_example",
    "main",
]

BATCH, CLASSES = 48, 10


# ---- the user's model, data and step: the tutorial's -----------------------------------------
class CNN(nnx.Module):
    """The tutorial's CNN, smaller (one conv block: quick to compile on 2 CPU cores); the last kernel is
    annotated to split its classes over a 'model' axis."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.1, rngs=rngs)  # keeps its own RNG stream, from rngs
        self.avg_pool = partial(nnx.avg_pool, window_shape=(4, 4), strides=(4, 4))
        kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.linear1 = nnx.Linear(7 * 7 * 8, CLASSES, kernel_init=kernel_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))))
        return self.linear1(self.dropout1(x.reshape(x.shape[0], -1)))


_TEMPLATES = np.kron(np.random.default_rng(1234).normal(size=(CLASSES, 7, 7)), np.ones((4, 4))).astype(np.float32)


def batch(step: int, size: int = BATCH, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (images 28x28x1, labels): the same numbers for the same step, on any mesh."""
    rng = np.random.default_rng([seed, step])
    labels = rng.integers(0, CLASSES, size=size).astype(np.int32)
    images = _TEMPLATES[labels] + rng.normal(scale=2.0, size=(size, 28, 28)).astype(np.float32)
    return images[..., None], labels


def loss_fn(model: CNN, images: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, images: jax.Array, labels: jax.Array) -> jax.Array:
    """The tutorial's in-place step: updates ``model`` and ``optimizer``, returns the loss."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, images, labels)
    optimizer.update(model, grads)
    return loss


def build_model(rngs: nnx.Rngs) -> CNN:
    return CNN(rngs=rngs)


def build_optimizer(model: nnx.Module) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)


# ---- elastic ---------------------------------------------------------------------------------
def make_adapter() -> NnxAdapter:
    # the default mesh has axes ("replica", "local"): the annotation's "model" splits over "local"
    return NnxAdapter(model_fn=build_model, optimizer_fn=build_optimizer, axis_rules=[("model", "local")])


def make_loop(adapter: NnxAdapter) -> Any:
    def loop(run: elastic.Run) -> nnx.State:
        state = run.state  # an nnx.State: parameters, optimizer, RNG streams, BatchNorm statistics
        step_fn = run.jit(adapter.step(train_step))  # run.jit(train_step) itself would be refused
        for step in run.steps:
            images, labels = run.shard_batch(batch(step))
            state, loss = step_fn(state, images, labels)
            run.commit(state, loss=loss)
        return state

    return loop


def _as_numbers(x: Any) -> np.ndarray:
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(jax.device_get(x), dtype=np.float64)


def max_abs_state_diff(a: Any, b: Any) -> float:
    """The largest difference over every leaf (RNG keys compared by their key data)."""
    diffs = jax.tree_util.tree_map(lambda x, y: float(np.max(np.abs(_as_numbers(x) - _as_numbers(y)))), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


def eval_accuracy(model: CNN, seed: int = 99) -> float:
    model.eval()  # Dropout off, BatchNorm on its running statistics
    images, labels = batch(0, size=240, seed=seed)
    return float((nnx.jit(lambda m, x: m(x))(model, images).argmax(axis=1) == labels).mean())


def make_reference_step() -> Any:
    """``step_fn(state, step, mesh)`` for :func:`run_reference`: the tutorial's step on plain NNX objects,
    without the library (the structure from ``nnx.eval_shape``, each step's state merged into objects)."""

    def build() -> tuple[CNN, nnx.Optimizer]:
        model = build_model(nnx.Rngs(0))
        return model, build_optimizer(model)

    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(build))

    def reference_step(state: nnx.State, step: int, mesh: Mesh) -> nnx.State:
        model, optimizer = nnx.merge(graphdef, state)
        images, labels = jax.device_put(batch(step), NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
        train_step(model, optimizer, images, labels)  # in place
        return nnx.state((model, optimizer))

    return reference_step


def chaos_target() -> dict[str, Any]:
    """The tutorial's CNN (BatchNorm, Dropout, adamw) as a chaos target: ``elastic chaos --target
    elastic.examples.flax_nnx:chaos_target``. Each schedule's equivalence reference replays the run's own device
    schedule (a change of device count changes this model's floats; the replay shows nothing else did)."""
    config = elastic.ElasticConfig(
        simulated=True,
        job_name="flax-nnx-chaos",
        num_slices=4,
        devices_per_slice=2,
        num_steps=30,
        snapshot_every=5,
        global_batch_size=BATCH,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=elastic.Policy(min_slices=2, repair_timeout_s=3.0),
        tiers=elastic.Tiers(keeper_every=1, keepers=1),
    )
    adapter = make_adapter()
    return {
        "config": config,
        "init_fn": adapter.init_fn,
        "shardings_fn": adapter.shardings_fn,
        "loop": make_loop(adapter),
    }


def run_example(
    *,
    steps: int = 40,
    kill_at: int = 13,
    revive_at: int = 27,
    verify: bool = False,
    mode: str = "single-process",
    slices: int = 4,
    standby: bool = True,
) -> dict[str, Any]:
    """Run the job (and with ``verify`` its plain-NNX reference); the JSON-ready summary. ``mode``:
    ``"multi-process"`` runs each slice as a worker process (the killed slice's process really dies); ``standby``
    False there: no helper processes compile the step for the group one slice smaller (the first step after the
    loss compiles instead)."""
    processes = elastic.Processes(standby=standby) if mode == "multi-process" else None
    config = elastic.ElasticConfig(
        simulated=True,
        job_name="flax-nnx",
        num_slices=slices,
        devices_per_slice=2,
        num_steps=steps,
        snapshot_every=5,
        global_batch_size=BATCH,
        heartbeat_interval_s=0.3,
        heartbeat_timeout_s=1.5,
        policy=elastic.Policy(min_slices=2, repair_timeout_s=30.0),
        processes=processes,
    )
    faults = elastic.Faults().kill_slice(1, at_step=kill_at)
    if revive_at < steps:  # at or past the end: the job finishes on the survivors
        faults = faults.revive_slice(1, at_step=revive_at)
    adapter, placements = make_adapter(), Placements()
    job = elastic.ElasticJob(
        config, init_fn=adapter.init_fn, shardings_fn=adapter.shardings_fn, faults=faults, on_step=placements
    )
    with job:
        result = job.run(make_loop(adapter))
    out = result.report.to_dict()
    model = adapter.module(result.state)
    assert isinstance(model, CNN)
    out.update(
        global_batch=BATCH,
        slice_moves=placements.moves(),
        eval_accuracy=eval_accuracy(model),
        dropout_rng_count=int(model.dropout1.rngs.count[...]),
    )
    if verify and mode == "multi-process":
        reference = run_reference_processes(job, placements, make_reference_step())
        out["reference"] = "plain NNX in plain processes joined by jax.distributed, replaying the run's slices"
        out["max_abs_param_diff_vs_reference"] = max_abs_state_diff(result.state, reference)
    elif verify:
        reference = run_reference(job, placements, make_reference_step())
        out["max_abs_param_diff_vs_reference"] = max_abs_state_diff(result.state, reference)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.examples.flax_nnx")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--verify", action="store_true", help="also train with plain NNX and compare")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=13)
    parser.add_argument("--revive-at", type=int, default=27, help="step to revive slice 1 at (>= --steps: never)")
    parser.add_argument("--slices", type=int, default=4, help="slices of 2 devices each (at least 3: slice 1 dies)")
    parser.add_argument(
        "--mode",
        choices=("single-process", "multi-process"),
        default="single-process",
        help="multi-process: each slice a worker process (jax.distributed); the reference runs here",
    )
    parser.add_argument(
        "--no-standby",
        action="store_true",
        help="multi-process: no standby group compiling for one slice fewer (fewer processes; the move compiles)",
    )
    args = parser.parse_args(argv)
    if args.slices < 3:
        parser.error(f"--slices must be at least 3 (slice 1 is killed and at least 2 must stay), got {args.slices}")
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")  # stdout holds the result only: anything else on fd 1 goes to stderr
    os.dup2(2, 1)
    from elastic.log import configure_logging

    configure_logging(logging.ERROR)
    out = run_example(
        steps=args.steps,
        kill_at=args.kill_at,
        revive_at=args.revive_at,
        verify=args.verify,
        mode=args.mode,
        slices=args.slices,
        standby=not args.no_standby,
    )
    if args.json:
        print(json.dumps(out), file=result, flush=True)
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "timeline"}, indent=2), file=result, flush=True)
    return 0 if not args.verify or out["max_abs_param_diff_vs_reference"] <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
