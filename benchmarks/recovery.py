"""Recovery and snapshot cost, each against its baseline in the same run. Prints one JSON object.

    .venv/bin/python benchmarks/recovery.py [--hidden 1024] [--steps 40] [--kill-at 25]

* recovery: an elastic job loses a slice at ``--kill-at``; we time failure -> first step on the
  survivors, and failure -> the failed step committed again. Baseline: what a restart-based job does
  at that moment: a fresh process imports jax, restores the same state from an Orbax checkpoint onto
  the survivors' mesh, compiles and runs its first step (Ray/job rescheduling time not even counted).
* snapshot: one host snapshot of the training state (until complete, and the part that holds the loop)
  vs one synchronous Orbax save of it, and vs a step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The repository root before this folder: benchmarks/snapshot.py must not shadow the snapshot package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from elastic import ElasticConfig, Faults, Policy, Trainer, optax_step  # noqa: E402
from elastic.log import configure_logging  # noqa: E402
from snapshot import SnapshotConfig, Snapshotter  # noqa: E402

BATCH, IN = 48, 256


def make_model(hidden: int):
    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {"w1": jax.random.normal(k1, (IN, hidden)) * 0.05, "w2": jax.random.normal(k2, (hidden, hidden)) * 0.05,
                "w3": jax.random.normal(k3, (hidden, 1)) * 0.05}

    def loss(params, data):
        h = jnp.tanh(jnp.tanh(data["x"] @ params["w1"]) @ params["w2"])
        return jnp.mean((h @ params["w3"] - data["y"]) ** 2)

    return init, loss


def batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :1])}


BASELINE = textwrap.dedent("""
    import os, sys, time, json
    t0 = time.perf_counter()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"; os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np, optax, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
    from recovery import make_model, batch
    t_import = time.perf_counter()
    init, loss = make_model({hidden}); opt = optax.adam(1e-3)
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(3, 2), ("replica", "local"))
    rep = NamedSharding(mesh, P())
    abstract = jax.eval_shape(lambda k: {{"params": init(k), "opt_state": opt.init(init(k))}}, jax.random.key(0))
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), abstract)
    state = ocp.StandardCheckpointer().restore({path!r}, target)
    jax.block_until_ready(state); t_restore = time.perf_counter()
    def step(state, data):
        l, g = jax.value_and_grad(loss)(state["params"], data)
        u, o = opt.update(g, state["opt_state"], state["params"])
        return {{"params": optax.apply_updates(state["params"], u), "opt_state": o}}, l
    data = jax.device_put(batch({step}), NamedSharding(mesh, P(("replica", "local"))))
    state, l = jax.jit(step)(state, data); jax.block_until_ready(l); t_step = time.perf_counter()
    print(json.dumps({{"import_s": t_import - t0, "restore_s": t_restore - t_import, "first_step_s": t_step - t_restore}}))
""")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--snapshot-every", type=int, default=10)
    args = parser.parse_args()
    configure_logging(40)
    init, loss = make_model(args.hidden)
    commits: dict[int, list[float]] = {}
    cfg = ElasticConfig(job_name="bench", num_steps=args.steps, snapshot_every=args.snapshot_every,
                        policy=Policy(min_slices=2))
    trainer = Trainer(init_fn=init, step_fn=optax_step(loss, optax.adam(1e-3)), batch_fn=batch, config=cfg,
                      faults=Faults().kill_slice(1, at_step=args.kill_at),
                      on_step=lambda step, m, run: commits.setdefault(step, []).append(time.time()))
    result = trainer.fit()
    report = result.report
    failure_t = next(e["t"] for e in report.timeline if e["event"] == "failure") + trainer.job.timeline.start
    regain_s = commits[args.kill_at][-1] - failure_t
    step_times = np.diff([commits[s][0] for s in range(2, args.kill_at)])
    state = result.state

    # Snapshot cost: host snapshot vs a synchronous Orbax save of the same state, and vs a step.
    snapper = Snapshotter(SnapshotConfig(), slice_of=lambda d: d.id // 2)
    t = time.perf_counter(); snapper.save(0, state); host_block_s = time.perf_counter() - t
    snapper.wait(); host_s = time.perf_counter() - t
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    snapper.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        ckptr = ocp.StandardCheckpointer()
        t = time.perf_counter(); ckptr.save(path, state); ckptr.wait_until_finished(); orbax_s = time.perf_counter() - t
        # Baseline recovery: a fresh process restores that checkpoint onto the 6 survivors and runs a step.
        here = os.path.dirname(os.path.abspath(__file__))
        code = BASELINE.format(root=os.path.dirname(here), bench=here, hidden=args.hidden, path=path, step=args.kill_at)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
        baseline_s = time.perf_counter() - t
        parts = json.loads(out.stdout.strip().splitlines()[-1])
    lost = args.kill_at - args.kill_at // args.snapshot_every * args.snapshot_every
    elastic_s = report.recovery_seconds[0]
    print(json.dumps({
        "state_mb": round(state_bytes / 2**20, 1),
        "median_step_s": round(float(np.median(step_times)), 4),
        "elastic_recovery_to_first_step_s": elastic_s,
        "elastic_recovery_to_regain_failed_step_s": round(regain_s, 3),
        "baseline_restart_to_first_step_s": round(baseline_s, 3),
        "baseline_parts_s": {k: round(v, 3) for k, v in parts.items()},
        "baseline_over_elastic_recovery": round(baseline_s / elastic_s, 2),
        "steps_lost_both": lost,
        "host_snapshot_s": round(host_s, 4),  # until complete (2 copies, checksummed)
        "host_snapshot_blocking_s": round(host_block_s, 5),  # what the training loop waits
        "orbax_sync_save_s": round(orbax_s, 4),
        "orbax_save_over_host_snapshot": round(orbax_s / host_s, 2),
        "host_snapshot_over_step": round(host_s / float(np.median(step_times)), 3),
        "steps_committed": report.steps_committed,
    }))


if __name__ == "__main__":
    main()
