"""What a job's own processes cost while nothing fails and nothing computes. Prints one JSON object.

    .venv/bin/python benchmarks/idle_cpu.py --json [--seconds 8] [--heartbeat-interval 1.0] [--slices 4]

A single-process job (simulated slices, the default tiers) whose loop only sleeps 0.25 s a step: once it runs,
the CPU time of every other process on this machine that belongs to Ray or the job (supervisor, slice agents,
keepers, raylet, GCS, dashboard agent, the job's reaper) is sampled over ``--seconds``. On a machine whose CPU
devices are the host's cores, that share is taken from the computation. ``others_percent_of_one_core`` is the
sum, ``by_process`` each process above 0.5%, ``machine_share`` the sum over the machine's cores; the baseline is
the same processes' share with no job running (``ray_idle_percent_of_one_core``: Ray alone, started the same way).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp
import psutil

ME = os.getpid()


def cpu_of_others() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every other Ray or Python process, by pid (with a short name)."""
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == ME:
            continue
        try:
            line = " ".join(p.info["cmdline"] or [])
            if not any(word in line for word in ("ray", "python", "gcs_server", "raylet")):
                continue
            t = p.cpu_times()
            name = line.split()[0].rsplit("/", 1)[-1] if not line.startswith("ray::") else line.split()[0]
            if "elastic.control.reaper" in line:
                name = "elastic reaper"
            out[p.pid] = (name[:40], t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
            continue
    return out


def share(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float) -> dict:
    by = {}
    for pid, (name, t) in after.items():
        if pid in before:
            by[f"{name} ({pid})"] = round((t - before[pid][1]) / seconds * 100, 2)
    total = round(sum(by.values()), 2)
    return {"total": total, "by_process": {k: v for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0.5}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--heartbeat-interval", type=float, default=None, help="default: ElasticConfig's")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from elastic import ElasticConfig, ElasticJob
    from elastic.control.cluster import connect
    from elastic.log import configure_logging

    configure_logging(logging.WARNING)
    connect()
    time.sleep(2.0)  # Ray's own start-up settles
    a = cpu_of_others()
    time.sleep(args.seconds)
    ray_idle = share(a, cpu_of_others(), args.seconds)

    overrides = {} if args.heartbeat_interval is None else {"heartbeat_interval_s": args.heartbeat_interval}
    steps = int((args.seconds + 4) / 0.25) + 8
    config = ElasticConfig(simulated=True, job_name="idle-cpu", num_slices=args.slices, num_steps=steps, **overrides)
    measured: dict = {}

    def loop(run):
        state = run.state
        for step in run.steps:
            if step == 8:  # started, first snapshot taken, standbys compiled: the steady state
                measured["before"], measured["t0"] = cpu_of_others(), time.monotonic()
            if step == steps - 1:
                measured["seconds"] = time.monotonic() - measured["t0"]
                measured["after"] = cpu_of_others()
            time.sleep(0.25)
            run.commit(state)
        return state

    with ElasticJob(config, init_fn=lambda key: {"w": jnp.zeros((8,))}) as job:
        job.run(loop)
    job_share = share(measured["before"], measured["after"], measured["seconds"])
    out = {
        "heartbeat_interval_s": config.heartbeat_interval_s,
        "slices": args.slices,
        "seconds": round(measured["seconds"], 1),
        "cores": psutil.cpu_count(),
        "others_percent_of_one_core": job_share["total"],
        "machine_share": round(job_share["total"] / 100 / psutil.cpu_count(), 4),
        "ray_idle_percent_of_one_core": ray_idle["total"],
        "by_process": job_share["by_process"],
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
