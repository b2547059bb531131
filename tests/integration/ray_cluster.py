"""Real Ray clusters for the integration tests: ``ray start --block`` processes from this venv (a head, and nodes
joined to it), on free loopback ports, in a temp dir of their own with an auth token of their own, so that they
cannot collide with, or authenticate against, any other cluster on the machine. Never ``ray stop``: that stops
every Ray process of the user.

Stopping a node SIGTERMs its ``ray start --block`` process (Ray then stops every process it started) and checks
that nothing of it is left: nothing in its session (raylet workers get their own process groups, but stay in that
session) and nothing whose environment or command line names the cluster's unique temp dir (a job's driver runs in
a session of its own, with RAY_AUTH_TOKEN_PATH under that dir). Whatever is left after a bounded wait is
SIGKILLed by pid and reported.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
PYTHON = VENV_BIN / "python"

READY_TIMEOUT_S = 90
STOP_TIMEOUT_S = 40
NODE_MARK = "ELASTIC_TEST_RAY_NODE"  # in each node's environment (its workers inherit it): which node a process is of


@dataclass
class RayNode:
    """One ``ray start --block`` process: the head or a node joined to it."""

    name: str
    proc: subprocess.Popen
    temp_dir: Path  # the node's own Ray temp dir (under the cluster's)
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return f"<no log of node {self.name}>"


@dataclass
class RayHead:
    proc: subprocess.Popen
    temp_dir: Path  # the cluster's own dir: every node's temp dir, logs and the token are under it
    dashboard_url: str
    env: dict[str, str]  # what a client needs: RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH, PATH
    gcs_address: str = ""
    token: str = ""
    nodes: list[RayNode] = field(default_factory=list)  # joined with start_node

    def log(self) -> str:
        try:
            return (self.temp_dir / "head.log").read_text(errors="replace")[-4000:]
        except OSError:
            return "<no head log>"

    @property
    def session_logs(self) -> Path:
        """The head's log dir of its current session (the job drivers' logs: ``job-driver-<id>.log``)."""
        return self.temp_dir / "ray" / "session_latest" / "logs"


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env(token_path: Path) -> dict[str, str]:
    # Drop the caller's RAY_* settings (RAY_ADDRESS, RAY_AUTH_TOKEN, gitignore overrides, ...):
    # the nodes and the client must see only this cluster's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != NODE_MARK}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_USAGE_STATS_ENABLED="0",
        # SIGTERM makes `ray start --block` drain the node for up to 30 s first; a test has nothing to drain.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        # the job's `python`, and the `pip` Ray's py_modules installs a wheel with, are the venv's
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _get_json(url: str, token: str) -> dict | None:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def dashboard_ready(url: str, token: str) -> bool:
    found = _get_json(f"{url}/api/version", token)
    return bool(found) and "ray_version" in found


def alive_nodes(head: RayHead) -> int | None:
    """How many nodes the cluster's GCS counts alive (the dashboard's state API); None if it did not answer."""
    found = _get_json(f"{head.dashboard_url}/api/v0/nodes?limit=100", head.token)
    try:
        rows = found["data"]["result"]["result"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return sum(1 for row in rows if row.get("state") == "ALIVE")


def job_status(head: RayHead, submission_id: str) -> str | None:
    """The job's status (``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED``, ``STOPPED``); None if unknown."""
    found = _get_json(f"{head.dashboard_url}/api/jobs/{submission_id}", head.token)
    return found.get("status") if found else None


