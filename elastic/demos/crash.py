"""The client-crash demo: the training client (the driver) is SIGKILLed mid-run and a new one takes the job over.

The parent process joins (or starts) a Ray cluster that outlives both clients, runs the first client
as a child process with a ``kill_client`` fault (a real SIGKILL: nothing unwinds), then starts a second
client on the same job, as ``ray job submit`` of the same job name would. The second finds the crashed client's
supervisor idle, replaces it, finds the job's newest snapshot in the keeper actors, and resumes there without
touching disk. In multi-process mode (``processes``) the crashed driver's worker processes die with it (Ray owns
them through the driver): the new driver starts new ones, which restore their regions from the keepers. With
``verify`` the parent also runs the failure-free reference and compares the final parameters.

    python -m elastic.demos.crash --client --job-name demo-crash --out result.json [--kill-client-at 75]
runs one client (the parent's child role).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from elastic.demos.demo import DemoSpec, init_state, make_trainer, max_abs_diff
from elastic.demos.processes import ProcessDemoSpec, reference_params
from elastic.errors import ElasticError

__all__ = ["run_client_crash"]

JOB = "demo-crash"
CLIENT_TIMEOUT_S = 600


def _client_cmd(spec: Any, out: str, *, kill_at: int | None, progress: bool) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "elastic.demos.crash",
        "--client",
        "--job-name",
        JOB,
        "--out",
        out,
        "--spec",
        json.dumps(asdict(spec)),
    ]
    if isinstance(spec, ProcessDemoSpec):
        cmd.append("--processes")
    if kill_at is not None:
        cmd += ["--kill-client-at", str(kill_at)]
    if not progress:
        cmd.append("--no-progress")
    return cmd


def run_client_crash(
    spec: DemoSpec | ProcessDemoSpec, *, kill_at: int, verify: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Crash a client at step ``kill_at``, resume with a new one; the JSON-ready summary of the second. A
    :class:`~elastic.demos.processes.ProcessDemoSpec` runs the multi-process demo (a worker process per slice)."""
    import ray

    from elastic.control.cluster import connect

    if not 0 < kill_at < spec.steps:
        raise ElasticError(f"--kill-client-at must be between 1 and {spec.steps - 1}, got {kill_at}")
    spec = (
        replace(spec, keeper_every=1, job_name=JOB)
        if isinstance(spec, ProcessDemoSpec)
        else replace(spec, keeper_every=1)
    )  # every snapshot reaches the keepers: the loss is bounded by snapshot_every
    connect()  # this process keeps the cluster (and so the keepers) alive across both clients
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={spec.num_slices * spec.devices_per_slice}",
        "JAX_PLATFORMS": "cpu",
    }
    with tempfile.TemporaryDirectory(prefix="elastic-crash-demo-") as tmp:
        first = subprocess.run(
            _client_cmd(spec, os.path.join(tmp, "first.json"), kill_at=kill_at, progress=progress),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            timeout=CLIENT_TIMEOUT_S,
        )
        if first.returncode != -signal.SIGKILL:
            raise ElasticError(f"the first client should have been SIGKILLed, it exited with {first.returncode}")
        out_path = os.path.join(tmp, "second.json")
        # The clients' stdout (Ray's messages among it) goes to stderr: stdout holds this command's result only.
        second = subprocess.run(
            _client_cmd(spec, out_path, kill_at=None, progress=progress),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            timeout=CLIENT_TIMEOUT_S,
        )
        if second.returncode != 0:
            raise ElasticError(f"the second client failed with exit code {second.returncode}")
        with open(out_path, encoding="utf-8") as f:
            out = json.load(f)
        params = dict(np.load(os.path.join(tmp, "second.npz")))
    out["scenario"] = "multi-process-driver-crash" if isinstance(spec, ProcessDemoSpec) else "client-crash"
    out["first_client_exit"] = first.returncode
    if verify and isinstance(spec, ProcessDemoSpec):
        ref_params, final_loss = reference_params(spec)
        out["reference_final_loss"] = final_loss
        out["max_abs_param_diff_vs_reference"] = max_abs_diff(params, {k: np.asarray(v) for k, v in ref_params.items()})
    elif verify and not isinstance(spec, ProcessDemoSpec):
        reference = make_trainer(spec, job_name=f"{JOB}-reference", faults=None).fit()
        ref = {k: np.asarray(v) for k, v in reference.state["params"].items()}
        out["reference_final_loss"] = reference.report.final_loss
        out["max_abs_param_diff_vs_reference"] = max_abs_diff(params, ref)
    return out


def _client(args: argparse.Namespace) -> int:
    """One client: train, or die by SIGKILL at ``--kill-client-at``; write the report and parameters."""
    from elastic.chaos.faults import Faults
    from elastic.ops.progress import Progress

    faults = Faults().kill_client(at_step=args.kill_client_at) if args.kill_client_at is not None else None
    if args.processes:
        from elastic.api.job import ElasticJob
        from elastic.demos.processes import loop, process_config

        mp = ProcessDemoSpec(**json.loads(args.spec))
        with (
            Progress(
                mp.steps, enabled=not args.no_progress, stream=sys.stderr, label="driver 1" if faults else "driver 2"
            ) as bar,
            ElasticJob(process_config(mp), init_fn=init_state, faults=faults, on_step=bar.on_step) as job,
        ):
            result = job.run(loop)
    else:
        spec = DemoSpec(**json.loads(args.spec))
        with Progress(
            spec.steps, enabled=not args.no_progress, stream=sys.stderr, label="client 1" if faults else "client 2"
        ) as bar:
            result = make_trainer(spec, job_name=args.job_name, faults=faults, on_step=bar.on_step).fit()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result.report.to_dict(), f)
    params: dict[str, Any] = {k: np.asarray(v) for k, v in result.state["params"].items()}
    np.savez(args.out.replace(".json", ".npz"), **params)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one client of the client-crash demo")
    parser.add_argument("--client", action="store_true", required=True)
    parser.add_argument("--job-name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--kill-client-at", type=int)
    parser.add_argument("--processes", action="store_true", help="the multi-process demo (a worker per slice)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    import logging

    from elastic.control.cluster import connect
    from elastic.log import configure_logging

    configure_logging(logging.ERROR)
    connect()
    return _client(args)


if __name__ == "__main__":
    sys.exit(main())
