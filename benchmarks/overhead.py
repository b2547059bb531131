"""What the library costs on a day nothing fails: the plain pipelined jitted loop against the elastic loop, in one run.

    .venv/bin/python benchmarks/overhead.py --json [--mib 200 | --step-seconds 0.2] [--steps 30]
    .venv/bin/python benchmarks/overhead.py --mode multi-process --json   (benchmarks/overhead_mp.py)

An MLP with adam whose state (parameters and both moments) is ``--mib`` MiB, replicated over 4 slices x 2 CPU
devices, each batch split over the 8 devices: the same mesh, shardings, batches and step for every loop.

- ``plain``: ``jax.jit(step)`` dispatched step after step, up to ``AHEAD`` steps ahead of the devices (jax keeps
  the loop ahead; unbounded, on these 8 CPU devices XLA's collective rendezvous aborted the process 30 steps ahead,
  in about one run of ten; 1, 2, 3 or unbounded steps ahead ran alike, within 2%);
- ``elastic``: ``ElasticJob`` with ``snapshot_every=10`` and ``=1`` (``steps_in_flight=2``, the default), and
  at ``snapshot_every=10`` with ``steps_in_flight=1`` (each commit waits for its step: how it was before).

- ``snapshotter`` / ``orbax``: the plain loop saving every step's state as soon as it is dispatched, with our
  ``Snapshotter`` or Orbax's (``pip install -e ".[bench]"``): ``snapshotter_ratio_every1``, ``orbax_ratio_every1``
  (mean step time over the plain loop's) and ``save_return_seconds_median``, ``orbax_save_return_seconds_median``
  (how long a ``save`` call held the loop). Orbax's skips a save while its previous one is in flight and returns at
  once (``orbax_saves_skipped``; ``orbax_save_return_seconds_median_taken``: over the saves it took); ours takes
  every save and replaces a waiting one with the newer (``saves_coalesced``).

``host_syncs_per_step`` (at ``snapshot_every=10``: the library's own host syncs per step, waits after which the
devices hold no step, the newest one dispatched computed too: a commit before a snapshot) and
``library_seconds_per_step`` (at ``snapshot_every=10``: the median time the loop's thread spends inside
``run.steps``, ``shard_batch`` and ``commit`` per step, less the batch transfer the plain loop makes too, and less
the window's waits: ``steps_in_flight=2`` has each commit wait for the step before it while the newest one is
queued behind it, ``window_waits_per_step`` and ``window_wait_seconds_per_step``; the plain loop's thread waits
the same way inside its jitted calls, whose dispatch jax's CPU client holds once its queue is full,
``plain_dispatch_seconds_per_step``); ``library_cpu_seconds_per_step`` is the same less the host syncs' waits too
(the library's own work per step, in wall time). ``library_thread_cpu_seconds_per_step``: the CPU time the
loop's thread used there (median per step, less the plain loop's for its batch transfer, less its waits',
``wait_thread_cpu_seconds_per_step``: they sleep on an event while a waiter thread blocks on the arrays): its wall
time inside the library includes time off the CPU, waiting for one of the 2 cores beside 8 busy device threads or
for the GIL (see docs/benchmarks.md). ``library_seconds_per_step_in_place`` and
``library_thread_cpu_seconds_per_step_in_place``: the same two, less the batch's transfer timed where it runs, inside
``shard_batch`` at each step, instead of the plain loop's median transfer (``transfer_seconds_elastic`` and
``transfer_seconds_plain``: the same 4 MiB transfer's median took 0.7 ms in one plain run and 2.2 ms in the next).

Figures: ``state_bytes``; ``plain_step_seconds`` and each loop's mean step time (steps after the first two of a
pass: compiles excluded) with its ``ratio_*`` over the plain loop's. An elastic loop's timed stretch starts once the
job's standby executables (the step compiled for every mesh one slice loss away, in the background after the first
step, once per job and view) are compiled: ``standby_compile_seconds_every10`` is that one-time cost, and
``standby_waited_seconds_every10`` how long the loop still waited for it after step 1 (the first job compiles them;
the later ones find most in the persistent compilation cache, so without the wait the ratios were not alike);
``start_seconds`` (entering the job to its first step committed, minus the plain loop's first step, Ray already
up) and ``close_seconds`` (leaving the job).
On this 2-core machine the job's Ray processes (supervisor, agents, keepers) share the cores with the "devices":
part of any ratio above 1 is theirs, not the loop's. ``other_processes_cores_*`` is the CPU every other process on
the machine used during each loop's timed stretch (cores: CPU seconds per second), and ``ratio_*_from_processes``
the ratio those processes alone explain: the plain loop's process used ``c`` cores, so cycles taken by the job's
processes (their cores above the plain stretch's) slow it by ``c / (c - extra)`` where the cores are all busy.
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
from jax.sharding import NamedSharding, PartitionSpec

from elastic import runtime

BATCH = 48  # rows split over 8 devices
AHEAD = 4  # the plain loops dispatch step k once step k - AHEAD has computed
LAYERS = 4
OPT = optax.adam(1e-4)


def cpu_now() -> tuple[float, float, float]:
    """(wall clock, CPU seconds of this process, CPU seconds of every other process) now."""
    me = os.getpid()
    others = 0.0
    for proc in psutil.process_iter():
        if proc.pid != me:
            try:
                t = proc.cpu_times()
                others += t.user + t.system
            except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
                pass
    t = psutil.Process(me).cpu_times()
    return time.perf_counter(), t.user + t.system, others


def cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> dict[str, float]:
    """Cores used between two ``cpu_now`` readings: by this process and by every other one."""
    wall = end[0] - start[0]
    return {"own_cores": (end[1] - start[1]) / wall, "other_cores": (end[2] - start[2]) / wall}


def width_for(mib: float) -> int:
    """The layer width whose parameters and two adam moments make about ``mib`` MiB."""
    return max(64, int((mib * 2**20 / 4 / 3 / LAYERS) ** 0.5))


def width_for_step(seconds: float, probe_mib: float = 32.0) -> int:
    """The layer width whose plain step takes about ``seconds`` here: the step is memory-bound (adam over the
    state), so its time grows with the state's size; measured once at ``probe_mib`` and scaled."""
    probe = plain(width_for(probe_mib), 8)["step_seconds"]
    return width_for(max(1.0, probe_mib * seconds / probe))


