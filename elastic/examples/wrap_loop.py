"""The getting-started example (docs/getting-started.md): a plain jax + optax loop made elastic with a few lines.

python -m elastic.examples.wrap_loop
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices: 4 slices x 2

import jax
import jax.numpy as jnp
import numpy as np
import optax

import elastic


# ---- the user's model, data and step: unchanged ----------------------------------------------
def init_state(key):
    params = {"w": jax.random.normal(key, (16, 1)) * 0.1, "b": jnp.zeros((1,))}
    return {"params": params, "opt": optimizer.init(params)}


def get_batch(step):  # data addressed by step: the same batches in the same order on any mesh
    rng = np.random.default_rng(step)
    x = rng.normal(size=(48, 16)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True).astype(np.float32)


def train_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


optimizer = optax.adam(1e-2)

# ---- before: the plain loop ------------------------------------------------------------------
# state = init_state(jax.random.key(0))
# step_fn = jax.jit(train_step)
# for step in range(200):
#     x, y = get_batch(step)
#     state, loss = step_fn(state, x, y)


# ---- after: the same loop, elastic -----------------------------------------------------------
def loop(run: elastic.Run):
    state = run.state  # restored onto run.mesh (the healthy slices only)
    step_fn = run.jit(train_step)
    for step in run.steps:  # resumes at the snapshot's step
        x, y = run.shard_batch(get_batch(step))
        state, loss = step_fn(state, x, y)
        run.commit(state, loss=loss)  # confirms steps in order (two in flight); snapshots; follows membership
    return state


if __name__ == "__main__":
    # simulated=True: 4 slices of the 8 CPU devices forced above, which the fault drill can kill. Drop it (and the
    # XLA_FLAGS line) to train on the devices jax sees: your GPUs or TPUs, num_slices x devices_per_slice of them.
    config = elastic.ElasticConfig(
        job_name="wrap-loop", num_slices=4, devices_per_slice=2, num_steps=200, simulated=True
    )
    faults = elastic.Faults().kill_slice(2, at_step=70).revive_slice(2, at_step=140)  # optional: a fault drill
    with elastic.ElasticJob(config, init_fn=init_state, faults=faults) as job:
        result = job.run(loop)
    r = result.report
    print(
        f"final loss {r.final_loss:.5f}; slices {r.slices_initial} -> {r.min_slices_seen} -> {r.slices_final}; "
        f"recoveries {r.recoveries}; steps committed {r.steps_committed}, recomputed {r.steps_recomputed}"
    )
