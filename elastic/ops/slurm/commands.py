"""``elastic slurm template | run | start | status``: the elastic job on a Slurm allocation."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

from elastic.errors import ConfigError

__all__ = ["TEMPLATE", "default_dir", "register", "template_text"]

TEMPLATE = "elastic.sbatch"


def template_text() -> str:
    """The sbatch template shipped with the package."""
    return resources.files("elastic.ops.slurm").joinpath(TEMPLATE).read_text()


def default_dir() -> str:
    """The root of job dirs: ``$ELASTIC_SLURM_DIR``, else ``.elastic-slurm`` in the submit (or current) dir."""
    found = os.environ.get("ELASTIC_SLURM_DIR")
    return found or str(Path(os.environ.get("SLURM_SUBMIT_DIR", os.getcwd())) / ".elastic-slurm")


def _job_dir(args: argparse.Namespace) -> Any:
    from elastic.ops.slurm.allocation import JobDir

    name = args.job or os.environ.get("SLURM_JOB_NAME")
    if not name:
        raise ConfigError("name the job: --job NAME (inside an allocation: its Slurm job name)")
    return JobDir(args.dir or default_dir(), name)


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return cmd


def _template(args: argparse.Namespace) -> int:
    text = template_text()
    if args.out:
        Path(args.out).write_text(text)
        print(Path(args.out).resolve())
    else:
        print(text, end="")
    return 0


def _start_args(args: argparse.Namespace) -> list[str]:
    out = ["--regrow-grace", str(args.regrow_grace), "--max-joins", str(args.max_joins)]
    out += ["--nodes-timeout", str(args.nodes_timeout), "--head-timeout", str(args.head_timeout)]
    out += ["--drain-deadline", str(args.drain_deadline)]
    if args.object_store_memory:
        out += ["--object-store-memory", str(args.object_store_memory)]
    return out


def _run(args: argparse.Namespace) -> int:
    from elastic.ops.slurm.launch import run_allocation

    cmd = _command(args)
    if not cmd:
        raise ConfigError("give the entry point after --: elastic slurm run -- python train.py ...")
    return run_allocation(_job_dir(args), cmd, _start_args(args))


def _start(args: argparse.Namespace) -> int:
    from elastic.log import configure_logging
    from elastic.ops.slurm.launch import start_node
    from elastic.ops.slurm.regrow import RegrowPolicy

    configure_logging()
    options = {
        "policy": RegrowPolicy(grace_s=args.regrow_grace, max_joins=args.max_joins),
        "nodes_timeout_s": args.nodes_timeout,
        "head_timeout_s": args.head_timeout,
        "object_store_memory": args.object_store_memory,
        "start_args": _start_args(args),
        "drain_deadline_s": args.drain_deadline,
    }
    return start_node(_job_dir(args), join=args.join, cmd=_command(args), options=options)


def _status(args: argparse.Namespace) -> int:
    from elastic.ops.slurm.regrow import join_name

    job_dir = _job_dir(args)
    head = job_dir.head()
    out: dict[str, Any] = {"job": job_dir.job_name, "dir": str(job_dir.path), "head": head}
    if head:
        out["exit_code"] = job_dir.exit_code(head["slurm_job_id"])
        out["running"] = out["exit_code"] is None
        out["env"] = {
            "RAY_ADDRESS": head["address"],
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(job_dir.token_path),
        }
    try:
        names = f"{job_dir.job_name},{join_name(job_dir.job_name)}"
        squeue = subprocess.run(
            ["squeue", "-h", "-n", names, "-o", "%i %j %T %D %N %r"], capture_output=True, text=True, timeout=20
        ).stdout
        out["squeue"] = [line.split(maxsplit=5) for line in squeue.splitlines()]
    except (OSError, subprocess.SubprocessError) as err:
        out["squeue"] = f"squeue failed: {err}"
    if args.json:
        print(json.dumps(out))
        return 0
    state = "no run yet" if head is None else ("running" if out["running"] else f"ended ({out['exit_code']})")
    print(
        f"{job_dir.job_name}: {state}"
        + (f", Slurm job {head['slurm_job_id']}, Ray at {head['address']}" if head else "")
    )
    for row in out["squeue"] if isinstance(out["squeue"], list) else []:
        print("  " + " ".join(row))
    if head and out["running"]:
        print("  " + " ".join(f"{k}={v}" for k, v in out["env"].items()) + f" elastic status --job {job_dir.job_name}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", "--job-name", dest="job", help="the job's name (default: $SLURM_JOB_NAME)")
    p.add_argument("--dir", help="root of the job dirs, on a filesystem every node shares (default: see the guide)")


def _node_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--regrow-grace", type=float, default=5.0, help="seconds below the node count before asking")
    p.add_argument("--max-joins", type=int, default=4, help="one-node join jobs submitted at most (0: never)")
    p.add_argument(
        "--drain-deadline",
        type=float,
        default=60.0,
        help="seconds of warning a Slurm drain of a node, or a SIGTERM to its task, gives the job (it leaves the "
        "node at a step boundary)",
    )
    p.add_argument("--nodes-timeout", type=float, default=300.0, help="seconds for every node to join at start")
    p.add_argument("--head-timeout", type=float, default=300.0, help="seconds for the head to come up")
    p.add_argument("--object-store-memory", type=int, help="bytes of Ray object store per node (default: Ray's)")


def register(sub: Any) -> None:
    """Add ``slurm`` to the ``elastic`` command's subparsers."""
    slurm = sub.add_parser("slurm", help="run an elastic job on a Slurm allocation (one Ray node per Slurm node)")
    cmds = slurm.add_subparsers(dest="slurm_command", required=True)
    template = cmds.add_parser("template", help="print the sbatch template shipped with the package")
    template.add_argument("--out", help="write it to this file instead")
    template.set_defaults(func=_template)

    run = cmds.add_parser("run", help="in an sbatch script: start Ray on every node, run the entry point")
    _common(run)
    _node_options(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the entry point and its arguments")
    run.set_defaults(func=_run)

    start = cmds.add_parser("start", help="one node's part (run starts it with srun on every node)")
    _common(start)
    _node_options(start)
    start.add_argument("--join", action="store_true", help="join the running job's cluster (a one-node job)")
    start.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the entry point (the head runs it)")
    start.set_defaults(func=_start)

    status = cmds.add_parser("status", help="the job's Slurm jobs, its head, and how to reach its cluster")
    _common(status)
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(func=_status)
