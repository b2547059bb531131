"""Multi-process recovery from a SIGKILLed worker process, against restarting every process from Orbax.

    .venv/bin/python benchmarks/recovery_mp.py --json [--mib 256] [--kill-at 12] [--steps 16] [--repeats 3]

Ours: an ``ElasticJob`` with ``ElasticConfig(processes=Processes(replace_lost=False))`` runs 4 worker processes
(Ray actors, 2 CPU devices each, joined by ``jax.distributed`` over gloo) on a state of ``--mib`` MiB (8 float32
leaves, each split over the 2 devices of a worker and replicated across workers), a host snapshot every 5 steps.
The loop holds before the step ahead of ``--kill-at`` until the standby compiles for the 3-worker group are done (a
failure
on a job past its first minutes); then slice 1's process SIGKILLs itself (``Faults.kill_slice``). The 3 survivors
leave the broken group (the driver sees the process die and aborts their pass), re-form in place and restore from
their host snapshots. ``resume_seconds``: the failure caught -> the first step committed by the re-formed group
(the report's ``recovery_seconds``); its phases from the job's timeline: ``decide`` (-> the supervisor's view
without the slice), ``restore`` (-> the group formed and the state in place: ``reform_seconds`` of it is the new
``jax.distributed`` group), ``first_step``. ``compile_seconds_on_recovery_path``: XLA compile time inside the
workers from the restore to their first commit (a standby compile makes it a persistent-cache read).

Baseline: what a restart-based job (Ray Train's elastic JaxTrainer, MaxText) pays at that moment: 3 FRESH worker
processes (Ray actors, the same environment as ours) import jax and orbax, join a new group through a
coordination service hosted here, build the same mesh over their 6 devices, restore the same state from an
Orbax checkpoint (written beforehand by this process; checksums compared), compile the step and run it.
``baseline_resume_seconds``: the actors created -> every process's first step done; its phases are the critical
path through the workers' clocks (``start_and_import``, ``join``, ``restore``, ``compile_and_step``). The baseline
pays neither detection nor rescheduling, ours pays both.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import ray
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from elastic.runtime import distributed
from elastic.runtime.mesh import LOCAL_AXIS, batch_sharding, default_mesh

__all__ = ["run", "main"]

LEAVES, COLS, BATCH, SLICES, DEVICES = 8, 1024, 48, 4, 2  # BATCH splits over 8 and 6 devices
SPEC = P(LOCAL_AXIS)  # split over a worker's 2 devices, replicated across workers


def rows_for(mib: int) -> int:
    return mib * 1024 * 1024 // 4 // LEAVES // COLS


def init_fn(rows: int):
    def init(key: jax.Array) -> dict[str, jax.Array]:
        keys = jax.random.split(key, LEAVES)
        return {f"w{i}": jax.random.normal(keys[i], (rows, COLS)) * 0.01 for i in range(LEAVES)}

    return init


def shardings_fn(mesh: Any) -> dict[str, P]:
    return {f"w{i}": SPEC for i in range(LEAVES)}


def train_step(state: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
    g = jnp.tanh(x).mean()  # a reduction over every device of the group: a cross-process collective
    return {k: w * 0.999 + 0.001 * g for k, w in state.items()}


def batch(step: int) -> np.ndarray:
    return np.random.default_rng(step).normal(size=(BATCH, COLS)).astype(np.float32)


def loop(run: Any) -> Any:
    state = run.state
    step_fn = run.jit(train_step, donate_argnums=0)
    for step in run.steps:
        state = step_fn(state, run.shard_batch(batch(step)))
        run.commit(state)
    return state


def checksum(state: dict[str, jax.Array]) -> float:
    """Sum of every leaf in float64, from this process's shards (each process holds every leaf whole)."""
    total = 0.0
    for leaf in state.values():
        seen = set()
        for shard in leaf.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            if key not in seen:
                seen.add(key)
                total += float(np.asarray(shard.data, dtype=np.float64).sum())
    return total


class FreshWorker:
    """One process of the restarted job (a Ray actor): its clock starts when its constructor ends."""

    def __init__(self) -> None:
        importlib.import_module("orbax.checkpoint")  # jax came with this class; a restore needs orbax too
        self.ready_at = time.time()

    def resume(self, address: str, index: int, path: str, rows: int, step: int) -> dict[str, Any]:
        import orbax.checkpoint as ocp

        t: dict[str, float] = {"ready": self.ready_at}
        distributed.reform(address, SLICES - 1, index)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = default_mesh([[d for d in devices if d.process_index == p] for p in range(jax.process_count())])
        t["joined"] = time.time()
        target = {
            f"w{i}": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=NamedSharding(mesh, SPEC))
            for i in range(LEAVES)
        }
        ckptr = ocp.StandardCheckpointer()
        state = ckptr.restore(path, target)
        jax.block_until_ready(state)
        t["restored"] = time.time()
        total = checksum(state)
        host = batch(step)
        x = jax.make_array_from_callback(host.shape, batch_sharding(mesh), lambda i: host[i])
        state = jax.jit(train_step, donate_argnums=0)(state, x)
        jax.block_until_ready(state)
        t["stepped"] = time.time()
        ckptr.close()
        return {"t": t, "checksum": total, "devices": len(devices), "pid": os.getpid()}

    def leave(self) -> float:
        return distributed.leave()