def make(width: int):
    def init(key):
        keys = jax.random.split(key, LAYERS)
        params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys]
        return {"params": params, "opt": OPT.init(params)}

    def step(state, x):
        def loss_fn(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = OPT.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return init, step


def batch(step: int, width: int) -> np.ndarray:
    return np.random.default_rng(step).normal(size=(BATCH, width)).astype(np.float32)


def plain(width: int, steps: int) -> dict[str, float]:
    init, step = make(width)
    mesh = runtime.build_mesh(runtime.simulated_topology(4, 2).slices)
    rows = runtime.batch_sharding(mesh)
    state = jax.jit(init, out_shardings=NamedSharding(mesh, PartitionSpec()))(jax.random.key(0))
    fn = jax.jit(step, donate_argnums=0)
    times = []
    transfers, transfer_cpu = [], []
    dispatches = []  # the time each fn call held the loop (jax's CPU client blocks it once its queue is full)
    losses = []
    t0 = time.perf_counter()
    for k in range(steps):
        host = batch(k, width)
        t, c = time.perf_counter(), time.thread_time()
        x = jax.device_put(host, rows)
        transfers.append(time.perf_counter() - t)
        transfer_cpu.append(time.thread_time() - c)
        t = time.perf_counter()
        state, loss = fn(state, x)
        dispatches.append(time.perf_counter() - t)
        losses.append(loss)
        if k >= AHEAD:
            losses[k - AHEAD].block_until_ready()
        if k == 1:  # compiled and warm: time the rest as one pipelined stretch
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t0)
            c1 = cpu_now()
            t1 = time.perf_counter()
        elif k == 0:
            jax.block_until_ready(loss)
            first = time.perf_counter() - t0
    jax.block_until_ready(state)
    return {
        **cores(c1, cpu_now()),
        "step_seconds": (time.perf_counter() - t1) / (steps - 2),
        "first_step_seconds": first,
        "transfer_seconds": statistics.median(transfers[2:]),
        "transfer_cpu_seconds": statistics.median(transfer_cpu[2:]),
        "dispatch_seconds": statistics.mean(dispatches[2:]),
        "state_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(state)),
    }


