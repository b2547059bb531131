"""What the library costs a multi-process job on a day nothing fails: plain multi-process JAX against the elastic job.

    .venv/bin/python benchmarks/overhead_mp.py --json [--mib 64] [--steps 30] [--repeats 1]
    .venv/bin/python benchmarks/overhead.py --mode multi-process --json   (the same)

Both run 4 worker processes (Ray actors, 2 CPU devices each, one ``jax.distributed`` group over gloo) and the
same loop: ``benchmarks/overhead.py``'s MLP with adam (parameters and both moments about ``--mib`` MiB, replicated
on the 8 devices), each batch split over them, the step jitted with its state donated.

- ``plain``: the workers without the library: they join a group through a coordination service hosted here,
  build the mesh, initialise the state and run the loop, up to ``AHEAD`` steps ahead of the devices.
- ``elastic``: an ``ElasticJob`` with ``Processes()`` (its defaults: keepers, standby helpers, the supervisor and
  its agents' heartbeats all run beside the workers on the same 2 cores), at ``snapshot_every=10`` and ``=1``.
  Its loop holds before step 2 until the job's standby executables are compiled (the timed stretch is a job past
  its first minute: ``standby_compiles`` says whether they were).

Each loop's ``step_seconds`` is its mean step time from the end of step 2 to the end of the last step (its state
computed), in worker 0's clock; ``ratio_every10`` and ``ratio_every1`` divide the elastic job's by the plain
loop's. ``--repeats`` alternates the three loops that many times; the figures are the medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import overhead
import ray
from jax.sharding import NamedSharding, PartitionSpec

from elastic.runtime import distributed
from elastic.runtime.mesh import batch_sharding, default_mesh

__all__ = ["main", "run"]

SLICES, DEVICES, TIMED_FROM = 4, 2, 2


def stretch(stamps: list[float]) -> float:
    """The mean step time from the end of step ``TIMED_FROM`` to the last stamp (the end of the last step)."""
    return (stamps[-1] - stamps[TIMED_FROM]) / (len(stamps) - 1 - TIMED_FROM)


class PlainWorker:
    """One process of the plain multi-process job (a Ray actor)."""

    def loop(self, address: str, index: int, width: int, steps: int) -> list[float]:
        distributed.reform(address, SLICES, index)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = default_mesh([[d for d in devices if d.process_index == p] for p in range(jax.process_count())])
        init, step = overhead.make(width)
        state = jax.jit(init, out_shardings=NamedSharding(mesh, PartitionSpec()))(jax.random.key(0))
        fn = jax.jit(step, donate_argnums=0)
        rows = batch_sharding(mesh)
        stamps, losses = [], []
        for k in range(steps):
            host = overhead.batch(k, width)
            x = jax.make_array_from_callback(host.shape, rows, lambda i, host=host: host[i])
            state, loss = fn(state, x)
            losses.append(loss)
            if k >= overhead.AHEAD:
                losses[k - overhead.AHEAD].block_until_ready()
            if k <= TIMED_FROM:  # compiled and warm: from here one pipelined stretch
                jax.block_until_ready(loss)
            stamps.append(time.time())
        jax.block_until_ready(state)
        stamps[-1] = time.time()
        return stamps

    def leave(self) -> float:
        return distributed.leave()


def run_plain(width: int, steps: int) -> dict[str, Any]:
    cls = ray.remote(PlainWorker).options(
        num_cpus=0, max_restarts=0, runtime_env={"env_vars": distributed.collective_env(DEVICES)}
    )
    service = distributed.CoordinationService(SLICES)
    workers = [cls.remote() for _ in range(SLICES)]
    try:
        stamps = ray.get([w.loop.remote(service.address, i, width, steps) for i, w in enumerate(workers)], timeout=900)
        ray.wait([w.leave.remote() for w in workers], num_returns=len(workers), timeout=10)
    finally:
        for w in workers:
            ray.kill(w, no_restart=True)
        service.stop()
    return {"step_seconds": stretch(stamps[0])}


def _elastic_loop(width: int, flag: bytes, stamps_key: bytes) -> Any:
    def loop(run: Any) -> Any:
        from elastic.supervision.ray_internals import kv_exists, kv_put

        init, step = overhead.make(width)
        del init
        fn = run.jit(step, donate_argnums=0)
        state, stamps = run.state, []
        for k in run.steps:
            if k == TIMED_FROM:  # once the standby executables are compiled (the driver sets the flag)
                deadline = time.monotonic() + 300
                while not kv_exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
            state, loss = fn(state, run.shard_batch(overhead.batch(k, width)))
            run.commit(state)
            if k < TIMED_FROM:
                jax.block_until_ready(loss)
            stamps.append(time.time())
        jax.block_until_ready(state)
        stamps[-1] = time.time()
        if jax.process_index() == 0:
            kv_put(stamps_key, json.dumps(stamps).encode())
        return state

    return loop


def run_elastic(width: int, steps: int, every: int) -> dict[str, Any]:
    import threading

    from elastic import ElasticConfig, ElasticJob, Processes
    from elastic.supervision.ray_internals import kv_del, kv_get, kv_put

    tag = f"overhead-mp-{os.getpid()}-{time.time_ns()}"
    flag, stamps_key = f"{tag}-go".encode(), f"{tag}-stamps".encode()
    init, _ = overhead.make(width)
    config = ElasticConfig(
        simulated=True,
        job_name="bench-overhead-mp",
        num_slices=SLICES,
        devices_per_slice=DEVICES,
        num_steps=steps,
        snapshot_every=every,
        processes=Processes(),
    )
    job = ElasticJob(config, init_fn=init)

    def release() -> None:
        deadline = time.monotonic() + 300
        while job.controller is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if job.controller is not None:
            job.controller.wait_for_standbys(300)
        kv_put(flag, b"1")

    with job:
        threading.Thread(target=release, daemon=True).start()
        result = job.run(_elastic_loop(width, flag, stamps_key))
    stamps = json.loads(kv_get(stamps_key) or b"[]")
    kv_del(flag)
    kv_del(stamps_key)
    report = result.report.to_dict()
    return {
        "step_seconds": stretch(stamps),
        "standby_compiles": report["standby_compiles"],
        "snapshots_taken": report["snapshots_taken"],
        "snapshot_blocking_seconds_per_snapshot": round(
            report["snapshot_blocking_seconds"] / max(1, report["snapshots_taken"]), 4
        ),
    }


def run(mib: float, steps: int, repeats: int = 1) -> dict[str, Any]:
    """The three loops, alternating ``repeats`` times, in this process's Ray (an embedded one started, and shut
    down, if none); medians at the top, every trial in ``trials``."""
    from ray import cloudpickle

    from elastic.control.cluster import connect

    for module in (sys.modules[__name__], overhead):  # Ray's workers may not find these files: send them by value
        cloudpickle.register_pickle_by_value(module)
    width = overhead.width_for(mib)
    started = connect()
    trials: list[dict[str, Any]] = []
    try:
        for _ in range(repeats):
            plain = run_plain(width, steps)
            every10 = run_elastic(width, steps, 10)
            every1 = run_elastic(width, steps, 1)
            trials.append(
                {
                    "plain_step_seconds": round(plain["step_seconds"], 4),
                    "elastic_step_seconds_every10": round(every10["step_seconds"], 4),
                    "elastic_step_seconds_every1": round(every1["step_seconds"], 4),
                    "ratio_every10": round(every10["step_seconds"] / plain["step_seconds"], 3),
                    "ratio_every1": round(every1["step_seconds"] / plain["step_seconds"], 3),
                    "standby_compiles": [every10["standby_compiles"], every1["standby_compiles"]],
                    "snapshot_blocking_seconds_per_snapshot_every1": every1["snapshot_blocking_seconds_per_snapshot"],
                }
            )
    finally:
        if started:
            ray.shutdown()
    median = {k: statistics.median(t[k] for t in trials) for k in trials[0] if isinstance(trials[0][k], float)}
    state_bytes = 3 * overhead.LAYERS * width * width * 4
    return {
        "mode": "multi-process",
        "state_bytes": state_bytes,
        "workers": SLICES,
        "devices_per_worker": DEVICES,
        "steps": steps,
        "repeats": repeats,
        **median,
        "checks": {
            "ratio_every10<=1.05": median["ratio_every10"] <= 1.05,
            "ratio_every1<=1.15": median["ratio_every1"] <= 1.15,
        },
        "trials": trials,
    }


def main() -> None:
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="alternations of the three loops; medians reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args()
    print(json.dumps(run(args.mib, args.steps, args.repeats), indent=1))


if __name__ == "__main__":
    main()