def _held_loop(hold_at: int, flag: str) -> Any:
    """The loop, holding before ``hold_at`` until the driver sets ``flag`` in Ray's internal KV (standbys ready)."""

    def held(run: Any) -> Any:
        from elastic.supervision.ray_internals import kv_exists

        state = run.state
        step_fn = run.jit(train_step, donate_argnums=0)
        for step in run.steps:
            if step == hold_at:
                deadline = time.monotonic() + 300
                while not kv_exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
            state = step_fn(state, run.shard_batch(batch(step)))
            run.commit(state)
        return state

    return held


def run_ours(mib: int, kill_at: int, steps: int) -> dict[str, Any]:
    import threading

    from elastic import ElasticConfig, ElasticJob, Faults, Policy, Processes, Tiers
    from elastic.supervision.ray_internals import kv_del, kv_put

    flag = f"recovery-mp-standby-{os.getpid()}-{time.time_ns()}"
    config = ElasticConfig(
        simulated=True,
        job_name="bench-recovery-mp",
        num_slices=SLICES,
        devices_per_slice=DEVICES,
        num_steps=steps,
        snapshot_every=5,
        policy=Policy(min_slices=2),
        tiers=Tiers(keeper_every=0),
        processes=Processes(replace_lost=False),
    )
    job = ElasticJob(
        config,
        init_fn=init_fn(rows_for(mib)),
        shardings_fn=shardings_fn,
        faults=Faults().kill_slice(1, at_step=kill_at),
    )

    def release() -> None:  # once the standby group compiled the step for 3 workers, let the group go on
        deadline = time.monotonic() + 300
        while job.controller is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if job.controller is not None:
            job.controller.wait_for_standbys(300)
        kv_put(flag, b"1")

    with job:
        threading.Thread(target=release, daemon=True).start()
        result = job.run(_held_loop(kill_at - 1, flag))  # held before the step that kills
    kv_del(flag)
    report = result.report.to_dict()
    _wait_gone(list(report["worker_pids"].values()))
    events = report["timeline"]
    t_fail = next(e["t"] for e in events if e["event"] == "failure")
    t_view = next(e["t"] for e in events if e["event"] == "detected" and e["t"] >= t_fail)
    t_restored = next(e["t"] for e in events if e["event"] == "restored" and e["t"] >= t_fail)
    resume = report["recovery_seconds"][0]
    restore_phases = next(e for e in events if e["event"] == "restored" and e["t"] >= t_fail).get("phases") or {}
    held = rows_for(mib) * COLS * 4 * LEAVES  # each worker holds every leaf (split over its 2 devices)
    return {
        "resume_seconds": resume,
        "restore_gbps": round(held / restore_phases["placed"] / 1e9, 2) if restore_phases.get("placed") else None,
        "phases": {
            "decide": round(t_view - t_fail, 3),
            "restore": round(t_restored - t_view, 3),
            "first_step": round(t_fail + resume - t_restored, 3),
        },
        "compile_seconds_on_recovery_path": report["recovery_compile_seconds"][0],
        "standby_compiles": report["standby_compiles"],
        "standby_skipped": report["standby_skipped"],
        "snapshot_seconds_per_snapshot": round(
            report["snapshot_blocking_seconds"] / max(1, report["snapshots_taken"]), 4
        ),
        "restore_phases": restore_phases,
        "first_step_in_workers": report.get("recovery_first_step", [None])[0],
        "restore_from_step": report["restores"][0]["step"],
        "restore_tier": report["restores"][0]["tier"],
        **{
            k: report[k]
            for k in (
                "reform_seconds",
                "worker_processes_restarted",
                "survivors_lost",
                "steps_recomputed",
                "duplicate_steps",
                "skipped_steps",
                "steps_committed",
                "slices_final",
            )
        },
    }


