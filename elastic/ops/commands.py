"""The operator's commands: ``elastic status``, ``events [--follow]``, ``report [--out timeline.png]``, ``inject``.

Each reads the job named by ``--job`` (default ``demo``) from the cluster named by ``RAY_ADDRESS``, or from
its run record when no cluster is named (see :mod:`elastic.ops.runs`), and takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["add_credential", "register"]

FOLLOW_POLL_S = 0.5


def _source(args: argparse.Namespace) -> Any:
    from elastic.ops.runs import open_run

    source = open_run(args.job, run=args.run, directory=args.dir, token=args.token)
    if source.forged:
        print(
            f"elastic: {source.forged} record(s) in job {args.job!r}'s stream are not signed by its writers: left out",
            file=sys.stderr,
        )
    return source


def _print_records(records: list[dict[str, Any]], as_json: bool) -> None:
    from elastic.ops.runs import describe

    for r in records:
        if as_json:
            print(json.dumps(r, default=str), flush=True)
        else:
            stamp = time.strftime("%H:%M:%S", time.localtime(r["wall"])) + f".{int(r['wall'] % 1 * 1000):03d}"
            print(f"{stamp} {r['writer']:>14} {describe(r)}", flush=True)


def _status(args: argparse.Namespace) -> int:
    from elastic.ops.runs import fold_status

    status = fold_status(_source(args))
    if args.json:
        print(json.dumps(status, default=str), flush=True)
        return 0
    for line in status_lines(status):
        print(line)
    return 0


def status_lines(status: dict[str, Any]) -> list[str]:
    """The human form of ``fold_status``: nothing unknown is printed as ``None``."""
    lines = [f"job {status['job']} run {status['run']} ({status['source']}): {status['state']}"]
    if status["epoch"] is None:
        lines.append("  no membership view yet")
    else:
        lines.append(
            f"  epoch {status['epoch']}, slices {status['slices']}"
            + (f" ({status['reason']})" if status["reason"] else "")
        )
    rate = f", {status['steps_per_s']} steps/s" if status["steps_per_s"] is not None else ""
    snap = (
        f"newest snapshot: step {status['snapshot_step']} ({status['snapshot_tier']})"
        if status["snapshot_step"] is not None
        else "no snapshot yet"
    )
    lines.append(
        f"  {status['steps_committed']} steps committed{rate}; {snap}; failures {status['failures']}, "
        f"recoveries {status['recoveries']}"
    )
    for r in status["recent"]:
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(r['wall']))} {r['writer']:>14} {r['what']}")
    return lines


def _events(args: argparse.Namespace) -> int:
    from elastic.supervision import events

    if args.follow and args.dir is None and os.environ.get("RAY_ADDRESS") and not _wait_for_run(args):
        return 0
    source = _source(args)
    records = source.records
    if args.kind:
        wanted = set(args.kind.split(","))
        records = [r for r in records if r["kind"] in wanted]
    _print_records(records, args.json)
    if not args.follow or not source.where.startswith("cluster") or any(r["kind"] == "closed" for r in source.records):
        return 0  # nothing to follow: not asked, a record of a past run, or a job that closed already
    last = max(((r["wall"], r["writer"], r["seq"]) for r in source.records), default=None)
    deadline = time.monotonic() + args.follow_for if args.follow_for else None
    while deadline is None or time.monotonic() < deadline:
        time.sleep(FOLLOW_POLL_S)  # a poll of the GCS store: there is no change feed to wait on
        fresh = events.read(source.job, source.run, after=last)
        if fresh:
            last = max((r["wall"], r["writer"], r["seq"]) for r in fresh)
        if source.key is not None:
            fresh, forged = events.verify(fresh, source.key)
            if forged:
                print(
                    f"elastic: {len(forged)} record(s) not signed by job {source.job!r}'s writers: left out",
                    file=sys.stderr,
                    flush=True,
                )
        if fresh:
            _print_records([r for r in fresh if not args.kind or r["kind"] in set(args.kind.split(","))], args.json)
            if any(r["kind"] == "closed" for r in fresh):
                return 0
    return 0


def _wait_for_run(args: argparse.Namespace) -> bool:
    """``events --follow`` of a job that has not started yet: wait (up to ``--follow-for``) until its stream exists.
    False if it did not start in time."""
    from elastic.control.cluster import connect
    from elastic.supervision import events

    connect()
    if args.run is not None or events.current_run(args.job) is not None:
        return True
    print(f"waiting for job {args.job!r} to start ...", file=sys.stderr, flush=True)
    deadline = time.monotonic() + args.follow_for if args.follow_for else None
    while deadline is None or time.monotonic() < deadline:
        time.sleep(FOLLOW_POLL_S)  # a poll of the GCS store: there is no change feed to wait on
        if events.current_run(args.job) is not None:
            return True
    print(f"job {args.job!r} did not start within {args.follow_for:g} s", file=sys.stderr, flush=True)
    return False


def _report(args: argparse.Namespace) -> int:
    from elastic.ops.runs import fold_report

    source = _source(args)
    report = fold_report(source)
    if args.out:
        from elastic.ops.picture import render_timeline

        path = render_timeline(source.records, args.out, title=f"{source.job} · run {source.run}")
        report["picture"] = str(path)
    if args.json:
        print(json.dumps(report, default=str), flush=True)
    else:
        shown = {k: v for k, v in report.items() if k != "timeline"}
        print(json.dumps(shown, indent=2, default=str), flush=True)
    return 0


def _inject(args: argparse.Namespace) -> int:
    import ray

    from elastic.errors import ConfigError

    if not args.yes and not sys.stdin.isatty():
        raise ConfigError(
            f"inject asks for confirmation on a terminal and stdin is not one: pass --yes to inject "
            f"{args.fault} into slice {args.slice} of job {args.job!r} without asking"
        )
    token = operator_token(args, "inject")
    if not args.yes:
        try:
            answer = input(f"inject {args.fault} into slice {args.slice} of job {args.job!r}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("not injected", file=sys.stderr)
            return 1
    supervisor = job_supervisor(args.job, token)
    out = ray.get(supervisor.inject.remote(args.fault, args.slice), timeout=30)
    print(
        json.dumps({"job": args.job, **out})
        if args.json
        else f"injected {out['fault']} into slice {out['slice']} ({out['agent']}) at epoch {out['epoch']}",
        flush=True,
    )
    return 0


def operator_token(args: argparse.Namespace, command: str) -> str:
    """The credential of ``args.job`` for an operator's command acting on its running job (``ConfigError`` in one
    line, saying what to set, when ``RAY_ADDRESS`` or the credential is missing)."""
    from elastic.control.tokens import find_token
    from elastic.errors import ConfigError

    if not os.environ.get("RAY_ADDRESS"):
        raise ConfigError(f"elastic {command} acts on a running job: set RAY_ADDRESS to its cluster")
    token = find_token(args.job, args.token)
    if token is None:
        raise ConfigError(
            f"no credential for job {args.job!r}: run this as the job's user on its client machine (the "
            "client writes $ELASTIC_HOME/tokens/<job>), or pass --token-file (or set ELASTIC_TOKEN)"
        )
    return token


def job_supervisor(job: str, token: str) -> Any:
    """The job's supervisor on the cluster, its ID checked against the job's signed record before any call goes to
    it, its calls signed with ``token`` (``ConfigError`` when the job is not running there)."""
    from elastic.config import ElasticConfig
    from elastic.control.cluster import connect
    from elastic.errors import ConfigError
    from elastic.supervision.credential import Credentialed
    from elastic.supervision.identity import JobActors
    from elastic.supervision.supervisor import SUPERVISOR_NAME

    connect()
    namespace = ElasticConfig(job_name=job).namespace
    supervisor = JobActors(job, namespace, token).find(SUPERVISOR_NAME)
    if supervisor is None:
        raise ConfigError(f"job {job!r} is not running on this cluster (no supervisor in {namespace})")
    return Credentialed(supervisor, token)


def _read_token_file(path: str) -> str:
    """``--token-file``: the credential in a file (never on the command line, which every process of the machine
    can read in /proc/<pid>/cmdline)."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read the credential from {path!r}: {err.strerror}") from err
    if not token:
        raise argparse.ArgumentTypeError(f"{path!r} holds no credential")
    return token


