"""Growing back on Slurm's terms: a lost node is replaced by a new allocation, a one-node job that joins the job's
Ray cluster. :func:`decide_regrow` is the pure choice (the clock passed in, the answer with its reason);
:func:`submit_join` and :func:`queued_joins` are the two Slurm calls it needs.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from elastic.errors import ClusterError, ConfigError

__all__ = ["Hold", "Regrow", "RegrowPolicy", "Submit", "decide_regrow", "join_name", "queued_joins", "submit_join"]


@dataclass(frozen=True, kw_only=True)
class RegrowPolicy:
    """When the job asks Slurm for replacement nodes. ``grace_s``: how long the job runs below its node count
    before it asks (a node that comes back by itself needs none); ``max_joins``: how many one-node jobs it submits
    in all (0: never, the user submits them)."""

    grace_s: float = 5.0
    max_joins: int = 4

    def __post_init__(self) -> None:
        if not self.grace_s >= 0:
            raise ConfigError(f"regrow grace_s must be >= 0, got {self.grace_s!r}")
        if not isinstance(self.max_joins, int) or self.max_joins < 0:
            raise ConfigError(f"regrow max_joins must be an int >= 0, got {self.max_joins!r}")


@dataclass(frozen=True)
class Submit:
    count: int
    reason: str


@dataclass(frozen=True)
class Hold:
    reason: str


Regrow = Submit | Hold


def decide_regrow(
    *, want: int, alive: int, queued: int, submitted: int, below_since: float | None, now: float, policy: RegrowPolicy
) -> Regrow:
    """How many one-node jobs to submit now. ``alive``: the job's Ray nodes up; ``queued``: its join jobs not
    joined yet (pending or starting); ``submitted``: join jobs submitted so far; ``below_since``: when ``alive``
    first fell below ``want`` (None: it is not below)."""
    missing = want - alive - queued
    if alive >= want or below_since is None:
        return Hold("every node is up")
    if missing <= 0:
        return Hold(f"{queued} join job(s) queued for {want - alive} missing node(s)")
    if now - below_since < policy.grace_s:
        return Hold(f"below {want} nodes for {now - below_since:.1f}s of a {policy.grace_s:g}s grace")
    left = policy.max_joins - submitted
    if left <= 0:
        return Hold(f"{submitted} join job(s) submitted already, the most the policy allows ({policy.max_joins})")
    count = min(missing, left)
    return Submit(count, f"{alive} of {want} nodes up for {now - below_since:.1f}s, {queued} queued: ask for {count}")


def join_name(job_name: str) -> str:
    """The Slurm job name of the job's one-node joins."""
    return f"{job_name}-join"


def submit_join(job_name: str, job_dir: str, *, start_args: Sequence[str] = ()) -> str:
    """``sbatch -N1`` a job that starts a Ray node joined to ``job_name``'s cluster (``start_args``: the node
    options of ``elastic slurm start``); its Slurm job id. Its output goes where Slurm puts it by default for the
    submitting directory, ``<name>-join-<id>.out``."""
    cmd = ["sbatch", "--parsable", "-N1", "--ntasks-per-node=1", f"--job-name={join_name(job_name)}"]
    cmd += ["--output=%x-%j.out", "--no-requeue"]
    start = [sys.executable, "-m", "elastic.cli", "slurm", "start", "--join", "--dir", job_dir, "--job", job_name]
    start += list(start_args)
    cmd += ["--wrap", "exec srun " + shlex.join(start)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or ""
        raise ClusterError(f"sbatch of a join job for {job_name} failed: {err} {detail.strip()}") from err
    return done.stdout.strip().split(";", 1)[0]


def queued_joins(job_name: str) -> list[tuple[str, str]]:
    """``(slurm job id, state)`` of the job's join jobs Slurm still holds (pending, configuring or running)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-n", join_name(job_name), "-o", "%i %T"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [(parts[0], parts[1]) for parts in (line.split() for line in out.splitlines()) if len(parts) == 2]