def run_baseline(mib: int, kill_at: int) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    rows = rows_for(mib)
    local = np.array(jax.devices()[: SLICES * DEVICES]).reshape(SLICES, DEVICES)
    mesh = default_mesh(local)
    state = jax.jit(init_fn(rows), out_shardings=NamedSharding(mesh, SPEC))(jax.random.key(0))
    expected = checksum(state)
    cls = ray.remote(FreshWorker).options(
        num_cpus=0, max_restarts=0, runtime_env={"env_vars": distributed.collective_env(DEVICES)}
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(path, state)
        ckptr.wait_until_finished()
        ckptr.close()
        del state
        service = distributed.CoordinationService(SLICES - 1)
        workers: list[Any] = []
        try:
            t0 = time.time()
            workers = [cls.remote() for _ in range(SLICES - 1)]
            outs = ray.get(
                [w.resume.remote(service.address, i, path, rows, kill_at) for i, w in enumerate(workers)], timeout=300
            )
            ray.wait([w.leave.remote() for w in workers], num_returns=len(workers), timeout=10)
        finally:
            for w in workers:
                ray.kill(w, no_restart=True)
            service.stop()
    _wait_gone([o["pid"] for o in outs])
    end = {k: max(o["t"][k] for o in outs) for k in ("ready", "joined", "restored", "stepped")}
    return {
        "resume_seconds": round(end["stepped"] - t0, 3),
        "phases": {
            "start_and_import": round(end["ready"] - t0, 3),
            "join": round(end["joined"] - end["ready"], 3),
            "restore": round(end["restored"] - end["joined"], 3),
            "compile_and_step": round(end["stepped"] - end["restored"], 3),
        },
        "checksum_ok": all(abs(o["checksum"] - expected) <= 1e-9 * max(1.0, abs(expected)) for o in outs),
        "devices": outs[0]["devices"],
    }


def memcpy_gbps(nbytes: int) -> float:
    """This machine's memory copy rate: ``nbytes`` copied between two buffers already touched (the best of 3)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Until the processes ``pids`` exited (killed workers must not share the 2 cores with what follows)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)


def run(mib: int, kill_at: int, steps: int, repeats: int = 3) -> dict[str, Any]:
    """Ours and the baseline, ``repeats`` times each, alternating, in this process's Ray (an embedded one started,
    and shut down, if none). The top-level figures are the medians (this machine is noisy; one kill is one sample);
    the details are those of the median trial of ours; ``trials`` lists every pair."""
    from ray import cloudpickle

    from elastic.control.cluster import connect

    if __name__ != "__main__":  # Ray workers may not find this file's module: send its functions by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = connect()
    ours_runs: list[dict[str, Any]] = []
    base_runs: list[dict[str, Any]] = []
    try:
        for _ in range(repeats):
            ours_runs.append(run_ours(mib, kill_at, steps))
            base_runs.append(run_baseline(mib, kill_at))
    finally:
        if started:
            ray.shutdown()
    trials = [
        {
            "resume_seconds": o["resume_seconds"],
            "baseline_resume_seconds": b["resume_seconds"],
            "speedup": round(b["resume_seconds"] / o["resume_seconds"], 2),
            "compile_share_of_resume": round(o["compile_seconds_on_recovery_path"] / o["resume_seconds"], 3),
            "restore_gbps": o["restore_gbps"],
        }
        for o, b in zip(ours_runs, base_runs, strict=True)
    ]
    memcpy = memcpy_gbps(rows_for(mib) * COLS * 4 * LEAVES)
    ours = dict(sorted(ours_runs, key=lambda o: o["resume_seconds"])[len(ours_runs) // 2])
    restore_gbps = float(np.median([o["restore_gbps"] or 0.0 for o in ours_runs]))
    base = sorted(base_runs, key=lambda b: b["resume_seconds"])[len(base_runs) // 2]
    resume = ours.pop("resume_seconds")
    ours.pop("restore_gbps")
    compile_share = float(np.median([t["compile_share_of_resume"] for t in trials]))
    speedup = round(base["resume_seconds"] / resume, 2)
    return {
        "state_bytes": rows_for(mib) * COLS * 4 * LEAVES,
        "repeats": repeats,
        "resume_seconds": resume,
        "baseline_resume_seconds": base["resume_seconds"],
        "speedup": speedup,
        "compile_share_of_resume": round(compile_share, 3),
        "restore_gbps": round(restore_gbps, 2),
        "memcpy_gbps": round(memcpy, 2),
        "checks": {
            "speedup>=20": speedup >= 20,
            "restore_gbps>=memcpy_gbps/2": restore_gbps >= memcpy / 2,
            "compile<=5%_of_resume": compile_share <= 0.05,
            "every_baseline_checksum_ok": all(b["checksum_ok"] for b in base_runs),
            "survivors_lost_0": all(o["survivors_lost"] == 0 for o in ours_runs),
        },
        "trials": trials,
        **ours,
        "baseline_phases": base["phases"],
        "baseline_checksum_ok": base["checksum_ok"],
        "baseline_devices": base["devices"],
    }


def main() -> None:
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="trials of each; medians are reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args()
    print(json.dumps(run(args.mib, args.kill_at, args.steps, args.repeats), indent=1))


if __name__ == "__main__":
    main()