def leftovers(session_ids: set[int], marker: str) -> dict[int, str]:
    """Processes of the cluster still running: in one of its nodes' sessions, or naming its temp dir."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                sid = os.getsid(pid)
            except OSError:
                sid = -1
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().decode(errors="replace")
            except OSError:
                environ = ""
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":  # a zombie is already dead
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if sid in session_ids or marker in cmdline or marker in environ:
            found[pid] = cmdline[:160]
    return found


def process_env(pid: int) -> dict[str, str]:
    """The environment a process started with ({} if it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def processes_titled(prefix: str) -> dict[int, dict[str, str]]:
    """Live processes whose command line (a Ray worker's process title, ``ray::SliceWorker...``) starts with
    ``prefix``: pid -> environment."""
    found: dict[int, dict[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith(prefix):
            found[int(entry)] = process_env(int(entry))
    return found


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each ``ray start --block`` (it then stops every process it started), nodes before the head."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def stop_head(head: RayHead) -> dict[int, str]:
    """Stop the cluster: its joined nodes, then the head, and everything they started; return what had to be
    SIGKILLed (should be nothing)."""
    procs = [node.proc for node in head.nodes] + [head.proc]
    _stop(procs)
    if not os.path.isdir("/proc"):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        return {}
    marker = f"{head.temp_dir}{os.sep}"
    sessions = {proc.pid for proc in procs}
    # The job driver's watcher polls once a second before it reaps the driver, and a raylet's agents (dashboard,
    # runtime env) notice their raylet gone on a poll of their own: on a loaded 2-core machine that took over 15 s.
    deadline = time.monotonic() + 30
    left = leftovers(sessions, marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = leftovers(sessions, marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.wait(timeout=10)
    return left


def _launch(cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _node_ports() -> list[str]:
    metrics, agent_http, agent_grpc, rt_env, node_mgr, obj_mgr = free_ports(6)
    return [
        "--metrics-export-port",
        str(metrics),
        "--dashboard-agent-listen-port",
        str(agent_http),
        "--dashboard-agent-grpc-port",
        str(agent_grpc),
        "--runtime-env-agent-port",
        str(rt_env),
        "--node-manager-port",
        str(node_mgr),
        "--object-manager-port",
        str(obj_mgr),
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",  # 0: each worker gets an OS-chosen port
    ]


def start_head(*, prefix: str = "rayjob-", extra: list[str] | None = None) -> RayHead:
    """Start a head and wait (bounded) until its dashboard and agent answer. Raises ``RuntimeError`` with the head's
    log if it does not come up (after stopping what it started); the caller stops it with :func:`stop_head`."""
    # Not pytest's tmp_path: Ray puts unix sockets under <temp-dir>/session_<date>_<pid>/sockets/, and
    # /tmp/pytest-of-<user>/pytest-<n>/<test name>0/ makes those paths longer than the 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    token = secrets.token_hex(32)
    token_path = temp_dir / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    env = clean_env(token_path)
    gcs, dash, client = free_ports(3)
    ports = _node_ports()
    cmd = [
        str(RAY),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--temp-dir",
        str(temp_dir / "ray"),
        "--port",
        str(gcs),
        "--include-dashboard",
        "true",
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dash),
        "--ray-client-server-port",
        str(client),
        *ports,
        *(extra or []),
    ]
    proc = _launch(cmd, {**env, NODE_MARK: "head"}, temp_dir, temp_dir / "head.log")
    head = RayHead(
        proc=proc,
        temp_dir=temp_dir,
        dashboard_url=f"http://127.0.0.1:{dash}",
        env=env,
        gcs_address=f"127.0.0.1:{gcs}",
        token=token,
    )
    agent_http = int(ports[ports.index("--dashboard-agent-listen-port") + 1])
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not (dashboard_ready(head.dashboard_url, token) and port_open(agent_http)):
            if proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {proc.returncode}:\n{head.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray head not ready within {READY_TIMEOUT_S}s:\n{head.log()}")
            time.sleep(0.25)
    except BaseException:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return head


def start_nodes(head: RayHead, count: int, *, extra: list[str] | None = None) -> list[RayNode]:
    """Join ``count`` nodes to the head (started together), each in a temp dir of its own under the cluster's;
    return once the GCS counts them all alive (bounded). Each node's processes carry ``NODE_MARK=<its name>`` in
    their environment."""
    before = alive_nodes(head) or 1
    started: list[RayNode] = []
    for _ in range(count):
        name = f"node{len(head.nodes) + 1}"
        node_dir = head.temp_dir / name
        node_dir.mkdir()
        cmd = [
            str(RAY),
            "start",
            "--block",
            "--disable-usage-stats",
            "--address",
            head.gcs_address,
            "--temp-dir",
            str(node_dir / "ray"),
            *_node_ports(),
            *(extra or []),
        ]
        log_path = node_dir / "node.log"
        node = RayNode(
            name=name,
            proc=_launch(cmd, {**head.env, NODE_MARK: name}, node_dir, log_path),
            temp_dir=node_dir,
            log_path=log_path,
        )
        head.nodes.append(node)  # stopped with the head, whatever happens next
        started.append(node)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (alive_nodes(head) or 0) < before + count:
        for node in started:
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray start of {node.name} exited with {node.proc.returncode}:\n{node.log()}")
        if time.monotonic() > deadline:
            logs = "\n".join(node.log() for node in started)
            raise RuntimeError(f"{count} Ray nodes not alive within {READY_TIMEOUT_S}s:\n{logs}")
        time.sleep(0.25)
    return started


def json_lines(text: str) -> list[dict]:
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found
