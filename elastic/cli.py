"""The ``elastic`` command: ``elastic demo [--json] [--verify]``, ``elastic chaos --seed S --schedules N [--json]``,
``elastic plan --chips N --mtbf-hours-per-chip H [--json]``, and the operator's ``status``, ``events``, ``report``,
``inject`` (:mod:`elastic.ops.commands`), ``drain`` (:mod:`elastic.ops.drain`), ``cleanup``,
``wheel``/``submit`` (:mod:`elastic.ops.submit`) and ``slurm`` (:mod:`elastic.ops.slurm`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from elastic.ops import commands as ops_cli
from elastic.ops import drain as drain_cli
from elastic.ops import submit as submit_cli
from elastic.ops.slurm import commands as slurm_cli
from elastic.quiet import quiet_native, set_verbose

__all__ = ["main"]


def _force_cpu_devices(count: int, *, what: str = "the job") -> None:
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


def _stdout_for_result() -> TextIO:
    """A stream on the real stdout, which from now on holds the result only: anything else written to file
    descriptor 1 (Ray's messages, child processes) goes to stderr."""
    sys.stdout.flush()
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return result


_DEMO_DEFAULTS: dict[str, dict[str, int | None]] = {
    "slice-loss": {"steps": 150, "kill_at": 55, "revive_at": 95, "snapshot_every": 10},
    "multi-process": {"steps": 40, "kill_at": 13, "revive_at": 27, "snapshot_every": 5},
    "multi-process-drain": {"steps": 80, "kill_at": 13, "revive_at": None, "snapshot_every": 5},
}
_MULTI = ("multi-process", "multi-process-driver-crash", "multi-process-drain")


def _demo(args: argparse.Namespace) -> int:
    multi = args.scenario in _MULTI
    defaults = args.scenario if args.scenario in _DEMO_DEFAULTS else "multi-process" if multi else "slice-loss"
    for name, value in _DEMO_DEFAULTS[defaults].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.notice_deadline is None:
        args.notice_deadline = 10.0 if args.scenario == "multi-process-drain" else 30.0
    if args.pace is None:
        args.pace = 0.5 if args.scenario == "multi-process-drain" else 0.0
    if args.kill_client_at is None:
        args.kill_client_at = 21 if multi else 75
    result = _stdout_for_result()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not args.verbose:
        quiet_native()  # before jax loads
    _force_cpu_devices(args.slices * args.devices_per_slice)
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
    if multi:
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
    else:
        from elastic.ops.summary import summary_lines

        print("\n".join(summary_lines(out)), file=result, flush=True)
    return 0


def _chaos(args: argparse.Namespace) -> int:
    result = _stdout_for_result()
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
    _force_cpu_devices(8)  # before the target is imported (its module may touch jax); raised below if it needs more
    runner = ChaosRunner(target, seed=args.seed, steps=args.steps, timeout_s=args.timeout, scenarios=scenarios)
    _force_cpu_devices(runner.config.num_slices * runner.config.devices_per_slice, what=f"the chaos target {target}")

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


def _cleanup(args: argparse.Namespace) -> int:
    from elastic.control.cluster import connect
    from elastic.control.teardown import cleanup

    connect()
    killed = cleanup(args.job, purge_events=args.purge_events, token=args.token)
    print(
        json.dumps({"job": args.job, "job_name": args.job, "killed": killed, "events_purged": args.purge_events}),
        flush=True,
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
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


class _Parser(argparse.ArgumentParser):
    """A usage error is one line and where to look, not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elastic", description="Elastic, fault-tolerant training for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="kill a simulated slice mid-run, shrink, grow back, finish")
    demo.add_argument(
        "--scenario",
        choices=("slice-loss", "drain", "client-crash", *_MULTI),
        default="slice-loss",
        help="slice-loss: a slice dies and comes back; drain: a slice is given notice at --kill-at (deadline "
        "--notice-deadline), the job leaves it at a step boundary, it dies at the deadline and comes back at "
        "--revive-at; client-crash: the client is SIGKILLed mid-run "
        "and a new client resumes from the keeper tier; multi-process: one worker process per "
        "slice (jax.distributed), one SIGKILLed, the survivors re-form in place, a new one joins "
        "(defaults: 40 steps, killed at 13, back at 27, snapshot every 5); "
        "multi-process-driver-crash: the multi-process job's driver is SIGKILLed mid-run and a new "
        "driver of the same job name resumes from the keepers; multi-process-drain: a worker is given notice at "
        "--kill-at, the job leaves it at a step boundary, the worker exits 0, the slice comes back past the deadline "
        "(defaults: 80 steps of at least --pace 0.5 s, notice at 13 with a 10 s deadline)",
    )
    demo.add_argument(
        "--kill-client-at",
        type=int,
        default=None,
        help="client-crash: the step the client dies at (default 75; multi-process: 21)",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object on stdout (progress on stderr); without it, a short summary",
    )
    demo.add_argument("--verify", action="store_true", help="also run without failures and compare parameters")
    demo.add_argument("--steps", type=int, default=None, help="default 150 (multi-process: see --scenario)")
    demo.add_argument("--slices", type=int, default=4)
    demo.add_argument("--devices-per-slice", type=int, default=2)
    demo.add_argument("--kill-slice", type=int, default=1)
    demo.add_argument("--kill-at", type=int, default=None, help="default 55 (multi-process: see --scenario)")
    demo.add_argument("--revive-at", type=int, default=None, help="default 95 (multi-process: see --scenario)")
    demo.add_argument("--snapshot-every", type=int, default=None, help="default 10 (multi-process: see --scenario)")
    demo.add_argument(
        "--notice-deadline",
        type=float,
        default=None,
        help="drain: seconds from the notice to the slice's death (default 30; multi-process-drain: 10)",
    )
    demo.add_argument(
        "--pace", type=float, default=None, help="multi-process-drain: the least seconds a step takes (default 0.5)"
    )
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="structured events, Ray's own messages and the event timeline on stderr",
    )
    demo.set_defaults(func=_demo)
    chaos = sub.add_parser("chaos", help="run seeded fault schedules against a training loop; check every promise")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--schedules", type=int, default=5, help="run schedules 0..N-1 of the seed")
    chaos.add_argument("--index", type=int, help="replay schedule I of the seed only")
    chaos.add_argument(
        "--target", help="module:function returning ElasticJob's arguments and loop (default: the demo model)"
    )
    chaos.add_argument(
        "--mode",
        choices=("single-process", "multi-process"),
        default="single-process",
        help="the demo model's mode without --target (multi-process: a worker process per slice, its "
        "faults real SIGKILL/SIGSTOP); a target's config names its own",
    )
    chaos.add_argument("--steps", type=int, help="override the target's num_steps")
    chaos.add_argument("--scenarios", help="comma-separated catalogue names to draw from (default: all that fit)")
    chaos.add_argument("--timeout", type=float, default=120.0, help="seconds a schedule may run before it is a hang")
    chaos.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress on stderr)")
    chaos.add_argument(
        "-v", "--verbose", action="store_true", help="structured events and Ray's own messages on stderr"
    )
    chaos.set_defaults(func=_chaos)
    clean = sub.add_parser("cleanup", help="kill a job's leftover supervisor and agents (joins RAY_ADDRESS)")
    clean.add_argument("--job", "--job-name", dest="job", required=True, help="the job's name")
    ops_cli.add_credential(clean)
    clean.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
    clean.add_argument("--purge-events", action="store_true", help="also delete the job's event stream (all runs)")
    clean.add_argument("--json", action="store_true", help="JSON on stdout (the output is JSON in any case)")
    clean.set_defaults(func=_cleanup)
    ops_cli.register(sub)
    drain_cli.register(sub)
    submit_cli.register(sub)
    slurm_cli.register(sub)
    plan = sub.add_parser("plan", help="the snapshot interval that maximises goodput: Young-Daly and a simulation")
    plan.add_argument("--chips", type=int, help="chips in the job (or --slices with --chips-per-slice)")
    plan.add_argument("--slices", type=int)
    plan.add_argument("--chips-per-slice", type=int)
    plan.add_argument(
        "--mtbf-hours-per-chip", type=float, required=True, help="mean hours between failures of one chip"
    )
    plan.add_argument("--step-seconds", type=float, default=1.0)
    plan.add_argument(
        "--snapshot-seconds",
        type=float,
        default=0.5,
        help="seconds training is blocked per snapshot (benchmarks/snapshot.py measures it)",
    )
    plan.add_argument(
        "--restart-seconds",
        type=float,
        default=60.0,
        help="seconds from a failure to training again, without recomputation (benchmarks/recovery.py measures it)",
    )
    plan.add_argument("--seed", type=int, default=0, help="seed of the simulated failures")
    horizon = plan.add_mutually_exclusive_group()
    horizon.add_argument("--horizon-failures", type=int, help="simulate this many failures (default 100,000)")
    horizon.add_argument("--horizon-hours", type=float, help="simulate this many hours instead")
    plan.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    plan.set_defaults(func=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit status 0 on success, 2 for a usage or configuration error, 1 for a runtime error (a
    refusal, an unreachable cluster, anything unexpected), 130 when interrupted: each a line or two on stderr, the
    traceback only with ``-v``. A pipe closed early (``elastic status | head -1``) ends quietly."""
    args = build_parser().parse_args(argv)
    from elastic.errors import ConfigError, ElasticError

    verbose = bool(getattr(args, "verbose", False))
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        print("elastic: interrupted", file=sys.stderr)
        return 130
    except ConfigError as err:
        return _fail(err, 2, verbose)
    except ElasticError as err:
        return _fail(err, 1, verbose)
    except Exception as err:  # noqa: BLE001 - one line, not a traceback, unless -v
        return _fail(err, 1, verbose, unexpected=True)


def _fail(err: BaseException, code: int, verbose: bool, *, unexpected: bool = False) -> int:
    if verbose:
        import traceback

        traceback.print_exception(err, file=sys.stderr)
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    what = f"{type(err).__name__}: {text}" if unexpected else text
    print(f"elastic: error: {what}", file=sys.stderr)
    if unexpected and not verbose:
        print("elastic: run again with -v for the traceback", file=sys.stderr)
    return code


def _quiet_stdout() -> None:
    """After the reader of stdout went away: nothing more is written there (not even at exit's flush)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
