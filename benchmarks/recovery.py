"""Recovery from a slice loss, in process, against a restart from an Orbax checkpoint, in one run.

    .venv/bin/python benchmarks/recovery.py --json [--mib 256] [--kill-at 12] [--mode single|multi-process|both]

An elastic job trains a state of ``--mib`` MiB (8 leaves split over the 2 devices of a slice,
replicated across 4 slices) with a snapshot every 5 steps. Once its standby executables are ready,
slice 1 is killed as step ``--kill-at`` starts. Measured from the job's timeline:
``resume_seconds`` (the kill -> the first step on the 3 surviving slices completed), and its phases:
``detect`` (kill -> the slice-loss error caught), ``decide`` (-> a view without the slice),
``restore`` (-> the newest snapshot placed on the survivors), ``first_step`` (-> committed).
``compile_seconds_on_recovery_path`` sums the XLA compilations that finished inside that window.
``restore_gbps``: bytes placed on the survivors' devices over the restore phase (less any time it waits
for a snapshot still in flight, which is reported apart). ``restore_source`` says where they came from:
``staged`` (the snapshot of step 10 was still being copied: its staged shards were taken, a survivor's
own shard kept in place, counted in ``shards_kept_in_place``, the others copied) or ``copies`` (the
host copies of a complete snapshot, all copied). ``copy_gbps`` is the rate of the bytes actually copied.

The job runs twice. The top-level figures come from the failure as described: the snapshot of step 10
is then still being copied (on this machine a copy of 2 x 256 MiB takes longer than two steps), the
case a failure usually meets. ``settled`` holds the same figures when the job first waits for that copy
to complete, so the restore reads the complete snapshot's host copies.

Baseline: what a restart-based job pays at that moment, in a fresh process: import jax and orbax,
restore the same state from an Orbax checkpoint onto the survivors' mesh, compile the step, run it
(not even counting rescheduling the job). ``speedup`` = baseline / ours.

``--mode multi-process`` (or ``both``) measures the multi-process case instead (or as well), printed under
``"multi_process"`` (benchmarks/recovery_mp.py, which also runs alone): 4 worker processes joined by
``jax.distributed`` (an ``ElasticJob`` with ``Processes``), one SIGKILLed at ``--kill-at``, the 3 survivors
re-forming in place from their host snapshots, against 3 fresh processes that import jax, join a new group,
restore an Orbax checkpoint, compile and step. Ours includes detecting the loss (the baseline pays none).
The default ``--mode single`` prints what it always did.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The repository root before this folder: benchmarks/snapshot.py must not shadow the snapshot package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

LEAVES, COLS, BATCH = 8, 1024, 48

COMPILES: list[tuple[float, float]] = []  # (wall time at the end, seconds)
_lock = threading.Lock()


def _listen(name: str, secs: float, **kwargs: object) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        with _lock:
            COMPILES.append((time.time(), secs))


def rows_for(mib: int) -> int:
    return mib * 1024 * 1024 // 4 // LEAVES // COLS


def init_fn(rows: int):
    def init(key):
        keys = jax.random.split(key, LEAVES)
        return {f"w{i}": jax.random.normal(keys[i], (rows, COLS)) * 0.01 for i in range(LEAVES)}

    return init


def train_step(state, x):
    g = jnp.tanh(x).mean()
    return {k: w * 0.999 + 0.001 * g for k, w in state.items()}


def batch(step: int) -> np.ndarray:
    return np.random.default_rng(step).normal(size=(BATCH, COLS)).astype(np.float32)


BASELINE = textwrap.dedent("""
    import os, sys, time, json
    t0 = time.perf_counter()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"; os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, {bench!r})
    from recovery import train_step, batch, LEAVES, COLS
    t_import = time.perf_counter()
    devices = [d for d in jax.devices() if d.id not in (2, 3)]  # slice 1 is gone
    mesh = Mesh(np.array(devices).reshape(3, 2), ("replica", "local"))
    target = {{f"w{{i}}": jax.ShapeDtypeStruct(({rows}, COLS), np.float32, sharding=NamedSharding(mesh, P("local")))
              for i in range(LEAVES)}}
    state = ocp.StandardCheckpointer().restore({path!r}, target)
    jax.block_until_ready(state); t_restore = time.perf_counter()
    x = jax.device_put(batch({step}), NamedSharding(mesh, P(("replica", "local"))))
    state = jax.jit(train_step, donate_argnums=0)(state, x); jax.block_until_ready(state)
    t_step = time.perf_counter()
    print(json.dumps({{"import": t_import - t0, "restore": t_restore - t_import,
                      "compile_and_step": t_step - t_restore}}))
