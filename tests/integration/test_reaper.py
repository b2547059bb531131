"""A SIGKILLed client that started an embedded Ray leaves none of that cluster's processes behind.

Without ``elastic.control.reaper`` Ray's gcs_server and raylet die with the client (Ray makes them share its fate)
but the raylet's children (the dashboard and runtime-env agents, idle workers) and the dashboard keep
running; the reaper that ``connect()`` starts must end them all, then itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLIENT = r"""
import json, sys, time
import psutil, ray
from elastic.control.cluster import connect

assert connect(), "expected connect() to start an embedded cluster"
session_dir = ray._private.worker._global_node.get_session_dir_path()
deadline = time.monotonic() + 60
while True:  # wait (bounded) for the raylet's agents, the processes the issue is about
    procs = psutil.Process().children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in procs if p.is_running())
    if ("DashboardAgent" in names and "RuntimeEnvAgent" in names) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({"session_dir": session_dir, "pids": [[p.pid, p.create_time()] for p in procs]}), flush=True)
if sys.argv[1:] == ["shutdown"]:
    from elastic.control.connect import REAPERS
    ray.shutdown()
    print(json.dumps({"reaper": REAPERS[0]}), flush=True)
time.sleep(600)  # until SIGKILLed
"""


def _session_leftovers(session_dir: str, pids: list[list[float]]) -> list[str]:
    """The client's former descendants still alive, and any process naming the session dir."""
    naming = re.compile(re.escape(session_dir) + r"(?![\w.-])")
    left = {}
    for pid, started in pids:
        try:
            proc = psutil.Process(int(pid))
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                left[proc.pid] = " ".join(proc.cmdline())[:120]
        except psutil.Error:
            pass
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if naming.search(cmdline) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            left[proc.pid] = cmdline[:120]
    return [f"{pid}: {cmd}" for pid, cmd in sorted(left.items())]


def _start_client(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_DISABLE_USAGE_STATS="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def _clean_up(info: dict) -> None:
    """End what a failed test left (so that it does not burden the next one)."""
    from elastic.control.reaper import reap

    known = {}
    for pid, started in info.get("pids", []):
        try:
            proc = psutil.Process(int(pid))
            if proc.create_time() == started:
                known[proc.pid] = proc
        except psutil.Error:
            pass
    if "session_dir" in info:
        reap(info["session_dir"], known)


@pytest.mark.timeout(120)
def test_sigkilled_client_leaves_no_ray_process_behind():
    client = _start_client()
    info: dict = {}
    try:
        line = client.stdout.readline()  # bounded by the client's own 60 s deadline and the test timeout
        assert line, f"the client exited before reporting its cluster (rc={client.wait(timeout=10)})"
        info = json.loads(line)
        assert _session_leftovers(info["session_dir"], info["pids"]), "the client reported no Ray process"
        names = " ".join(_session_leftovers(info["session_dir"], info["pids"]))
        assert "DashboardAgent" in names and "RuntimeEnvAgent" in names, names
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        client.stdout.close()

    deadline = time.monotonic() + 60
    left = _session_leftovers(info["session_dir"], info["pids"])
    while left and time.monotonic() < deadline:
        time.sleep(0.5)  # polling: the reaper works asynchronously in its own process
        left = _session_leftovers(info["session_dir"], info["pids"])
    if left:
        _clean_up(info)
    assert not left, "processes of the SIGKILLed client's Ray session still run:\n" + "\n".join(left)


@pytest.mark.timeout(120)
def test_reaper_exits_by_itself_after_a_normal_shutdown():
    """A client that calls ``ray.shutdown()`` and lives on: its reaper notices and exits, nothing left."""
    client = _start_client("shutdown")
    info: dict = {}
    try:
        info = json.loads(client.stdout.readline() or "{}")
        reaper = psutil.Process(json.loads(client.stdout.readline() or "{}")["reaper"])
        deadline = time.monotonic() + 30
        while _alive(reaper) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling: the reaper checks the session every ~2 s
        assert not _alive(reaper), "the reaper still runs after ray.shutdown()"
        assert client.poll() is None  # the client itself was not touched
        assert not _session_leftovers(info["session_dir"], info["pids"])
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        client.stdout.close()
        _clean_up(info)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
