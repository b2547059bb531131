"""my_train.py: a user's own training script (not part of the package), run on a Ray cluster with

    ray job submit --working-dir . --runtime-env-json '{"py_modules": ["/path/to/jax_elastic-....whl"]}' \
        -- python my_train.py --steps 200

A plain jax + optax loop (the model, the data and the step are the script's own), wrapped with elastic in
multi-process mode: one Ray worker process per slice. ``--simulated`` gives each worker forced CPU devices
(a machine without accelerators); without it each worker uses the devices Ray gives its process
(``--worker-resources '{"GPU": 8}'``). At the end it trains the same model without the library and without
failures in this process (``--verify``, simulated only: it needs the job's device count here) and prints one
JSON line: the job's report, ``max_abs_param_diff_vs_reference``, and where ``elastic`` was imported from.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import elastic

IN, HIDDEN, BATCH = 16, 64, 48  # 48 rows split over 6, 4 and 2 devices: every count the job may shrink to
optimizer = optax.adam(1e-2)


def init_state(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((1,)),
    }
    return {"params": params, "opt": optimizer.init(params)}


def get_batch(step: int) -> dict[str, np.ndarray]:
    """The batch of a step, addressed by the step: a recovered run sees the same data as a failure-free one."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}


def loss_fn(params: dict, data: dict) -> jax.Array:
    hidden = jnp.tanh(data["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - data["y"]) ** 2)


def train_step(state: dict, data: dict) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], data)
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def loop(run: elastic.Run) -> dict:
    """The loop body, moved into a function; it runs in every worker process (SPMD)."""
    state = run.state
    step_fn = run.jit(train_step, donate_argnums=0)
    for step in run.steps:
        state, loss = step_fn(state, run.shard_batch(get_batch(step)))
        run.commit(state, loss=loss)
    return state


def reference(steps: int, devices: int, seed: int) -> dict:
    """The same training without the library and without failures: a plain loop over this process's CPU devices."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    state = jax.jit(init_state, out_shardings=replicated)(jax.random.key(seed))
    step_fn = jax.jit(train_step)
    for step in range(steps):
        state, _ = step_fn(state, jax.device_put(get_batch(step), rows))
    return jax.device_get(state["params"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slices", type=int, default=3)
    parser.add_argument("--devices-per-slice", type=int, default=2)
    parser.add_argument("--job-name", default="my-train")
    parser.add_argument("--worker-resources", default="{}", help='what one worker needs of a node: {"GPU": 8}')
    parser.add_argument("--simulated", action="store_true", help="forced CPU devices, no accelerator")
    parser.add_argument("--verify", action="store_true", help="compare with a failure-free plain loop (simulated)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `ray job stop`: unwind, ending the job's actors
    devices = args.slices * args.devices_per_slice
    if args.verify:
        jax.config.update("jax_num_cpu_devices", devices)  # the reference's devices, in this process

    config = elastic.ElasticConfig(
        job_name=args.job_name,
        num_slices=args.slices,
        devices_per_slice=args.devices_per_slice,
        simulated=args.simulated,
        num_steps=args.steps,
        snapshot_every=5,
        policy=elastic.Policy(min_slices=1),
        processes=elastic.Processes(resources_per_worker=json.loads(args.worker_resources)),
    )

    def on_step(step: int, metrics: dict, run: elastic.Run) -> None:  # in this process, once per committed step
        print(f"step {step} committed", flush=True)

    with elastic.ElasticJob(config, init_fn=init_state, on_step=on_step) as job:
        result = job.run(loop)
    report = result.report.to_dict()
    report["elastic_file"] = elastic.__file__
    report["elastic_version"] = elastic.__version__
    if args.verify:
        expected = reference(args.steps, devices, config.seed)
        pairs = zip(jax.tree_util.tree_leaves(result.state["params"]), jax.tree_util.tree_leaves(expected), strict=True)
        report["max_abs_param_diff_vs_reference"] = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs
        )
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
