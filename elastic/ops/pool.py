"""``elastic pool start|status|events|mark|stop``: the operator's and users' commands on a pool of slices.

Each acts on the Ray cluster named by ``RAY_ADDRESS`` (a pool outlives the command: it needs a cluster of its own,
not an embedded one). ``start`` makes the pool's operator credential and writes it, 0600, to
``$ELASTIC_HOME/tokens/pool-<name>``, and each admitted user's to ``$ELASTIC_HOME/tokens/pool-<name>.user-<user>``
(for the operator to hand over). The other commands take the credential from ``--token-file``, ``$ELASTIC_TOKEN``,
or that file (``--user U``: the user's), never from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from elastic.ops.commands import add_credential

__all__ = ["end_own_pool", "own_pool", "parse_quota", "register", "status_lines", "token_name"]


def token_name(pool: str, user: str | None = None) -> str:
    """The name of the credential's file under ``$ELASTIC_HOME/tokens``."""
    return f"pool-{pool}" + (f".user-{user}" if user else "")


def parse_quota(text: str) -> tuple[str, int]:
    """``USER=N`` (``argparse.ArgumentTypeError`` for anything else)."""
    user, sep, count = text.partition("=")
    if not sep or not user or not count.strip().isdigit():
        raise argparse.ArgumentTypeError(f"a quota is USER=N (N slices at most for USER's jobs); got {text!r}")
    return user, int(count)


def own_pool(name: str, slices: int, users: list[str]) -> tuple[Any, dict[str, str]]:
    """A pool for this process's own use (a demo's), on the connected cluster: its operator's handle and each user's
    credential, nothing written to disk. :func:`end_own_pool` ends it."""
    from elastic.pool.access import user_credential
    from elastic.pool.client import start_pool
    from elastic.supervision import credential

    token = credential.new_token()
    return start_pool(name, slices, token, users=users), {u: user_credential(token, u) for u in users}


def end_own_pool(pool: Any, name: str) -> None:
    """Stop pool ``name`` (``pool``: its operator's handle, as :func:`own_pool` returned it) and forget its records."""
    import ray

    from elastic.pool.actor import stream_name
    from elastic.supervision import identity

    ray.kill(pool.handle, no_restart=True)
    identity.forget(stream_name(name))


def _connect(command: str) -> None:
    from elastic.control.cluster import connect
    from elastic.errors import ConfigError

    if not os.environ.get("RAY_ADDRESS"):
        raise ConfigError(f"elastic pool {command} acts on a cluster that outlives it: set RAY_ADDRESS to it")
    connect()


def _credential(args: argparse.Namespace) -> str:
    from elastic.control.tokens import find_token
    from elastic.errors import ConfigError

    token = find_token(token_name(args.name, args.user), args.token)
    if token is None:
        who = f"user {args.user!r}" if args.user else "its operator"
        raise ConfigError(
            f"no credential of {who} for pool {args.name!r}: pass --token-file (or set ELASTIC_TOKEN), or run as the "
            f"user who started it (it wrote $ELASTIC_HOME/tokens/{token_name(args.name, args.user)})"
        )
    return token


def _start(args: argparse.Namespace) -> int:
    from elastic.control.tokens import token_path, write_token
    from elastic.pool.access import user_credential
    from elastic.pool.client import start_pool
    from elastic.supervision import credential

    _connect("start")
    quotas = dict(args.quota or [])
    users = sorted({*(args.user or []), *quotas})
    token = credential.new_token()
    pool = start_pool(args.name, args.slices, token, quotas=quotas, users=users)
    write_token(token_name(args.name), token)
    for user in users:
        write_token(token_name(args.name, user), user_credential(token, user))
    status = pool.call("status")
    out = {
        "pool": args.name,
        "slices": status["size"],
        "quotas": quotas,
        "users": users,
        "operator_credential": str(token_path(token_name(args.name))),
        "user_credentials": {u: str(token_path(token_name(args.name, u))) for u in users},
    }
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(f"pool {args.name!r} started: {status['size']} slices, users {', '.join(users) or 'none'}", flush=True)
        print(f"  operator credential: {out['operator_credential']}", flush=True)
        for user, path in out["user_credentials"].items():
            print(f"  {user}'s credential (hand it to them): {path}", flush=True)
    return 0


def _pool(args: argparse.Namespace, command: str) -> Any:
    from elastic.pool.client import find_pool

    _connect(command)
    return find_pool(args.name, _credential(args), user=args.user)


def _status(args: argparse.Namespace) -> int:
    status = _pool(args, "status").call("status")
    if args.json:
        print(json.dumps(status), flush=True)
    else:
        for line in status_lines(status):
            print(line, flush=True)
    return 0