def _no_token_on_the_command_line(_: str) -> str:
    raise argparse.ArgumentTypeError(
        "a credential on the command line is readable by every process of the machine (/proc/<pid>/cmdline): "
        "pass --token-file PATH, or set ELASTIC_TOKEN"
    )


def add_credential(p: argparse.ArgumentParser) -> None:
    """``--token-file PATH`` (the job's credential; ``args.token``); ``--token`` is refused with what to use."""
    p.add_argument(
        "--token-file",
        dest="token",
        type=_read_token_file,
        metavar="PATH",
        help="a file holding the job's credential (default: $ELASTIC_TOKEN, or the file its client wrote for "
        "this user under $ELASTIC_HOME/tokens)",
    )
    p.add_argument("--token", dest="token", type=_no_token_on_the_command_line, help=argparse.SUPPRESS)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", "--job-name", dest="job", default="demo", help="the job's name (default: demo)")
    add_credential(p)
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
    p.add_argument("--run", help="a run of the job (default: its newest)")
    p.add_argument("--dir", help="read a run record directory instead of the cluster")
    p.add_argument("--json", action="store_true", help="JSON on stdout")


def register(sub: Any) -> None:
    """Add the operator's subcommands to the ``elastic`` parser's subparsers."""
    status = sub.add_parser("status", help="a job's slices, epoch, step, step rate, newest snapshot, recent events")
    _common(status)
    status.set_defaults(func=_status)
    ev = sub.add_parser("events", help="a job's event stream: observations, decisions and reasons, recovery phases")
    _common(ev)
    ev.add_argument("--kind", help="only these kinds (comma-separated: view,health,timeline,progress,...)")
    ev.add_argument(
        "--follow",
        action="store_true",
        help="keep printing new events until the job closes (waits for a job that has not started yet)",
    )
    ev.add_argument("--follow-for", type=float, help="stop following after this many seconds")
    ev.set_defaults(func=_events)
    report = sub.add_parser("report", help="a job's report (JSON); --out timeline.png draws it")
    _common(report)
    report.add_argument("--out", help="write a PNG timeline: slices over time, failures, recoveries, snapshots, steps")
    report.set_defaults(func=_report)
    inject = sub.add_parser("inject", help="inject a fault into a running job (asks for confirmation)")
    inject.add_argument(
        "fault",
        choices=("kill", "silence", "stop"),
        help="kill: the slice's agent process dies (in multi-process mode its worker: SIGKILL, as its "
        "host dying would); silence: it stops heartbeating; stop: its process is stopped (SIGSTOP, a "
        "hung host)",
    )
    inject.add_argument("--slice", type=int, required=True)
    inject.add_argument("--job", "--job-name", dest="job", default="demo", help="the job's name (default: demo)")
    add_credential(inject)
    inject.add_argument("--yes", action="store_true", help="do not ask for confirmation (needed without a terminal)")
    inject.add_argument("--json", action="store_true")
    inject.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
    inject.set_defaults(func=_inject)
