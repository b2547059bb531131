"""Multi-controller recovery from a SIGKILLed worker process, against restarting every process from Orbax.

    .venv/bin/python benchmarks/recovery_mp.py --json [--mib 64] [--kill-at 12] [--steps 16]

Ours: ``elastic.placements.mc_driver.McDriver`` runs 4 worker processes (Ray actors, 2 CPU devices each, joined by
``jax.distributed`` over gloo) on a state of ``--mib`` MiB (8 float32 leaves, each split over the 2 devices
of a worker and replicated across workers), a host snapshot every 5 steps. When the group reaches step
``--kill-at``, slice 1's process is SIGKILLed (no replacement is started: ``replace_lost=False``); the 3
survivors leave the broken group (the driver sees the process die and aborts the others' pass; one whose
collective broke first reports that), re-form the group in place and resume from their host snapshots.
``resume_seconds``: the kill -> the first step committed by the re-formed group; its phases, from the
driver's timeline: ``leave_broken_group`` (-> every member of the old group has left it: lost, collective
failed, or aborted), ``regroup`` (-> the new group formed), ``restore_and_first_step`` (-> the first commit).
``survivor_failures`` says how each survivor left: ``aborted``, ``connection broke`` or ``timed out`` (gloo's
collective timeout, ``McConfig.collective_timeout_s``: the bound when the driver cannot see the loss).

Ours runs twice: with host snapshots kept in node files (``McConfig.node_store``, the default: they outlive a
worker process) and in process memory only (``in_memory_only``), so that ``snapshot_seconds_per_snapshot`` shows
what keeping them on the node costs the training thread.

Baseline: what a restart-based job (Ray Train's elastic JaxTrainer, MaxText) pays at that moment: 3 FRESH
worker processes (Ray actors, same env as McDriver's) import jax and orbax, join a new group through a
coordination service hosted here, build the same mesh over their 6 devices, restore the same state from an
Orbax checkpoint (written beforehand by this process; checksums compared), compile the step and run it.
``baseline_resume_seconds``: the actors created -> every process's first step done; its phases are the
critical path through the workers' clocks (``start_and_import``, ``join``, ``restore``, ``compile_and_step``).

Not the same footing: ours includes detecting the failure and leaving the broken group, while the baseline
pays neither detection nor rescheduling. ``ours_without_leaving`` (resume less the ``leave_broken_group``
phase) and its ``speedup_without_leaving`` show ours on the baseline's footing.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from runtime import distributed  # noqa: E402
from runtime.mesh import LOCAL_AXIS, batch_sharding, default_mesh  # noqa: E402

__all__ = ["run", "main"]

LEAVES, COLS, BATCH, SLICES, DEVICES = 8, 1024, 48, 4, 2  # BATCH splits over 8 and 6 devices
SPEC = P(LOCAL_AXIS)  # split over a worker's 2 devices, replicated across workers


def rows_for(mib: int) -> int:
    return mib * 1024 * 1024 // 4 // LEAVES // COLS


def init_fn(rows: int):  # noqa: ANN201 - a jax init function
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
        target = {f"w{i}": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=NamedSharding(mesh, SPEC))
                  for i in range(LEAVES)}
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


def run_ours(mib: int, kill_at: int, steps: int, node_store: bool = True) -> dict[str, Any]:
    from elastic.config import Policy
    from elastic.demos.processes import ProcessFaults
    from elastic.placements.mc_driver import McConfig, McDriver

    config = McConfig(num_steps=steps, num_slices=SLICES, devices_per_slice=DEVICES, snapshot_every=5,
                      policy=Policy(min_slices=2), replace_lost=False, node_store=node_store)
    hook = ProcessFaults(kill_slice=1, kill_at=kill_at, revive_at=None)
    with McDriver(config, init_fn=init_fn(rows_for(mib)), loop=loop, shardings_fn=shardings_fn,
                  hooks=(hook,)) as driver:
        report = driver.run()["report"]
        pids = list(driver.pids.values())
    _wait_gone(pids)
    events = report["timeline"]
    t_kill = next(e["t"] for e in events if e["event"] == "worker_killed")
    t_group = next(e["t"] for e in events if e["event"] == "group_formed" and e["t"] >= t_kill)
    t_left = max(e["t"] for e in events if e["event"] in ("collective_failed", "worker_lost", "worker_stuck_killed")
                 and t_kill <= e["t"] <= t_group)
    resume = report["recovery_seconds"][0]
    errors = [e["error"] for e in events if e["event"] == "collective_failed" and t_kill <= e["t"] <= t_group]
    return {
        "resume_seconds": resume,
        "snapshot_seconds_per_snapshot": round(report["snapshot_blocking_seconds"] / report["snapshots_taken"], 4),
        "collective_timeout_s": config.collective_timeout_s,
        "phases": {"leave_broken_group": round(t_left - t_kill, 3), "regroup": round(t_group - t_left, 3),
                   "restore_and_first_step": round(t_kill + resume - t_group, 3)},
        "survivor_failures": ["aborted" if e.startswith("aborted") else "timed out" if "Timed out" in e
                              else "connection broke" for e in errors],
        "restore_from_step": next(e["step"] for e in events if e["event"] == "restore_from"),
        **{k: report[k] for k in ("detection_seconds", "reform_seconds", "worker_processes_restarted",
                                  "survivors_lost", "steps_recomputed", "duplicate_steps", "skipped_steps",
                                  "steps_committed", "slices_final")},
    }


def run_baseline(mib: int, kill_at: int) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    rows = rows_for(mib)
    local = np.array(jax.devices()[:SLICES * DEVICES]).reshape(SLICES, DEVICES)
    mesh = default_mesh(local)
    state = jax.jit(init_fn(rows), out_shardings=NamedSharding(mesh, SPEC))(jax.random.key(0))
    expected = checksum(state)
    cls = ray.remote(FreshWorker).options(num_cpus=0, max_restarts=0,
                                          runtime_env={"env_vars": distributed.collective_env(DEVICES)})
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
            outs = ray.get([w.resume.remote(service.address, i, path, rows, kill_at) for i, w in enumerate(workers)],
                           timeout=300)
            ray.wait([w.leave.remote() for w in workers], num_returns=len(workers), timeout=10)
        finally:
            for w in workers:
                ray.kill(w, no_restart=True)
            service.stop()
    _wait_gone([o["pid"] for o in outs])
    end = {k: max(o["t"][k] for o in outs) for k in ("ready", "joined", "restored", "stepped")}
    return {
        "resume_seconds": round(end["stepped"] - t0, 3),
        "phases": {"start_and_import": round(end["ready"] - t0, 3), "join": round(end["joined"] - end["ready"], 3),
                   "restore": round(end["restored"] - end["joined"], 3),
                   "compile_and_step": round(end["stepped"] - end["restored"], 3)},
        "checksum_ok": all(abs(o["checksum"] - expected) <= 1e-9 * max(1.0, abs(expected)) for o in outs),
        "devices": outs[0]["devices"],
    }


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


def run(mib: int, kill_at: int, steps: int) -> dict[str, Any]:
    """Ours and the baseline, in this process's Ray (an embedded one started, and shut down, if none)."""
    from ray import cloudpickle

    from elastic.control.cluster import connect

    if __name__ != "__main__":  # Ray workers may not find this file's module: send its functions by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = connect()
    try:
        ours = run_ours(mib, kill_at, steps)
        in_memory = run_ours(mib, kill_at, steps, node_store=False)
        base = run_baseline(mib, kill_at)
    finally:
        if started:
            ray.shutdown()
    resume = ours.pop("resume_seconds")
    without = round(resume - ours["phases"]["leave_broken_group"], 3)
    return {
        "state_bytes": rows_for(mib) * COLS * 4 * LEAVES,
        "resume_seconds": resume,
        "baseline_resume_seconds": base["resume_seconds"],
        "speedup": round(base["resume_seconds"] / resume, 2),
        "ours_without_leaving": without,
        "in_memory_only": {"resume_seconds": in_memory["resume_seconds"],
                           "snapshot_seconds_per_snapshot": in_memory["snapshot_seconds_per_snapshot"]},
        "speedup_without_leaving": round(base["resume_seconds"] / without, 2),
        **ours,
        "baseline_phases": base["phases"],
        "baseline_checksum_ok": base["checksum_ok"],
        "baseline_devices": base["devices"],
    }


def main() -> None:
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args()
    print(json.dumps(run(args.mib, args.kill_at, args.steps), indent=1))


if __name__ == "__main__":
    main()
