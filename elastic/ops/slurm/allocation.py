"""What a Slurm allocation tells one node, read once, and the job's shared directory.

:class:`SlurmNode` is this task's view of the allocation (``SLURM_*`` read at the entry point, nowhere else).
:class:`JobDir` is ``<dir>/<job name>/`` on the filesystem every node shares (where Slurm writes the job's output):
the head writes ``head.json`` there (the Ray address, the run's Slurm job id), the other nodes and any one-node
job that joins later read it, and the head writes ``done.<slurm job id>`` with the entry point's exit status when
it ends. Two requests reach the head the same way: ``stop.<slurm job id>`` (the batch step was signalled: the job
saves and stops) and ``leave.<node>`` (a node's task was signalled: its slice leaves by the deadline written).
The cluster's token file lives there too (0600 in a 0700 directory): only the job's user can join.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.errors import ClusterError, ConfigError

__all__ = ["JobDir", "SlurmNode", "node_address"]

POLL_S = 0.25


@dataclass(frozen=True, kw_only=True)
class SlurmNode:
    """This task's place in its allocation."""

    job_id: str
    job_name: str
    node_name: str
    node_index: int  # 0 on the allocation's first node (the head)
    num_nodes: int
    submit_dir: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmNode:
        env = os.environ if env is None else env
        missing = [k for k in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_JOB_NUM_NODES") if k not in env]
        if missing:
            raise ConfigError(
                f"not inside a Slurm allocation ({', '.join(missing)} unset): run this from an sbatch script "
                "(`elastic slurm template`) or under srun"
            )
        return cls(
            job_id=env["SLURM_JOB_ID"],
            job_name=env.get("SLURM_JOB_NAME", f"slurm-{env['SLURM_JOB_ID']}"),
            node_name=env.get("SLURMD_NODENAME", "localhost"),
            node_index=int(env["SLURM_NODEID"]),
            num_nodes=int(env["SLURM_JOB_NUM_NODES"]),
            submit_dir=env.get("SLURM_SUBMIT_DIR", os.getcwd()),
        )


def node_address(node_name: str) -> str:
    """The address Slurm reaches this node at (its ``NodeAddr``), which its Ray node binds to; the host name's
    address when ``scontrol`` does not say."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", node_name], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for word in out.split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    import socket

    return socket.gethostbyname(socket.gethostname())


class JobDir:
    """``<root>/<job name>/``: the head's record, the token, the end marker."""

    def __init__(self, root: str | os.PathLike[str], job_name: str) -> None:
        if not job_name or "/" in job_name:
            raise ConfigError(f"a job name for the Slurm job dir must be a plain name, got {job_name!r}")
        self.path = Path(root) / job_name
        self.job_name = job_name

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path.chmod(0o700)

    @property
    def token_path(self) -> Path:
        return self.path / "ray_token"

    def new_token(self) -> Path:
        """A fresh cluster token (0600) for this run."""
        partial = self.path / f".ray_token.{os.getpid()}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        partial.replace(self.token_path)
        return self.token_path

    def _write_json(self, name: str, data: dict[str, Any]) -> None:
        partial = self.path / f".{name}.{os.getpid()}"
        partial.write_text(json.dumps(data))
        partial.replace(self.path / name)

    def write_head(self, *, address: str, slurm_job_id: str, num_nodes: int) -> None:
        self._write_json(
            "head.json",
            {"address": address, "slurm_job_id": slurm_job_id, "num_nodes": num_nodes, "started": time.time()},
        )

    def head(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / "head.json").read_text())
        except (OSError, ValueError):
            return None

    def wait_head(self, *, slurm_job_id: str | None, timeout_s: float) -> dict[str, Any]:
        """The head's record, once written (by ``slurm_job_id``'s head; None: the newest run that has not ended).
        Raises :class:`ClusterError` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.head()
            if found is not None:
                ours = slurm_job_id is None or found.get("slurm_job_id") == slurm_job_id
                if ours and self.exit_code(found["slurm_job_id"]) is None:
                    return found
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"no running head of job {self.job_name} in {self.path} within {timeout_s:g}s"
                    + (f" (Slurm job {slurm_job_id})" if slurm_job_id else "")
                )
            time.sleep(POLL_S)

    def mark_done(self, slurm_job_id: str, exit_code: int) -> None:
        self._write_json(f"done.{slurm_job_id}", {"exit_code": exit_code, "ended": time.time()})

    def clear_done(self, slurm_job_id: str) -> None:
        """Forget a run's end and stop request (a requeued run keeps its job id)."""
        (self.path / f"done.{slurm_job_id}").unlink(missing_ok=True)
        (self.path / f"stop.{slurm_job_id}").unlink(missing_ok=True)

    def request_stop(self, slurm_job_id: str, reason: str) -> None:
        """Ask run ``slurm_job_id``'s head to stop the job (save to the persistent tier at a step boundary)."""
        self._write_json(f"stop.{slurm_job_id}", {"reason": reason, "at": time.time()})

    def stop_request(self, slurm_job_id: str) -> str | None:
        """Why run ``slurm_job_id`` was asked to stop; None while it was not."""
        try:
            return str(json.loads((self.path / f"stop.{slurm_job_id}").read_text())["reason"])
        except (OSError, ValueError, KeyError):
            return None

    def request_leave(self, node_name: str, deadline: float, reason: str) -> None:
        """Ask the head to take ``node_name`` off the job by ``deadline`` (wall clock): a notice for its slice."""
        self._write_json(f"leave.{node_name}", {"deadline": deadline, "reason": reason})

    def take_leaves(self) -> dict[str, tuple[float, str]]:
        """The nodes asked to leave (node -> (deadline, reason)), each request removed as it is read."""
        out = {}
        for path in sorted(self.path.glob("leave.*")):
            try:
                found = json.loads(path.read_text())
                out[path.name.removeprefix("leave.")] = (float(found["deadline"]), str(found["reason"]))
            except (OSError, ValueError, KeyError):
                continue  # half written: read at the next poll
            path.unlink(missing_ok=True)
        return out

    def exit_code(self, slurm_job_id: str) -> int | None:
        """The entry point's exit status once that run's head ended; None while it runs."""
        try:
            return int(json.loads((self.path / f"done.{slurm_job_id}").read_text())["exit_code"])
        except (OSError, ValueError, KeyError):
            return None
