"""One Ray node for one Slurm node: ``ray start --block`` of this Python's Ray, on the node's Slurm address, with
ports the OS picks (several Slurm nodes may share a host), a temp dir of its own, and the resources that place
one slice's worker on it (``elastic_host: 1``, and ``slurm_node_<name>: 1`` naming the Slurm node).

Stopping it SIGTERMs ``ray start`` (Ray then stops what it started), and SIGKILLs by pid whatever of its session
is left after a bounded wait. When Slurm ends the step instead (the node set down, the job cancelled), slurmd
kills every process of the task, Ray's included: ``proctrack/linuxproc`` and ``cgroup`` follow descendants.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from elastic.errors import ClusterError

__all__ = ["HOST_RESOURCE", "RayNode", "host_resources", "ray_env"]

HOST_RESOURCE = "elastic_host"  # one per Ray node of an allocation: a slice's worker asks for 1
STOP_TIMEOUT_S = 20.0


def host_resources(node_name: str, slurm_job_id: str) -> dict[str, float]:
    """The custom resources of a Slurm node's Ray node."""
    return {HOST_RESOURCE: 1.0, f"slurm_node_{node_name}": 1.0, f"slurm_job_{slurm_job_id}": 1.0}


def ray_env(token_path: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Ray node or client of the job's cluster: the job's token, no other cluster's
    settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("RAY_")}
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # the job has ended when a node is stopped: nothing to drain
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _free_ports(n: int, host: str) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RayNode:
    """A ``ray start --block`` process of this node."""

    def __init__(
        self,
        *,
        ip: str,
        temp_dir: Path,
        env: dict[str, str],
        resources: dict[str, float],
        head_address: str | None = None,
        object_store_memory: int | None = None,
        log_path: Path,
    ) -> None:
        self.ip, self.temp_dir, self.log_path = ip, temp_dir, log_path
        self.is_head = head_address is None
        ports = _free_ports(8, ip)
        self.port = ports[0]  # the head's GCS port
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats"]
        cmd += ["--node-ip-address", ip, "--temp-dir", str(temp_dir), "--resources", json.dumps(resources)]
        named = ["--metrics-export-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port"]
        named += ["--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"]
        for flag, port in zip(named, ports[2:], strict=True):
            cmd += [flag, str(port)]
        cmd += ["--min-worker-port", "0", "--max-worker-port", "0"]
        if object_store_memory:
            cmd += ["--object-store-memory", str(object_store_memory)]
        if self.is_head:
            cmd += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
            cmd += ["--ray-client-server-port", str(ports[1])]
        else:
            cmd += ["--address", str(head_address)]
        temp_dir.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_started(self, timeout_s: float) -> None:
        """Until ``ray start`` says the node runs (its raylet registered); :class:`ClusterError` with the node's
        log if it exits or runs out of time first."""
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log_tail(100_000):
            if not self.alive():
                raise ClusterError(f"ray start exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the Ray node did not start within {timeout_s:g}s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, *, hard: bool = False) -> list[int]:
        """Stop the node and everything it started; the pids that had to be SIGKILLed. ``hard``: SIGKILL at once
        (Slurm is ending the task: it SIGKILLs what is left after its ``KillWait``, and a process whose parent died
        first is no longer the task's)."""
        if self.alive() and not hard:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        left = _session(self.proc.pid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Ray's workers keep the session of the ``ray start`` that began it)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    found.append(int(entry))
            except OSError:
                continue
    return found
