"""A ``ray job submit`` entry point: train the demo model elastically on the cluster it is submitted to.

    ray job submit --working-dir . -- python -m elastic.examples.train --steps 200 --json

Inside a Ray job, ``RAY_ADDRESS`` names the cluster and the job joins it; run directly, it starts an
embedded Ray. Prints the job's report as one JSON object on stdout. By default the slices are simulated on CPU
devices (so ``--kill-slice`` can kill one); ``--real-devices`` trains on the devices jax sees instead (GPUs or
TPUs: ``--slices`` x ``--devices-per-slice`` must be all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.examples.train")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--devices-per-slice", type=int, default=2)
    parser.add_argument("--kill-slice", type=int, default=None, help="inject a slice loss (simulated slices)")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--revive-at", type=int, default=None)
    parser.add_argument("--job-name", default=f"train-{os.getpid()}")
    parser.add_argument("--json", action="store_true", help="print only the JSON report on stdout")
    parser.add_argument(
        "--real-devices", action="store_true", help="train on the devices jax sees, not simulated CPU slices"
    )
    args = parser.parse_args(argv)
    if args.real_devices and args.kill_slice is not None:
        parser.error("--kill-slice kills a simulated slice: it cannot be combined with --real-devices")

    if not args.real_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if not args.real_devices:
        jax.config.update("jax_num_cpu_devices", args.slices * args.devices_per_slice)
    import optax

    from elastic import ElasticConfig, Faults, Policy, Trainer, optax_step
    from elastic.control.cluster import connect
    from elastic.demos.demo import batch, init_params, loss_fn

    # `ray job stop` sends SIGTERM: unwind normally so the job's detached actors are killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started_here = connect()  # joins RAY_ADDRESS when set (as it is inside `ray job submit`)
    faults = Faults()
    if args.kill_slice is not None and args.kill_at is not None:
        faults.kill_slice(args.kill_slice, at_step=args.kill_at)
        if args.revive_at is not None:
            faults.revive_slice(args.kill_slice, at_step=args.revive_at)
    config = ElasticConfig(
        simulated=not args.real_devices,
        job_name=args.job_name,
        num_slices=args.slices,
        devices_per_slice=args.devices_per_slice,
        num_steps=args.steps,
        snapshot_every=10,
        policy=Policy(min_slices=1),
    )
    trainer = Trainer(
        init_fn=init_params,
        step_fn=optax_step(loss_fn, optax.adam(1e-2)),
        batch_fn=lambda step: batch(step, 48),
        config=config,
        faults=faults,
    )
    result = trainer.fit()
    report = result.report.to_dict()
    report["ray_address"] = os.environ.get("RAY_ADDRESS", "embedded")
    report["joined_existing_cluster"] = not started_here
    if not args.json:
        print(f"trained {report['steps_committed']} steps, final loss {report['final_loss']:.4f}", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
