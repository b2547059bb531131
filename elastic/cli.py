"""The ``elastic`` command: ``elastic demo [--json] [--verify]``, ``elastic chaos --seed S --schedules N [--json]``,
``elastic plan --chips N --mtbf-hours-per-chip H [--json]``, and the operator's ``status``, ``events``, ``report``,
``inject`` (:mod:`elastic.ops.commands`), ``drain`` (:mod:`elastic.ops.drain`), ``pool`` (:mod:`elastic.ops.pool`),
``cleanup``, ``wheel``/``submit`` (:mod:`elastic.ops.submit`) and ``slurm`` (:mod:`elastic.ops.slurm`); ``demo``,
``chaos``, ``cleanup`` and ``plan`` are in :mod:`elastic.cli_commands`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from elastic import cli_commands as commands
from elastic.ops import commands as ops_cli
from elastic.ops import drain as drain_cli
from elastic.ops import pool as pool_cli
from elastic.ops import submit as submit_cli
from elastic.ops.slurm import commands as slurm_cli

__all__ = ["main"]


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
        choices=("slice-loss", "drain", "client-crash", *commands.MULTI),
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
        "(defaults: 80 steps of at least --pace 0.5 s, notice at 13 with a 10 s deadline); pool: two multi-process "
        "jobs share a pool of --slices slices of 1 device by priority: low on all, high (3 slices, spares=1) arrives "
        "and low shrinks, a worker of high is SIGKILLed at its step --kill-at and a slice of low swapped in, the "
        "killed slice returns to low, high ends and low grows back (defaults: low 150 steps, high 60, 5 slices, "
        "pace 0.2 s)",
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
    demo.add_argument("--slices", type=int, default=None, help="default 4 (pool: 5)")
    demo.add_argument("--devices-per-slice", type=int, default=None, help="default 2 (pool: 1)")
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
    demo.set_defaults(func=commands.demo)
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
    chaos.set_defaults(func=commands.chaos)
    clean = sub.add_parser("cleanup", help="kill a job's leftover supervisor and agents (joins RAY_ADDRESS)")
    clean.add_argument("--job", "--job-name", dest="job", required=True, help="the job's name")
    ops_cli.add_credential(clean)
    clean.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
    clean.add_argument("--purge-events", action="store_true", help="also delete the job's event stream (all runs)")
    clean.add_argument("--json", action="store_true", help="JSON on stdout (the output is JSON in any case)")
    clean.set_defaults(func=commands.cleanup)
    ops_cli.register(sub)
    drain_cli.register(sub)
    pool_cli.register(sub)
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
    plan.set_defaults(func=commands.plan)
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