""")


def run_elastic(mib: int, kill_at: int, steps: int, settled: bool) -> tuple[dict, object, float]:
    from elastic import ElasticConfig, ElasticJob, Faults, Policy, Run, Tiers

    rows = rows_for(mib)
    cfg = ElasticConfig(
        simulated=True,
        job_name="bench-recovery-settled" if settled else "bench-recovery",
        num_steps=steps,
        snapshot_every=5,
        keep_snapshots=2,
        policy=Policy(min_slices=2),
        tiers=Tiers(keeper_every=0),
    )
    job = ElasticJob(
        cfg,
        init_fn=init_fn(rows),
        shardings_fn=lambda mesh: {f"w{i}": P("local") for i in range(LEAVES)},
        faults=Faults().kill_slice(1, at_step=kill_at),
    )

    def loop(run: Run):
        state = run.state
        step = run.jit(train_step, donate_argnums=0)
        for s in run.steps:
            state = step(state, run.shard_batch(batch(s)))
            run.commit(state)
            if s == kill_at - 1 and job.controller is not None:
                job.controller.wait_for_standbys(300)  # the failure comes once standbys are ready
                if settled:
                    job.latest_snapshot()  # ... and once the newest snapshot's copy is complete
        return state

    with job:
        result = job.run(loop)
    return result.report.to_dict(), result.state, job.timeline.start


def measure(report: dict, state: object, job_start: float) -> dict:
    """The recovery's figures, from the job's timeline and the XLA compilations seen."""
    t = {
        e["event"]: e["t"]
        for e in report["timeline"]
        if e["event"] in ("inject_kill", "failure", "detected", "restored", "first_step")
    }
    restored = next(e for e in report["timeline"] if e["event"] == "restored")
    waited = restored.get("waited_for_snapshot_s", 0.0)
    phases = {
        "detect": t["failure"] - t["inject_kill"],
        "decide": t["detected"] - t["failure"],
        "restore": t["restored"] - t["detected"],
        "first_step": t["first_step"] - t["restored"],
    }
    leaves = jax.tree_util.tree_leaves(state)
    placed = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    copied = placed - restored.get("shards_kept", 0) * (placed // sum(len(x.addressable_shards) for x in leaves))
    window = (job_start + t["inject_kill"], job_start + t["first_step"] + 0.002)
    return {
        "resume_seconds": t["first_step"] - t["inject_kill"],
        "compile_seconds_on_recovery_path": round(
            sum(secs for end, secs in COMPILES if window[0] <= end <= window[1]), 4
        ),
        "restore_gbps": round(placed / (phases["restore"] - waited) / 1e9, 2),
        "copy_gbps": round(copied / (phases["restore"] - waited) / 1e9, 2),
        "restore_waited_for_snapshot_in_flight_seconds": waited,
        "restore_source": restored.get("source"),
        "shards_kept_in_place": restored.get("shards_kept", 0),
        "landed": bool(restored.get("landed", False)),
        **({"not_landed": restored["not_landed"]} if restored.get("not_landed") else {}),  # why, when it did not
        "restored_bytes_on_devices": placed,
        "phases": {k: round(v, 3) for k, v in phases.items()},
        "restore_tier": report["restores"][0]["tier"] if report["restores"] else None,
        "standby_compiles": report["standby_compiles"],
        "standby_compile_seconds": report["standby_compile_seconds"],
        "steps_recomputed": report["steps_recomputed"],
    }


def main() -> None:
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--mode",
        choices=("single", "multi-process", "both"),
        default="single",
        help="single-process (default), multi-process (benchmarks/recovery_mp.py), or both",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="multi-process: trials of ours and of the baseline; medians are reported"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args()
    if args.mode == "multi-process":
        print(json.dumps({"multi_process": _multi_process(args)}, indent=1))
        return
    started = False
    if args.mode == "both":  # one Ray for every job of the run
        from elastic.control.cluster import connect

        started = connect()
    try:
        result = _single(args)
        if args.mode == "both":
            result["multi_process"] = _multi_process(args)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(json.dumps(result, indent=1))


def _multi_process(args: argparse.Namespace) -> dict:
    from recovery_mp import run

    return run(args.mib, args.kill_at, args.steps, args.repeats)


def _single(args: argparse.Namespace) -> dict:
    mib = args.mib
    jax.monitoring.register_event_duration_secs_listener(_listen)
    report, settled_state, start = run_elastic(mib, args.kill_at, args.steps, settled=True)
    settled = measure(report, settled_state, start)
    del settled_state
    report, state, start = run_elastic(mib, args.kill_at, args.steps, settled=False)
    ours = measure(report, state, start)
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))

    src = np.ones(state_bytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    memcpy = state_bytes / (time.perf_counter() - t0) / 1e9
    del src, dst

    import orbax.checkpoint as ocp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(path, state)
        ckptr.wait_until_finished()
        del state
        code = BASELINE.format(
            bench=os.path.dirname(os.path.abspath(__file__)), rows=rows_for(mib), path=path, step=args.kill_at
        )
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
        baseline = time.perf_counter() - t0
        parts = json.loads(out.stdout.strip().splitlines()[-1])
    result = {
        "state_bytes": state_bytes,
        "resume_seconds": round(ours["resume_seconds"], 3),
        "baseline_resume_seconds": round(baseline, 3),
        "speedup": round(baseline / ours["resume_seconds"], 2),
        **{k: v for k, v in ours.items() if k != "resume_seconds"},
        "memcpy_gbps": round(memcpy, 2),
        "baseline_phases": {k: round(v, 3) for k, v in parts.items()},
    }
    result["settled"] = {
        "resume_seconds": round(settled["resume_seconds"], 3),
        "speedup": round(baseline / settled["resume_seconds"], 2),
        **{k: v for k, v in settled.items() if k != "resume_seconds"},
    }

    def checks(r: dict) -> dict:
        return {
            "speedup>=20": r["speedup"] >= 20,
            "compile<=5%_of_resume": r["compile_seconds_on_recovery_path"] <= 0.05 * r["resume_seconds"],
            "restore_gbps>=memcpy_gbps/2": r["restore_gbps"] >= memcpy / 2,
        }

    result["checks"] = checks(result)
    result["settled"]["checks"] = checks(result["settled"])
    return result


if __name__ == "__main__":
    main()
