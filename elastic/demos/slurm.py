"""The demo's model as the entry point of a Slurm allocation: ``elastic slurm run -- python -m elastic.demos.slurm``.

The multi-process demo (:mod:`elastic.demos.processes`: the demo MLP, adam, 48 rows a step) with no fault
injected: what happens to it is what happens to the allocation. One worker per slice, each on a node of its own
(``Processes(resources_per_worker={"elastic_host": 1})``, the resource every Ray node of the allocation has one
of); no standby group (it would need spare nodes). The Orbax tier is on, in the job dir (``$ELASTIC_SLURM_JOB_DIR``):
a job resubmitted under the same name resumes from it. ``--pace`` makes each step take at least that long
(``--pace-degraded``: while the job runs on fewer slices than it asked for), so a short run lasts long enough to
lose a node and get one back. SIGTERM to this process (``elastic slurm run`` sends it when the batch step is
signalled, ``--signal=B:TERM@secs``) saves the state to the Orbax tier at the next step boundary and ends the run
(``ElasticJob(stop_signal="SIGTERM")``): a job submitted again under the same name resumes there. One line per
committed step on stdout
(``step N committed on K slices``), and the report as JSON at the end (``--verify``: with the final parameters'
distance to a failure-free plain jax + optax run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m elastic.demos.slurm", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--slices", type=int, default=4, help="one per node of the allocation")
    p.add_argument("--devices-per-slice", type=int, default=2)
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--persistent-every", type=int, default=10)
    p.add_argument("--keeper-every", type=int, default=2, help="snapshots to the keepers every N (0: no keepers)")
    p.add_argument("--persistent-dir", help="the Orbax tier (default: orbax/ in the job dir)")
    p.add_argument("--pace", type=float, default=0.0, help="seconds a step takes at least")
    p.add_argument(
        "--pace-degraded", type=float, default=0.0, help="seconds a step takes at least on fewer slices than --slices"
    )
    p.add_argument("--min-slices", type=int, default=2)
    p.add_argument("--simulated", action="store_true", help="CPU devices per worker (a machine without accelerators)")
    p.add_argument("--verify", action="store_true", help="compare with a failure-free run (simulated only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    devices = args.slices * args.devices_per_slice
    if args.simulated:  # before jax starts: the reference runs on this process's CPU devices
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    from elastic.api.job import ElasticJob
    from elastic.config import Policy, Processes, Tiers
    from elastic.demos.demo import init_state, max_abs_diff
    from elastic.demos.pacing import degraded, paced_loop
    from elastic.demos.processes import ProcessDemoSpec, process_config, reference_params

    name = os.environ.get("ELASTIC_JOB_NAME") or os.environ.get("SLURM_JOB_NAME") or "slurm-demo"
    job_dir = os.environ.get("ELASTIC_SLURM_JOB_DIR", ".")
    spec = ProcessDemoSpec(
        steps=args.steps,
        num_slices=args.slices,
        devices_per_slice=args.devices_per_slice,
        snapshot_every=args.snapshot_every,
        job_name=name,
        revive_at=None,
    )
    config = process_config(
        spec,
        simulated=args.simulated,
        policy=Policy(min_slices=args.min_slices, repair_timeout_s=60.0),
        tiers=Tiers(
            keeper_every=args.keeper_every,
            persistent_dir=args.persistent_dir or os.path.join(job_dir, "orbax"),
            persistent_every=args.persistent_every,
        ),
        processes=Processes(resources_per_worker={"elastic_host": 1}, standby=False),
    )

    def on_step(step: int, metrics: dict[str, Any], run: Any) -> None:
        print(f"step {step} committed on {len(run.slices)} slices", flush=True)

    started = time.monotonic()
    with ElasticJob(config, init_fn=init_state, on_step=on_step, stop_signal="SIGTERM") as job:
        result = job.run(paced_loop(degraded(args.pace, args.pace_degraded, args.slices)))
    report = result.report.to_dict()
    report["job_seconds"] = round(time.monotonic() - started, 2)
    report["slurm_job_id"] = os.environ.get("SLURM_JOB_ID")
    if args.verify:  # against a failure-free run of as many steps (those before the stop, if it stopped)
        stopped = report.get("stopped")
        params, _ = reference_params(dataclasses.replace(spec, steps=stopped["at_step"]) if stopped else spec)
        report["max_abs_param_diff_vs_reference"] = max_abs_diff(result.state["params"], params)
    report.pop("timeline", None)
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
