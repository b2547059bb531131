"""A Grain pipeline whose position rides in the snapshot: a slice dies mid-epoch, the job shrinks and restores
(rolling the pipeline back with the model), the slice returns and the job grows back (keeping the position).

    python -m elastic.examples.grain_pipeline --json --verify

A ``grain.DataLoader`` reads a synthetic in-memory source of 400 examples, shuffled with a seed, for as many
epochs as the steps need (batches of 48, which split over 8, 6 and 4 devices). The loop takes its batches
from ``run.batches(loader)``. ``--verify`` also trains the same model without the library on the same devices
at the same steps, fed by a fresh iterator of the same pipeline (:mod:`elastic.examples.reference`), and
compares: the parameters, and the example ids the committed steps consumed against those the fresh pipeline
yields (``examples_skipped``, ``examples_repeated``). Prints one JSON object on stdout (exit 1 if --verify
finds a difference).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices: 4 slices x 2
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import logging
import sys
from collections import Counter
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import elastic
from elastic.examples.reference import Placements, run_reference

__all__ = ["Examples", "Consumed", "pipeline", "init_state", "train_step", "make_loop", "run_example", "main"]

NUM_EXAMPLES, BATCH, IN = 400, 48, 16  # 400 / 48: batches straddle epochs, and a restore lands mid-epoch


# ---- the user's data, model and step ---------------------------------------------------------
class Examples:
    """A random-access source (``len`` and ``[i]``) of ``n`` synthetic examples ``{"id", "x", "y"}``."""

    def __init__(self, n: int = NUM_EXAMPLES, seed: int = 0) -> None:
        self.n, self.seed = n, seed
        rng = np.random.default_rng(seed)
        self._x = rng.normal(size=(n, IN)).astype(np.float32)
        teacher = rng.normal(size=(IN, 1)).astype(np.float32) / np.sqrt(IN)
        self._y = np.sin(self._x @ teacher).astype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"id": np.int32(i), "x": self._x[i], "y": self._y[i]}

    def __repr__(self) -> str:  # grain checks a DataLoader state against repr(source): keep it stable
        return f"Examples(n={self.n}, seed={self.seed})"


def pipeline(seed: int = 7) -> grain.DataLoader:
    """Shuffled (a new order each epoch), endless, batched: the same sequence of batches from every fresh iterator."""
    sampler = grain.samplers.IndexSampler(
        num_records=NUM_EXAMPLES, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=None, seed=seed
    )
    return grain.DataLoader(
        data_source=Examples(),
        sampler=sampler,
        worker_count=0,
        operations=[grain.transforms.Batch(BATCH, drop_remainder=True)],
        read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=2 * BATCH),
    )


optimizer = optax.adam(1e-2)


def init_state(key: jax.Array) -> dict[str, Any]:
    params = {"w": jax.random.normal(key, (IN, 1)) * 0.1, "b": jnp.zeros((1,))}
    return {"params": params, "opt": optimizer.init(params)}


def train_step(state: dict[str, Any], x: jax.Array, y: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


# ---- what the committed steps consumed -------------------------------------------------------
class Consumed(Placements):
    """``on_step`` callback: per committed step of the final lineage, its slices and the example ids its batch
    held (a step recomputed after a restore overwrites both)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[int, list[int]] = {}
        self.pulled: dict[int, list[int]] = {}  # filled by the loop, moved to ids when the step commits

    def __call__(self, step: int, metrics: dict[str, Any], run: elastic.Run) -> None:
        super().__call__(step, metrics, run)
        self.ids[step] = self.pulled.pop(step)


def make_loop(loader: Any, consumed: Consumed) -> Any:
    """The elastic loop: batches from ``run.batches(loader)``, their ids noted in ``consumed``."""

    def loop(run: elastic.Run) -> Any:
        state = run.state
        step_fn = run.jit(train_step)
        for step, batch in run.batches(loader):  # positioned where the committed steps left the pipeline
            consumed.pulled[step] = batch["id"].tolist()
            x, y = run.shard_batch((batch["x"], batch["y"]))
            state, loss = step_fn(state, x, y)
            run.commit(state, loss=loss)  # records the pipeline's position with the step
        return state

    return loop


def _id_counts(ids: dict[int, list[int]]) -> Counter[int]:
    return Counter(i for step in sorted(ids) for i in ids[step])


def run_example(*, steps: int = 40, kill_at: int = 13, revive_at: int = 27, verify: bool = False) -> dict[str, Any]:
    """Run the job (and with ``verify`` its reference); the JSON-ready summary."""
    config = elastic.ElasticConfig(
        simulated=True,
        job_name="grain-pipeline",
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
    consumed = Consumed()
    job = elastic.ElasticJob(config, init_fn=init_state, faults=faults, on_step=consumed)
    with job:
        result = job.run(make_loop(pipeline(), consumed))
    out = result.report.to_dict()
    out.update(
        examples=NUM_EXAMPLES,
        global_batch=BATCH,
        epochs_read=round(steps * BATCH / NUM_EXAMPLES, 2),
        slice_moves=consumed.moves(),
    )
    if verify:
        reference_ids: dict[int, list[int]] = {}
        reference_iter = iter(pipeline())
        step_jit = jax.jit(train_step)

        def reference_step(state: Any, step: int, mesh: Mesh) -> Any:  # the plain loop: no elastic
            batch = next(reference_iter)
            reference_ids[step] = batch["id"].tolist()
            x, y = jax.device_put((batch["x"], batch["y"]), NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
            return step_jit(state, x, y)[0]

        reference = run_reference(job, consumed, reference_step)
        got, want = _id_counts(consumed.ids), _id_counts(reference_ids)
        diffs = jax.tree_util.tree_map(
            lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
            jax.device_get(result.state["params"]),
            jax.device_get(reference["params"]),
        )
        out.update(
            max_abs_param_diff_vs_reference=max(jax.tree_util.tree_leaves(diffs)),
            examples_skipped=sum((want - got).values()),
            examples_repeated=sum((got - want).values()),
            batches_differing_from_reference=sum(consumed.ids.get(s) != reference_ids[s] for s in reference_ids),
        )
    return out


def verified(out: dict[str, Any]) -> bool:
    """The --verify verdict: same parameters (within 1e-6) and the same examples, each batch at its step."""
    return (
        out["max_abs_param_diff_vs_reference"] <= 1e-6
        and out["examples_skipped"] == 0
        and out["examples_repeated"] == 0
        and out["batches_differing_from_reference"] == 0
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.examples.grain_pipeline")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--verify", action="store_true", help="also train without the library and compare")
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
        summary = {k: v for k, v in out.items() if k != "timeline"}
        print(json.dumps(summary, indent=2), file=result, flush=True)
    return 0 if not args.verify or verified(out) else 1


if __name__ == "__main__":
    sys.exit(main())