def status_lines(status: dict[str, Any]) -> list[str]:
    """The human form of a pool's status."""
    lines = [
        f"pool {status['pool']}: {status['size']} slices, free {_slices(status['free'])}, failed "
        f"{_slices(status['failed'])} (decision {status['version']})"
    ]
    if "held_by_others" in status:
        lines.append(f"  {status['held_by_others']} slice(s) held by other users' jobs")
    jobs = sorted(status["jobs"].values(), key=lambda j: (-j["priority"], j["job"]))
    if not jobs:
        lines.append("  no jobs")
    for j in jobs:
        leaving = f", leaving {_slices(j['leave'])}" if j["leave"] else ""
        lines.append(
            f"  {j['job']} ({j['user']}, priority {j['priority']}): {j['state']} on {_slices(j['slices'])}{leaving}; "
            f"{j['seconds_below_asked']:.1f} s below the {j['asked']} asked"
        )
        lines.append(f"    {j['reason']}")
    if status["queue"]:
        lines.append(f"  queue: {', '.join(status['queue'])}")
    return lines


def _slices(slices: list[int]) -> str:
    return ",".join(map(str, slices)) or "none"


def _events(args: argparse.Namespace) -> int:
    records = _pool(args, "events").call("events")
    for r in records:
        if args.json:
            print(json.dumps(r, default=str), flush=True)
            continue
        stamp = time.strftime("%H:%M:%S", time.localtime(r["wall"]))
        print(f"{stamp} #{r.get('epoch', 0):<4} {r['kind']:<14} {_describe(r)}", flush=True)
    return 0


def _describe(record: dict[str, Any]) -> str:
    if "reason" in record:
        return str(record["reason"])
    shown = {k: v for k, v in record.items() if k not in ("wall", "writer", "seq", "kind", "epoch", "mac", "state")}
    return " ".join(f"{k}={v}" for k, v in shown.items())


def _mark(args: argparse.Namespace) -> int:
    pool = _pool(args, "mark")
    version = pool.call("slice_failed" if args.failed else "slice_returned", args.slice)
    what = "failed" if args.failed else "returned"
    print(
        json.dumps({"pool": args.name, "slice": args.slice, what: True, "version": version})
        if args.json
        else f"slice {args.slice} of pool {args.name!r} marked {what} (decision {version})",
        flush=True,
    )
    return 0


def _stop(args: argparse.Namespace) -> int:
    import ray

    from elastic.errors import ConfigError
    from elastic.pool.actor import stream_name
    from elastic.supervision import identity

    if args.user:
        raise ConfigError("elastic pool stop is the operator's: run it without --user")
    pool = _pool(args, "stop")
    pool.call("status")  # the operator's credential checked by the pool before it goes
    ray.kill(pool.handle, no_restart=True)
    identity.forget(stream_name(args.name))
    print(json.dumps({"pool": args.name, "stopped": True}) if args.json else f"pool {args.name!r} stopped", flush=True)
    return 0


def register(sub: Any) -> None:
    """Add ``elastic pool ...`` to the ``elastic`` parser's subparsers."""
    pool = sub.add_parser("pool", help="a pool of slices shared by many jobs, by priority and quota")
    verbs = pool.add_subparsers(dest="pool_command", required=True)
    start = verbs.add_parser("start", help="start a pool of N slices on the cluster named by RAY_ADDRESS")
    start.add_argument("--slices", type=int, required=True, help="how many slices the pool lends")
    start.add_argument(
        "--quota", type=parse_quota, action="append", metavar="USER=N", help="at most N slices for USER's jobs"
    )
    start.set_defaults(func=_start)
    for verb, func, text in (
        ("status", _status, "the pool's slices, jobs, holders, priorities, queue and seconds below asked"),
        ("events", _events, "the pool's decisions and why (a user sees their own jobs' only)"),
        ("mark", _mark, "a slice failed (its holder's user or the operator) or returned (the operator)"),
        ("stop", _stop, "stop the pool and forget its actor records (its operator only)"),
    ):
        p = verbs.add_parser(verb, help=text)
        p.set_defaults(func=func)
    mark = verbs.choices["mark"]
    mark.add_argument("--slice", type=int, required=True, help="the pool's number of the slice")
    state = mark.add_mutually_exclusive_group(required=True)
    state.add_argument("--failed", action="store_true", help="it failed: a job with spares gets another")
    state.add_argument("--returned", action="store_true", help="it is back: lent again by priority")
    for p in verbs.choices.values():
        p.add_argument("--name", required=True, help="the pool's name")
        p.add_argument(
            "--user",
            action="append" if p is start else None,
            help="start: admit this user (repeatable); else: act as this user, with their credential",
        )
        if p is not start:
            add_credential(p)
        p.add_argument("--json", action="store_true", help="JSON on stdout")
        p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
