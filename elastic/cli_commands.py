"""The ``elastic`` command's own subcommands: ``demo``, ``chaos``, ``cleanup`` and ``plan`` (their arguments:
:func:`elastic.cli.build_parser`). Each takes the parsed arguments and returns the exit status."""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
from typing import TextIO

from elastic.quiet import quiet_native, set_verbose

__all__ = ["DEMO_DEFAULTS", "MULTI", "chaos", "cleanup", "demo", "force_cpu_devices", "plan", "stdout_for_result"]


def force_cpu_devices(count: int, *, what: str = "the job") -> None:
    """Give jax ``count`` CPU devices. Once jax has started its backends (code that ran before touched jax)
    the devices it has are the ones there are: enough is fine, too few is a ``ConfigError`` saying what to set."""
    import jax

    from elastic.errors import ConfigError

    try:
        jax.config.update("jax_num_cpu_devices", max(count, jax.config.values["jax_num_cpu_devices"] or 1))
    except RuntimeError as err:
        have = len(jax.devices("cpu"))
        if have < count:
            raise ConfigError(
                f"{what} needs {count} CPU devices but jax started with {have} before they could be set (code run "
                f"on import touched jax: {err}); set XLA_FLAGS=--xla_force_host_platform_device_count={count} in the "
                "environment, or keep jax calls in the target's module inside functions"
            ) from err


