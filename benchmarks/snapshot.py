"""Host snapshots on every step, against a plain memcpy and Orbax's Pathways Snapshotter, in one run.

    .venv/bin/python benchmarks/snapshot.py --json [--mib 256] [--steps 12]

A state of ``--mib`` MiB (one logical copy) on 4 slices x 2 devices: every leaf split over the two
devices of a slice and replicated across slices (data parallel). Each step updates every leaf; a
snapshot is requested after every step, as ``elastic`` does with ``snapshot_every=1``.

Figures: ``step_seconds`` (no snapshots), ``blocking_seconds_per_snapshot`` (median time ``save``
holds the loop), ``blocking_fraction_of_step``, ``snapshot_gbps`` (bytes written into host buffers,
all copies, over the background copy's wall time, checksums included, with the loop idle; beside it
``snapshot_gbps_during_steps``, while steps share the machine's 2 cores), ``memcpy_gbps`` (one numpy
copy of the same bytes into a reused buffer, median of 3 as for ``snapshot_gbps``), ``held_bytes`` (every snapshot
buffer, all generations,
the in-flight one included), ``copies`` (distinct slices holding each byte), ``snapshots_dropped``,
``keeper_bytes`` (the keeper tier, one push of the newest generation to 2 keepers on the local Ray),
and the same state through Orbax's Snapshotter (``orbax_*``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.snapshot import SnapshotConfig, Snapshotter

LEAVES = 8


def make_state(mib: int, mesh: Mesh) -> dict[str, jax.Array]:
    rows = mib * 1024 * 1024 // 4 // LEAVES // 1024
    sharding = NamedSharding(mesh, P("local"))
    make = jax.jit(
        lambda i: {f"w{k}": jax.numpy.full((rows, 1024), float(k) + i, jax.numpy.float32) for k in range(LEAVES)},
        out_shardings=sharding,
    )
    return jax.block_until_ready(make(0.0))


def step_fn():
    return jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 0.001, s), donate_argnums=0)


def nbytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def measure_ours(state, mesh: Mesh, steps: int) -> dict:
    step = step_fn()
    state = jax.block_until_ready(step(state))  # compile
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - t0)
    step_seconds = statistics.median(times)

    snap = Snapshotter(SnapshotConfig(keep=2, copies=2), slice_of=lambda d: d.id // 2)
    for i in range(snap.config.keep + 1):  # warm-up: every buffer slot allocated and touched once
        snap.save(-3 + i, state)
        snap.wait()
    warm = snap.stats()
    blocking, with_snap = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state))
        t1 = time.perf_counter()
        snap.save(i + 1, state, {"step": i + 1})
        blocking.append(time.perf_counter() - t1)
        with_snap.append(time.perf_counter() - t0)
    snap.wait()
    stats = snap.stats()
    # The copy engine alone: the same snapshots with no step running beside them (on this 2-core
    # machine a step and the copy share the cores; on accelerators the step runs on the devices).
    quiet = []
    for i in range(3):
        before = snap.stats()
        snap.save(steps + 1 + i, state)
        snap.wait()
        after = snap.stats()
        quiet.append((after["copy_bytes"] - before["copy_bytes"]) / (after["copy_seconds"] - before["copy_seconds"]))
    expected = jax.device_get(state)
    t0 = time.perf_counter()
    restored = snap.load(jax.tree.map(lambda x: x.sharding, state))
    jax.block_until_ready(restored.state)
    load_seconds = time.perf_counter() - t0
    exact = all(np.array_equal(np.asarray(restored.state[k]), expected[k]) for k in expected)
    image = snap.image()
    snap.close()
    return {
        "step_seconds": round(step_seconds, 4),
        "step_seconds_with_snapshots": round(statistics.median(with_snap), 4),
        "blocking_seconds_per_snapshot": round(statistics.median(blocking), 5),
        "blocking_seconds_max": round(max(blocking), 5),
        "blocking_fraction_of_step": round(statistics.median(blocking) / step_seconds, 4),
        "snapshot_gbps": round(statistics.median(quiet) / 1e9, 2),
        "snapshot_gbps_during_steps": round(
            (stats["copy_bytes"] - warm["copy_bytes"]) / (stats["copy_seconds"] - warm["copy_seconds"]) / 1e9, 2
        ),
        "first_fill_gbps": round(warm["copy_bytes"] / warm["copy_seconds"] / 1e9, 2),
        "held_bytes": stats["held_bytes"],
        "keep": stats["keep"],
        "copies": stats["copies"],
        "snapshots_requested": stats["snapshots_requested"] - warm["snapshots_requested"],
        "snapshots_taken": stats["snapshots_taken"] - warm["snapshots_taken"],
        "snapshots_coalesced": stats["snapshots_coalesced"],
        "snapshots_dropped": stats["snapshots_dropped"],
        "load_seconds": round(load_seconds, 3),
        "restored_step": restored.step,
        "restored_exact": exact,
        "_image": image,
    }


def memcpy_gbps(total: int) -> float:
    src = np.ones(total // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rates.append(total / (time.perf_counter() - t0) / 1e9)
    return round(statistics.median(rates), 2)  # the same statistic as snapshot_gbps


def measure_keepers(image) -> dict:
    import ray

    from elastic.snapshot.keeper import KeeperTier

    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        tier = KeeperTier("elastic-bench-snapshot", num_keepers=2)
        tier.start()
        t0 = time.perf_counter()
        tier.push(image)
        tier.wait(120)
        seconds = time.perf_counter() - t0
        stats = tier.stats()
        tier.close(kill=True)
        return {"keeper_bytes": stats["keeper_bytes"], "keeper_push_seconds": round(seconds, 3)}
    finally:
        ray.shutdown()


def main() -> None:
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)  # events on stderr: stdout is the JSON object
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    parser.add_argument("--no-orbax", action="store_true")
    parser.add_argument("--no-keepers", action="store_true")
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "local"))
    state = make_state(args.mib, mesh)
    state_bytes = nbytes(state)
    out = {"state_bytes": state_bytes, "slices": 4, "devices_per_slice": 2, "steps": args.steps}
    ours = measure_ours(state, mesh, args.steps)
    image = ours.pop("_image")
    out.update(ours)
    out["memcpy_gbps"] = memcpy_gbps(state_bytes)
    out["held_bound_bytes"] = (out["keep"] + 1) * out["copies"] * state_bytes
    if not args.no_keepers:
        out.update(measure_keepers(image))
    del image
    if not args.no_orbax:
        from orbax_snapshotter import measure_orbax_snapshotter

        out.update(measure_orbax_snapshotter(make_state(args.mib, mesh), step_fn(), steps=args.steps))
    out["checks"] = {
        "blocking_fraction_of_step<=0.05": out["blocking_fraction_of_step"] <= 0.05,
        "snapshots_dropped==0": out["snapshots_dropped"] == 0,
        "copies>=2": out["copies"] >= 2,
        "held_bytes<=(keep+1)*copies*state_bytes": out["held_bytes"] <= out["held_bound_bytes"],
        "snapshot_gbps>=memcpy_gbps/2": out["snapshot_gbps"] >= out["memcpy_gbps"] / 2,
    }
    if "orbax_blocking_seconds" in out:
        out["checks"]["blocking<orbax_blocking"] = out["blocking_seconds_per_snapshot"] < out["orbax_blocking_seconds"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
