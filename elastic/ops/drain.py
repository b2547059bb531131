"""``elastic drain --job J --slice K [--deadline 30s] [--reason TEXT]``: the operator's notice that a slice will go.

The command finds the job's supervisor on the cluster named by ``RAY_ADDRESS`` and hands it a :class:`Notice` with
source ``operator`` through the supervisor's one ``notice`` method, as every other source does. A job or slice it does
not know, or a deadline already past, is refused in one line (exit status non-zero); the job is unharmed.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from elastic.ops.commands import add_credential, job_supervisor, operator_token

__all__ = ["parse_deadline", "register"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_DEADLINE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([smh]?)\s*$")


def parse_deadline(text: str) -> float:
    """Seconds from now: ``30``, ``30s``, ``2m``, ``1h`` (``ConfigError`` for anything else). A value of 0 or less is
    returned as is: the notice refuses it (its deadline has passed)."""
    from elastic.errors import ConfigError

    match = _DEADLINE.match(text)
    if match is None:
        raise ConfigError(f"--deadline is seconds from now, as 30, 30s, 2m or 1h; got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _drain(args: argparse.Namespace) -> int:
    import ray

    from elastic.errors import ElasticError
    from elastic.supervision.notices import make_notice

    notice = make_notice(args.slice, parse_deadline(args.deadline), args.reason, source="operator")
    token = operator_token(args, "drain")
    supervisor = job_supervisor(args.job, token)
    try:
        view: Any = ray.get(supervisor.notice.remote(notice), timeout=30)
    except ray.exceptions.RayTaskError as err:  # the supervisor's refusal: its own one line
        cause = err.cause
        if isinstance(cause, ElasticError):
            raise cause from None
        raise
    out: dict[str, Any] = {
        "job": args.job,
        "slices": sorted(notice.slices),
        "deadline_s": round(notice.lead_s, 3),
        "reason": notice.reason,
        "epoch": view.epoch,
        "active": sorted(view.active),
        "leaving": sorted(view.leaving),
    }
    print(
        json.dumps(out)
        if args.json
        else f"draining slice {args.slice} of job {args.job!r} within {notice.lead_s:.0f}s "
        f"(epoch {view.epoch}: running on {', '.join(map(str, out['active'])) or 'none'})",
        flush=True,
    )
    return 0


def register(sub: Any) -> None:
    """Add ``elastic drain`` to the ``elastic`` parser's subparsers."""
    drain = sub.add_parser(
        "drain",
        help="tell a running job that a slice will go: it leaves the slice at a step boundary, losing nothing",
    )
    drain.add_argument("--job", "--job-name", dest="job", default="demo", help="the job's name (default: demo)")
    drain.add_argument("--slice", type=int, required=True, help="the slice that will go")
    drain.add_argument("--deadline", default="30s", help="when it goes, from now: 30s, 2m, 1h (default: 30s)")
    drain.add_argument("--reason", default="operator drain", help="why it goes (written to the job's events)")
    add_credential(drain)
    drain.add_argument("--json", action="store_true")
    drain.add_argument("-v", "--verbose", action="store_true", help="tracebacks of errors")
    drain.set_defaults(func=_drain)
