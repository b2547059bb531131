"""``ray job submit`` for real: a Ray head started from this venv, the repo uploaded as working_dir,
``python -m elastic.examples.train`` run as the job's entry point.

The head is our own ``ray start --head --block`` subprocess (never ``ray stop``: that stops every Ray
process of the user), on free loopback ports, with its own temp dir and its own auth token, so it
cannot collide with, or authenticate against, any other cluster on the machine. The finalizer
SIGTERMs that process (Ray drains and stops its children), SIGKILLs its process group if that is not
enough, and checks that nothing of it is left.
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
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
PYTHON = VENV_BIN / "python"

# Ray 2.60 already skips .gitignore'd paths (and .rayignore, and by default .git/.venv/venv/__pycache__)
# when it zips a working_dir; these excludes keep the 1 GiB .venv out even where that is switched off
# (RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 or RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES='').
EXCLUDES = [".venv/", "venv/", ".git/", "__pycache__/", "*.egg-info/", ".pytest_cache/", "build/", "dist/"]

HEAD_READY_TIMEOUT_S = 90
SUBMIT_TIMEOUT_S = 150
STOP_TIMEOUT_S = 40


@dataclass
class RayHead:
    proc: subprocess.Popen
    temp_dir: Path
    dashboard_url: str
    env: dict[str, str]  # what a client needs: RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH, PATH

    def log(self) -> str:
        try:
            return (self.temp_dir / "head.log").read_text(errors="replace")[-4000:]
        except OSError:
            return "<no head log>"


def _free_ports(n: int) -> list[int]:
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


def _clean_env(token_path: Path) -> dict[str, str]:
    # Drop the caller's RAY_* settings (RAY_ADDRESS, RAY_AUTH_TOKEN, gitignore overrides, ...):
    # the head and the client must see only this cluster's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",  # the job's `python` is the venv's
    )
    return env


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _dashboard_ready(url: str, token: str) -> bool:
    req = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200 and "ray_version" in json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_head(proc: subprocess.Popen) -> None:
    pgid = proc.pid  # started with start_new_session=True: the group is ours alone
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` drains, then stops every child it started
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def ray_head():
    if not RAY.exists():
        pytest.skip(f"no ray CLI next to {sys.executable}")
    # Not pytest's tmp_path: Ray puts unix sockets under <temp-dir>/session_<date>_<pid>/sockets/, and
    # /tmp/pytest-of-<user>/pytest-<n>/<test name>0/ makes those paths longer than the 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="rayjob-", dir="/tmp"))
    token = secrets.token_hex(32)
    token_path = temp_dir / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    env = _clean_env(token_path)

    gcs, dash, client, agent_http, agent_grpc, rt_env, metrics, node_mgr, obj_mgr = _free_ports(9)
    cmd = [
        str(RAY), "start", "--head", "--block", "--disable-usage-stats",
        "--temp-dir", str(temp_dir / "ray"),
        "--port", str(gcs),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
        "--ray-client-server-port", str(client),
        "--dashboard-agent-listen-port", str(agent_http),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--runtime-env-agent-port", str(rt_env),
        "--metrics-export-port", str(metrics),
        "--node-manager-port", str(node_mgr),
        "--object-manager-port", str(obj_mgr),
        "--min-worker-port", "0", "--max-worker-port", "0",  # 0: each worker gets an OS-chosen port
    ]
    with open(temp_dir / "head.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=temp_dir, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    head = RayHead(proc=proc, temp_dir=temp_dir, dashboard_url=f"http://127.0.0.1:{dash}", env=env)
    try:
        deadline = time.monotonic() + HEAD_READY_TIMEOUT_S
        while not (_dashboard_ready(head.dashboard_url, token) and _port_open(agent_http)):
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}:\n{head.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"Ray head not ready within {HEAD_READY_TIMEOUT_S}s:\n{head.log()}")
            time.sleep(0.25)
        yield head
    finally:
        _stop_head(proc)
        left = _group_alive(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the Ray head (process group {proc.pid}) are still running"


def _json_lines(text: str) -> list[dict]:
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


@pytest.mark.timeout(240)
def test_ray_job_submit_trains_on_the_cluster(ray_head: RayHead):
    cmd = [
        str(RAY), "job", "submit",
        "--address", ray_head.dashboard_url,
        "--working-dir", str(REPO_ROOT),
        "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
        "--", str(PYTHON), "-m", "elastic.examples.train", "--steps", "12", "--json",
    ]
    try:
        out = subprocess.run(cmd, env=ray_head.env, cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`ray job submit` did not finish within {SUBMIT_TIMEOUT_S}s; output so far:\n"
                    f"{e.stdout}\n{e.stderr}\nhead log:\n{ray_head.log()}")
    output = out.stdout + "\n" + out.stderr
    assert out.returncode == 0, f"`ray job submit` exited {out.returncode}:\n{output}\nhead log:\n{ray_head.log()}"

    reports = [r for r in _json_lines(out.stdout) if "steps_committed" in r]
    assert reports, f"no JSON report with steps_committed in the job's output:\n{output}"
    report = reports[-1]
    assert report["steps_committed"] == 12, report
    assert report["client_restarts"] == 0, report

    # The upload really left the git-ignored bulk behind (the job ran from this unpacked copy).
    packages = [p for p in ray_head.temp_dir.glob("ray/session_*/runtime_resources/working_dir_files/_ray_pkg_*")
                if p.is_dir()]
    assert packages, "no unpacked working_dir package on the head"
    for pkg in packages:
        assert (pkg / "elastic").is_dir(), sorted(os.listdir(pkg))
        for ignored in (".venv", ".git", ".pytest_cache"):
            assert not (pkg / ignored).exists(), f"{ignored} was uploaded: {sorted(os.listdir(pkg))}"