def stdout_for_result() -> TextIO:
    """A stream on the real stdout, which from now on holds the result only: anything else written to file
    descriptor 1 (Ray's messages, child processes) goes to stderr. Closed at exit (flushed, and no unclosed-file
    warning)."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    atexit.register(result.close)
    os.dup2(2, 1)
    return result


_SLICES = {"slices": 4, "devices_per_slice": 2}
DEMO_DEFAULTS: dict[str, dict[str, int | None]] = {
    "slice-loss": {"steps": 150, "kill_at": 55, "revive_at": 95, "snapshot_every": 10, **_SLICES},
    "multi-process": {"steps": 40, "kill_at": 13, "revive_at": 27, "snapshot_every": 5, **_SLICES},
    "multi-process-drain": {"steps": 80, "kill_at": 13, "revive_at": None, "snapshot_every": 5, **_SLICES},
    "pool": {"steps": 150, "kill_at": 8, "revive_at": None, "snapshot_every": 5, "slices": 5, "devices_per_slice": 1},
}
MULTI = ("multi-process", "multi-process-driver-crash", "multi-process-drain", "pool")


def demo(args: argparse.Namespace) -> int:
    multi = args.scenario in MULTI
    defaults = args.scenario if args.scenario in DEMO_DEFAULTS else "multi-process" if multi else "slice-loss"
    for name, value in DEMO_DEFAULTS[defaults].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.notice_deadline is None:
        args.notice_deadline = 10.0 if args.scenario == "multi-process-drain" else 30.0
    if args.pace is None:
        args.pace = {"multi-process-drain": 0.5, "pool": 0.2}.get(args.scenario, 0.0)
    if args.kill_client_at is None:
        args.kill_client_at = 21 if multi else 75
    result = stdout_for_result()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not args.verbose:
        quiet_native()  # before jax loads
    force_cpu_devices(args.slices * args.devices_per_slice)
    from elastic.control.cluster import connect
    from elastic.demos.demo import DemoSpec, run_demo
    from elastic.log import configure_logging
    from elastic.ops.progress import print_timeline

    configure_logging(logging.INFO if args.verbose else logging.ERROR)
    if args.verbose:
        set_verbose(True)
    from elastic.ops.runs import records_dir

    os.environ.setdefault("ELASTIC_RECORD_DIR", str(records_dir()))  # so that `elastic report` finds the run
    spec = DemoSpec(
        steps=args.steps,
        num_slices=args.slices,
        devices_per_slice=args.devices_per_slice,
        kill_slice=args.kill_slice,
        kill_at=args.kill_at,
        revive_at=args.revive_at,
        snapshot_every=args.snapshot_every,
    )
    started_here = connect()
    if args.scenario == "pool":
        from elastic.demos.pool import PoolDemoSpec, run_pool_demo

        pool = PoolDemoSpec(
            steps=spec.steps,
            pool_size=spec.num_slices,
            kill_at=spec.kill_at,
            kill_slice=spec.kill_slice,
            pace_s=args.pace,
            snapshot_every=spec.snapshot_every,
        )
        out = run_pool_demo(pool, verify=args.verify)
    elif multi:
        from elastic.demos.processes import ProcessDemoSpec, run_process_demo

        mp = ProcessDemoSpec(
            steps=spec.steps,
            num_slices=spec.num_slices,
            devices_per_slice=spec.devices_per_slice,
            kill_slice=spec.kill_slice,
            kill_at=spec.kill_at,
            revive_at=spec.revive_at,
            snapshot_every=spec.snapshot_every,
        )
        if args.scenario == "multi-process":
            out = run_process_demo(mp, verify=args.verify)
        elif args.scenario == "multi-process-drain":
            from elastic.demos.process_drain import run_process_drain_demo

            out = run_process_drain_demo(mp, deadline_s=args.notice_deadline, pace_s=args.pace, verify=args.verify)
        else:
            from elastic.demos.crash import run_client_crash

            out = run_client_crash(mp, kill_at=args.kill_client_at, verify=args.verify, progress=not args.no_progress)
    elif args.scenario == "drain":
        from elastic.demos.drain import run_drain_demo

        out = run_drain_demo(spec, deadline_s=args.notice_deadline, verify=args.verify, progress=not args.no_progress)
    elif args.scenario == "client-crash":
        from elastic.demos.crash import run_client_crash

        out = run_client_crash(spec, kill_at=args.kill_client_at, verify=args.verify, progress=not args.no_progress)
    else:
        out = run_demo(spec, verify=args.verify, progress=not args.no_progress)
    out["joined_existing_cluster"] = not started_here  # RAY_ADDRESS named a cluster (a `ray job submit` job)
    if args.verbose:
        print_timeline(out["timeline"], sys.stderr)
    if args.json:
        print(json.dumps(out), file=result, flush=True)
    elif args.scenario == "pool":
        from elastic.demos.pool import summary

        print("\n".join(summary(out)), file=result, flush=True)
    else:
        from elastic.ops.summary import summary_lines

        print("\n".join(summary_lines(out)), file=result, flush=True)
    return 0


def chaos(args: argparse.Namespace) -> int:
    result = stdout_for_result()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not args.verbose:
        quiet_native()  # before jax loads
    from elastic.chaos.report import ScheduleResult
    from elastic.chaos.runner import ChaosRunner
    from elastic.log import configure_logging

    configure_logging(logging.INFO if args.verbose else logging.ERROR)
    if args.verbose:
        set_verbose(True)
    scenarios = [s for s in args.scenarios.split(",") if s] if args.scenarios else None
    target = args.target or ("elastic.demos.chaos:process_target" if args.mode == "multi-process" else None)
    force_cpu_devices(8)  # before the target is imported (its module may touch jax); raised below if it needs more
    runner = ChaosRunner(target, seed=args.seed, steps=args.steps, timeout_s=args.timeout, scenarios=scenarios)
    force_cpu_devices(runner.config.num_slices * runner.config.devices_per_slice, what=f"the chaos target {target}")

    def progress(r: ScheduleResult) -> None:
        failed = ", ".join(p.promise for p in r.verdict.failed) or "every promise kept"
        print(
            f"schedule {r.schedule.index} {r.schedule.scenario}: {r.record.outcome} in {r.record.seconds:.1f} s, "
            f"{r.injected} fault(s); {failed}",
            file=sys.stderr,
            flush=True,
        )

    indices = [args.index] if args.index is not None else None
    out = runner.run(args.schedules, indices=indices, progress=progress).to_dict()
    if args.json:
        print(json.dumps(out), file=result, flush=True)
    else:
        summary = {k: v for k, v in out.items() if k != "runs"}
        print(json.dumps(summary, indent=2), file=result, flush=True)
    return 0 if out["ok"] else 1


def cleanup(args: argparse.Namespace) -> int:
    from elastic.control.cluster import connect
    from elastic.control.teardown import cleanup

    connect()
    killed = cleanup(args.job, purge_events=args.purge_events, token=args.token)
    print(
        json.dumps({"job": args.job, "job_name": args.job, "killed": killed, "events_purged": args.purge_events}),
        flush=True,
    )
    return 0


def plan(args: argparse.Namespace) -> int:
    from elastic.errors import ConfigError
    from elastic.ops.planner import PlanInputs, plan

    if (args.chips is None) == (args.slices is None and args.chips_per_slice is None):
        raise ConfigError("give --chips N, or --slices N with --chips-per-slice K (not both)")
    if args.chips is None and (args.slices is None or args.chips_per_slice is None):
        raise ConfigError("--slices and --chips-per-slice go together")
    chips = args.chips if args.chips is not None else args.slices * args.chips_per_slice
    inputs = PlanInputs(
        chips=chips,
        mtbf_hours_per_chip=args.mtbf_hours_per_chip,
        step_seconds=args.step_seconds,
        snapshot_seconds=args.snapshot_seconds,
        restart_seconds=args.restart_seconds,
    )
    out = plan(inputs, seed=args.seed, horizon_failures=args.horizon_failures, horizon_hours=args.horizon_hours)
    if args.json:
        print(json.dumps(out.to_dict()), flush=True)
        return 0
    d = out.to_dict()
    print(
        f"{chips} chips, {args.mtbf_hours_per_chip:g} h MTBF per chip: job MTBF {d['job_mtbf_hours']:.3f} h; "
        f"step {args.step_seconds:g} s, snapshot {args.snapshot_seconds:g} s, restart {args.restart_seconds:g} s"
    )
    print(
        f"optimum {d['optimum_seconds']:.1f} s of work (Young sqrt(2CM) {d['young_seconds']:.1f} s, "
        f"Daly {d['daly_seconds']:.1f} s): snapshot every {d['interval_steps']} steps"
    )
    print(f"simulated: {d['simulated_failures']:,} failures over {d['simulated_hours']:,.0f} h, seed {d['seed']}")
    print(f"{'steps':>9} {'seconds':>10} {'expected':>9} {'1st order':>9} {'simulated':>9} {'diff':>9}")
    for c in d["candidates"]:
        mark = "  <- best" if c["steps"] == d["interval_steps"] else ""
        print(
            f"{c['steps']:>9} {c['seconds']:>10.1f} {c['expected_goodput']:>9.4f} {c['first_order_goodput']:>9.4f} "
            f"{c['simulated_goodput']:>9.4f} {c['simulated_goodput'] - c['expected_goodput']:>+9.5f}{mark}"
        )
    return 0