def saving_loop(width: int, steps: int, which: str) -> dict[str, float]:
    """The plain pipelined loop, saving every step's state as soon as it is dispatched with a Snapshotter: ours
    (``elastic.snapshot``, 2 copies on distinct slices) or Orbax's (``pathways.Snapshotter``, one replica per
    slice; ``pip install -e ".[bench]"``). The mean step time and the median time a ``save`` call held the loop."""
    init, step = make(width)
    mesh = runtime.build_mesh(runtime.simulated_topology(4, 2).slices)
    rows = runtime.batch_sharding(mesh)
    state = jax.jit(init, out_shardings=NamedSharding(mesh, PartitionSpec()))(jax.random.key(0))
    fn = jax.jit(step, donate_argnums=0)
    if which == "ours":
        from elastic.snapshot import SnapshotConfig, Snapshotter

        snap = Snapshotter(SnapshotConfig(), slice_of=lambda d: d.id // 2)
        finish = snap.wait
    else:
        from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter as OrbaxSnapshotter

        snap = OrbaxSnapshotter(replica_axis_index=0)
        finish = snap.join
    skips = _SkipCounter()  # Orbax's Snapshotter skips a save while one is in flight (it logs a warning)
    root = logging.getLogger()
    handlers, root.handlers = root.handlers, [skips]  # counted, not printed (a print would cost Orbax's save)
    logging.disable(logging.NOTSET)
    returns, skipped, losses = [], [], []
    for k in range(steps):
        state, loss = fn(state, jax.device_put(batch(k, width), rows))
        losses.append(loss)
        if k >= AHEAD:
            losses[k - AHEAD].block_until_ready()
        before = skips.count
        t = time.perf_counter()
        snap.save(k, state)
        returns.append(time.perf_counter() - t)
        skipped.append(skips.count > before)
        if k == 1:  # compiled and warm: time the rest as one pipelined stretch
            jax.block_until_ready(loss)
            t1 = time.perf_counter()
        elif k == 0:
            jax.block_until_ready(loss)
    jax.block_until_ready(state)
    step_seconds = (time.perf_counter() - t1) / (steps - 2)
    finish()
    logging.disable(logging.WARNING)
    root.handlers = handlers
    taken = [r for r, s in zip(returns[2:], skipped[2:], strict=True) if not s]
    out = {
        "step_seconds": step_seconds,
        "save_return_median": statistics.median(returns[2:]),
        "saves_skipped": sum(skipped[2:]),
        "save_return_median_taken": statistics.median(taken) if taken else float("nan"),
    }
    if which == "ours":
        out["saves_coalesced"] = snap.stats()["snapshots_coalesced"]
        snap.close()
    return out


class _SkipCounter(logging.Handler):
    """Counts the warnings Orbax's Snapshotter logs for a save it skips (and prints nothing)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Skipping snapshot" in record.getMessage():
            self.count += 1


def elastic_run(width: int, steps: int, every: int, in_flight: int) -> dict[str, float]:
    import elastic.loop.run as run_module
    from elastic import ElasticConfig, ElasticJob, Policy

    init, step = make(width)
    stamps: dict[int, float] = {}
    inside: dict[int, float] = {}  # per step: seconds the loop's thread spent in run.steps, shard_batch and commit
    inside_cpu: dict[int, float] = {}  # ... and the CPU seconds it used there, less its waits'
    wait_cpu: dict[int, float] = {}  # the CPU seconds its waits used
    # per step: the batch's transfer inside shard_batch (the one the plain loop makes too), its seconds and CPU
    transfer: dict[int, float] = {}
    transfer_cpu: dict[int, float] = {}
    moved = {"seconds": 0.0, "cpu": 0.0}
    # the library's waits for the devices: host syncs (after the wait the devices hold no step: the newest
    # dispatched one is computed too) and the window's (an older step, with the newest still queued behind it)
    syncs = {"count": 0, "seconds": 0.0, "window_count": 0, "window_seconds": 0.0, "cpu": 0.0}
    # the time and CPU of this benchmark's own readiness checks in front of the library's waits (taken out of both)
    syncs.update(probe_seconds=0.0, probe_cpu=0.0)
    waited: dict[int, float] = {}  # per step: seconds of its inside time spent waiting for the devices
    synced: dict[int, float] = {}  # ... of which in host syncs
    waits = run_module.wait_ready
    newest: list[object] = [None]  # the state the loop dispatched last

    def computed(tree) -> bool:
        return all(
            x.is_ready() for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()
        )

    def counted(tree, *args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        ready = computed(tree)  # this probe's own check, not the library's: taken out of its time below
        if ready:
            syncs["probe_seconds"] += time.perf_counter() - t
            syncs["probe_cpu"] += time.thread_time() - c
            return waits(tree, *args, **kwargs)
        try:
            return waits(tree, *args, **kwargs)
        finally:
            syncs["cpu"] += time.thread_time() - c
            kind = "" if computed(newest[0]) else "window_"
            syncs[f"{kind}count"] += 1
            syncs[f"{kind}seconds"] += time.perf_counter() - t

    def loop(run):
        state = run.state
        fn = run.jit(step, donate_argnums=0)
        put = run._put_batch  # noqa: SLF001 - the transfer inside shard_batch, timed where it runs

        def timed_put(host):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return put(host)
            finally:
                moved["seconds"], moved["cpu"] = time.perf_counter() - t, time.thread_time() - c

        run.__dict__["_put_batch"] = timed_put
        steps = iter(run.steps)
        while True:
            t, c = time.perf_counter(), time.thread_time()
            k = next(steps, None)
            spent, spent_cpu = time.perf_counter() - t, time.thread_time() - c
            if k is None:
                break
            host = batch(k, width)
            t, c = time.perf_counter(), time.thread_time()
            x = run.shard_batch(host)
            spent, spent_cpu = spent + time.perf_counter() - t, spent_cpu + time.thread_time() - c
            state, loss = fn(state, x)
            newest[0] = state
            t, c, before, window = time.perf_counter(), time.thread_time(), syncs["seconds"], syncs["window_seconds"]
            polled, probed, probed_cpu = syncs["cpu"], syncs["probe_seconds"], syncs["probe_cpu"]
            run.commit(state)
            inside[k] = spent + time.perf_counter() - t - (syncs["probe_seconds"] - probed)
            inside_cpu[k] = (
                spent_cpu + time.thread_time() - c - (syncs["cpu"] - polled) - (syncs["probe_cpu"] - probed_cpu)
            )
            transfer[k], transfer_cpu[k] = moved["seconds"], moved["cpu"]
            wait_cpu[k] = syncs["cpu"] - polled
            synced[k] = syncs["seconds"] - before
            waited[k] = synced[k] + syncs["window_seconds"] - window
            if k == 1 and job.controller is not None:  # the one-time background compiles done: a steady day
                t = time.perf_counter()
                job.controller.wait_for_standbys(600)
                standby["waited"] = time.perf_counter() - t
            stamps[k] = time.perf_counter()
            if k == 1:
                cpu["start"] = cpu_now()
        jax.block_until_ready(state)
        cpu["end"] = cpu_now()
        return state

    config = ElasticConfig(
        simulated=True,
        job_name=f"overhead-{every}-{in_flight}",
        num_slices=4,
        devices_per_slice=2,
        num_steps=steps,
        snapshot_every=every,
        steps_in_flight=in_flight,
        policy=Policy(min_slices=2),
    )
    standby = {"waited": 0.0}
    cpu: dict[str, tuple[float, float, float]] = {}
    t0 = time.perf_counter()
    job = ElasticJob(config, init_fn=init)
    job.__enter__()
    run_module.wait_ready = counted
    try:
        result = job.run(loop)
    finally:
        run_module.wait_ready = waits
    t_closing = time.perf_counter()
    job.__exit__(None, None, None)
    close = time.perf_counter() - t_closing
    assert result.report.steps_committed == steps
    span = stamps[steps - 1] - stamps[1]
    return {
        **cores(cpu["start"], cpu["end"]),
        "step_seconds": span / (steps - 2),
        "first_commit_seconds": stamps[0] - t0,
        "standby_compile_seconds": result.report.standby_compile_seconds,
        "standby_waited_seconds": standby["waited"],
        "close_seconds": close,
        "blocking_seconds": result.report.snapshot_blocking_seconds,
        "host_syncs_per_step": syncs["count"] / steps,
        "window_waits_per_step": syncs["window_count"] / steps,
        "window_wait_seconds_per_step": syncs["window_seconds"] / steps,
        "inside_seconds_per_step": statistics.median(inside[k] - (waited[k] - synced[k]) for k in range(2, steps)),
        "inside_less_waits_seconds_per_step": statistics.median(inside[k] - waited[k] for k in range(2, steps)),
        "inside_thread_cpu_seconds_per_step": statistics.median(inside_cpu[k] for k in range(2, steps)),
        "wait_thread_cpu_seconds_per_step": statistics.median(wait_cpu[k] for k in range(2, steps)),
        # the same, less the batch's transfer timed in place at each step (the plain loop's varies run to run)
        "own_seconds_per_step": statistics.median(
            inside[k] - (waited[k] - synced[k]) - transfer[k] for k in range(2, steps)
        ),
        "own_thread_cpu_seconds_per_step": statistics.median(inside_cpu[k] - transfer_cpu[k] for k in range(2, steps)),
        "transfer_seconds": statistics.median(transfer[k] for k in range(2, steps)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=None, help="the state's size (default 200; multi-process 64)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=None,
        help="size the state so that the plain loop's step takes about this long (replaces --mib)",
    )
    parser.add_argument(
        "--mode", choices=("single", "multi-process"), default="single", help="multi-process: benchmarks/overhead_mp.py"
    )
    parser.add_argument("--repeats", type=int, default=1, help="multi-process: alternations; medians reported")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.mode == "multi-process":
        from overhead_mp import run

        print(json.dumps(run(args.mib or 64.0, args.steps, args.repeats), indent=1))
        return 0
    logging.disable(logging.WARNING)  # Orbax's and Ray's loggers: errors still show
    from elastic.control.cluster import connect
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)  # ours likewise: both sides' info lines stay off the loop's thread

    t = time.perf_counter()
    connect()
    ray_start = time.perf_counter() - t
    width = width_for(args.mib or 200.0) if args.step_seconds is None else width_for_step(args.step_seconds)
    base = plain(width, args.steps)
    runs = {
        "every10": elastic_run(width, args.steps, 10, 2),
        "every1": elastic_run(width, args.steps, 1, 2),
        "every10_in_flight1": elastic_run(width, args.steps, 10, 1),
    }
    saving = {which: saving_loop(width, args.steps, which) for which in ("ours", "orbax")}
    again = plain(width, args.steps)  # the machine drifts: the baseline before and after, the mean of both
    plain_step = statistics.mean([base["step_seconds"], again["step_seconds"]])
    out: dict[str, float | int] = {
        "state_bytes": base["state_bytes"],
        "width": width,
        "steps": args.steps,
        "ray_start_seconds": round(ray_start, 2),
        "plain_step_seconds": round(plain_step, 4),
    }
    own = statistics.mean([base["own_cores"], again["own_cores"]])  # what the plain loop's process used
    idle = statistics.mean([base["other_cores"], again["other_cores"]])  # the rest of the machine meanwhile
    out["other_processes_cores_plain"] = round(idle, 3)
    for name, r in runs.items():
        out[f"step_seconds_{name}"] = round(r["step_seconds"], 4)
        out[f"ratio_{name}"] = round(r["step_seconds"] / plain_step, 3)
        out[f"other_processes_cores_{name}"] = round(r["other_cores"], 3)
        extra = max(0.0, r["other_cores"] - idle)
        out[f"ratio_{name}_from_processes"] = round(own / (own - extra), 3)
    out["start_seconds"] = round(runs["every10"]["first_commit_seconds"] - base["first_step_seconds"], 2)
    out["close_seconds"] = round(runs["every10"]["close_seconds"], 2)
    # once per job (and per view change), in the background: before the timed stretch, reported apart
    out["standby_compile_seconds_every10"] = runs["every10"]["standby_compile_seconds"]
    out["standby_waited_seconds_every10"] = round(runs["every10"]["standby_waited_seconds"], 2)
    out["snapshot_blocking_seconds_every1"] = runs["every1"]["blocking_seconds"]
    out["host_syncs_per_step"] = round(runs["every10"]["host_syncs_per_step"], 3)
    out["window_waits_per_step"] = round(runs["every10"]["window_waits_per_step"], 3)
    out["window_wait_seconds_per_step"] = round(runs["every10"]["window_wait_seconds_per_step"], 4)
    out["plain_dispatch_seconds_per_step"] = round(
        statistics.mean([base["dispatch_seconds"], again["dispatch_seconds"]]), 4
    )
    transfer = statistics.mean([base["transfer_seconds"], again["transfer_seconds"]])
    out["library_seconds_per_step"] = round(runs["every10"]["inside_seconds_per_step"] - transfer, 4)
    out["library_cpu_seconds_per_step"] = round(runs["every10"]["inside_less_waits_seconds_per_step"] - transfer, 4)
    transfer_cpu = statistics.mean([base["transfer_cpu_seconds"], again["transfer_cpu_seconds"]])
    out["library_thread_cpu_seconds_per_step"] = round(
        runs["every10"]["inside_thread_cpu_seconds_per_step"] - transfer_cpu, 5
    )
    out["library_seconds_per_step_in_place"] = round(runs["every10"]["own_seconds_per_step"], 4)
    out["library_thread_cpu_seconds_per_step_in_place"] = round(runs["every10"]["own_thread_cpu_seconds_per_step"], 5)
    out["transfer_seconds_elastic"] = round(runs["every10"]["transfer_seconds"], 4)
    out["transfer_seconds_plain"] = round(transfer, 4)
    out["wait_thread_cpu_seconds_per_step"] = round(runs["every10"]["wait_thread_cpu_seconds_per_step"], 5)
    out["snapshotter_ratio_every1"] = round(saving["ours"]["step_seconds"] / plain_step, 3)
    out["orbax_ratio_every1"] = round(saving["orbax"]["step_seconds"] / plain_step, 3)
    out["save_return_seconds_median"] = round(saving["ours"]["save_return_median"], 4)
    out["orbax_save_return_seconds_median"] = round(saving["orbax"]["save_return_median"], 4)
    # Orbax returns at once from a save it skips (one in flight); ours coalesces the waiting one instead
    out["orbax_saves_skipped"] = saving["orbax"]["saves_skipped"]
    out["orbax_save_return_seconds_median_taken"] = round(saving["orbax"]["save_return_median_taken"], 4)
    out["saves_coalesced"] = saving["ours"]["saves_coalesced"]
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
